"""Where a step's time goes: torch.profiler over one call, its costliest launches and the share of each kind of work.

On a GPU each launched kernel's device time (cuBLAS's, cuDNN's, flash attention's, Inductor's Triton kernels'); on a
CPU each op's own CPU time, so the dry run exercises the same code. Kernels are sorted into kinds by their names:
attention, matmul (with fp32 matmuls, TF32 or not, apart: the block TREAD runs in fp32 after a route), norm,
gather/scatter, optimizer, elementwise, other. Inductor names its fused Triton kernels after the ops they fuse
(triton_poi_fused_native_layer_norm_..., triton_red_fused_...), so a fused norm reads as a norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (kind, name fragments), first match wins; names are matched lower-cased. Order matters: flash/SDPA kernels before
# the matmuls (some attention kernels carry "gemm" in their names), fp32 matmuls before the others.
KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn", "softmax")),
    ("matmul fp32", ("sgemm", "tf32", "f32f32_f32", "s1688gemm", "s16816gemm", "gemm_f32", "xmma_gemm_f32")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "addmm", "aten::mm", "aten::bmm", "aten::linear", "sm90_")),
    ("norm", ("layer_norm", "layernorm", "native_layer_norm", "rms_norm", "group_norm", "norm_")),
    ("gather/scatter", ("gather", "scatter", "index", "take_along", "embedding")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("elementwise", ("elementwise", "triton_poi", "triton_per", "triton_red", "vectorized", "unrolled", "reduce", "copy",
                     "fill", "aten::add", "aten::mul", "silu", "gelu", "cat")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in KINDS if any(p in lowered for p in parts)), "other")


def profile_call(call: Callable[[], None], device, top: int = 12) -> dict:
    """One call of `call` under torch.profiler: {"device_us", "top": the `top` costliest kernels (name, calls, us,
    kind), "shares": each kind's fraction of the summed time, "launches": kernels launched}. The call should be a
    warmed-up step: a first call's compilation would be profiled too."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        call()
        if cuda:
            torch.cuda.synchronize(device)
    # On CUDA the kernels alone: a host-side event (cudaLaunchKernel) that kineto links to a kernel would count its time twice.
    events = [e for e in prof.key_averages() if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
    rows = [(e.key, e.count, float(e.self_device_time_total if cuda else e.self_cpu_time_total)) for e in events]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    shares: dict[str, float] = {}
    for name, _, us in rows:
        shares[kind_of(name)] = shares.get(kind_of(name), 0.0) + us / total
    return {"device_us": total, "launches": sum(r[1] for r in rows), "clock": "device time" if cuda else "CPU time of each op",
            "top": [{"name": name[:100], "calls": count, "us": us, "kind": kind_of(name)} for name, count, us in rows[:top]],
            "shares": dict(sorted(shares.items(), key=lambda kv: -kv[1]))}


def share_line(profile: dict) -> str:
    """The shares in one line: 'matmul 61%, attention 14%, ...'."""
    return ", ".join(f"{kind} {share:.0%}" for kind, share in profile["shares"].items())


def markdown(title: str, profile: dict) -> list[str]:
    """A profile as report lines: the title, the shares, then the costliest launches."""
    lines = [f"{title}: {profile['device_us'] / 1e3:.1f} ms of {profile['clock']} in {profile['launches']} launches; "
             f"{share_line(profile)}", ""]
    lines += [f"- {x['us']:.0f} us in {x['calls']} call(s), {x['kind']}: `{x['name']}`" for x in profile["top"]]
    return lines + [""]
