"""Correctness sections of `python -m train.bench.gpu`: the two kernels against their references, and every
family on the device against the CPU path on the same weights. Each returns check records, never raises on a
mismatch: a failed check is a line in the report, and the run goes on.

Errors are measured as max |got - want| / max |want| over each tensor (the output, then every gradient), the
measure the kernel tests use, so a tolerance reads as "this fraction of the tensor's largest entry".
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

# Tolerances, relative to the reference tensor's largest entry.
# - fp32 kernels against the fp64 definition: 1e-4, ten times the interpreter tests' 1e-5, for sequences of 256
#   steps (the tests use up to 41) and the GPU's fused multiply-adds. A wrong index or a lost carry shows as O(1).
# - bf16 kernels against the fp64 definition on the same bf16-rounded inputs: 1e-2; only the outputs and
#   gradients are rounded, which costs 2^-8 of an entry, and the margin covers the sums of rounded terms.
# - the selective scan's very negative decay (delta A = -1e5 per step): 1e-5, as tests/test_selective_scan_triton.py,
#   which passes under the interpreter and missed on an H200 (1.36e-3 in the delta gradient).
KERNEL_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp32, decay -1e5": 1e-5}
# - a family on the device in fp32 against the CPU in fp32: 1e-3 (cuBLAS, cuDNN and the Triton kernels sum in
#   other orders than the CPU ops; TF32 is switched off for the comparison);
# - on the device under bf16 autocast against the CPU in fp32: 5e-2 for the output (every matmul rounds its inputs
#   to 8 bits) and 5e-2 for the whole gradient vector, ||g - g_ref|| / ||g_ref||, not tensor by tensor: a DiffMoE
#   token whose expert scores nearly tie may pick another expert after rounding, which changes that expert's
#   gradient by O(1) (seen on the CPU: 0.32 of its largest entry) but the whole gradient by little.
FAMILY_TOLERANCE = {"fp32": (1e-3, 1e-3), "bf16": (5e-2, 5e-2)}
FAMILIES = ("dit", "rwkv", "mamba", "diffmoe")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in fp64 on the CPU (inf where `got` is not finite)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _value_and_grads(fn, inputs: dict[str, torch.Tensor], upstream: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """fn(**inputs) and the gradient of <y, upstream> with respect to every input."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    y = fn(**leaves)
    grads = torch.autograd.grad((y.double() * upstream.to(y.device)).sum(), list(leaves.values()))
    return y, dict(zip(leaves, grads))


def _compare(kernel: str, precision: str, shape: str, fn, ref, inputs: dict, upstream: torch.Tensor) -> dict:
    """One check record: the kernel's output and gradients against the fp64 reference on the same inputs."""
    y, grads = _value_and_grads(fn, inputs, upstream)
    y_ref, grads_ref = _value_and_grads(ref, {k: v.double() for k, v in inputs.items()}, upstream)
    errors = {"y": relative_error(y, y_ref), **{f"d{k}": relative_error(g, grads_ref[k]) for k, g in grads.items()}}
    worst = max((k for k in errors if k != "y"), key=errors.get)
    tolerance = KERNEL_TOLERANCE[precision]
    return {"kernel": kernel, "precision": precision, "shape": shape, "errors": errors, "y_error": errors["y"],
            "worst_grad": worst, "grad_error": errors[worst], "tolerance": tolerance,
            "passed": all(e <= tolerance for e in errors.values())}


def scan_inputs(b: int, d: int, length: int, n: int, device, precision: str, seed: int = 0) -> dict:
    """Selective-scan inputs in mamba-ssm's layout: activations in `precision`, A, D, delta_bias in fp32."""
    g = torch.Generator().manual_seed(seed)
    act = DTYPES[precision.split(",")[0]]
    tensors = dict(
        u=torch.randn(b, d, length, generator=g).to(act), delta=(torch.randn(b, d, length, generator=g) * 0.5).to(act),
        A=-(torch.rand(d, n, generator=g) * 2 + 0.1), B=torch.randn(b, n, length, generator=g).to(act),
        C=torch.randn(b, n, length, generator=g).to(act), D=torch.randn(d, generator=g),
        z=torch.randn(b, d, length, generator=g).to(act), delta_bias=torch.randn(d, generator=g) * 0.3,
    )
    if "decay" in precision:  # delta A = 10 x -1e4 per step: every decay factor underflows to exactly 0
        tensors["A"] = torch.full((d, n), -1e4)
        tensors["delta"] = torch.full((b, d, length), 10.0)
    return {k: v.to(device) for k, v in tensors.items()}


def wkv_inputs(B: int, T: int, C: int, device, precision: str, seed: int = 0) -> dict:
    """Bi-WKV inputs as one SpatialMix sees them: w T spread over [-5, 3] (Vision-RWKV's init range), u = -1.2 / T,
    fp32; keys and values ~ N(0, 1) in `precision`."""
    g = torch.Generator().manual_seed(seed)
    act = DTYPES[precision]
    return {"w": (torch.linspace(-5, 3, C) / T).to(device), "u": torch.full((C,), -1.2 / T, device=device),
            "k": torch.randn(B, T, C, generator=g).to(device, act), "v": torch.randn(B, T, C, generator=g).to(device, act)}


def kernel_checks(device: torch.device, scan_shape: tuple[int, ...], wkv_shape: tuple[int, ...]) -> Iterator[dict]:
    """Both Triton kernels (through their stable entry points) against their O(L) / O(T^2) fp64 definitions, one
    record at a time (a stopped section keeps those already made)."""
    from backbones.ops.cuda_kernels import scan_fn
    from backbones.ops.selective_scan import selective_scan_ref
    from backbones.ops.wkv import bi_wkv, bi_wkv_reference

    def scan(**kw):
        return scan_fn(**kw, delta_softplus=True, backend="triton")

    def scan_ref(**kw):
        return selective_scan_ref(**kw, delta_softplus=True)

    b, d, length, n = scan_shape
    for precision in ("fp32", "bf16", "fp32, decay -1e5"):
        upstream = torch.randn(b, d, length, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        base = {"kernel": "selective scan (Triton)", "precision": precision, "shape": f"b{b} d{d} L{length} N{n}"}
        yield guarded(base, lambda: _compare(*base.values(), scan, scan_ref, scan_inputs(b, d, length, n, device, precision),
                                             upstream))
    B, T, C = wkv_shape
    for precision in ("fp32", "bf16"):
        upstream = torch.randn(B, T, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        base = {"kernel": "Bi-WKV (Triton)", "precision": precision, "shape": f"B{B} T{T} C{C}"}
        yield guarded(base, lambda: _compare(*base.values(), lambda **kw: bi_wkv(**kw, backend="triton"), bi_wkv_reference,
                                             wkv_inputs(B, T, C, device, precision), upstream))


def guarded(base: dict, measure) -> dict:
    """measure()'s record, or `base` with the error in one line and passed=False: one broken kernel, dtype or family
    is a row of the report, and the others are still checked."""
    try:
        return measure()
    except Exception as err:  # noqa: BLE001 - reported, and the check goes on
        return failed(base, err)


def failed(base: dict, err: Exception) -> dict:
    lines = str(err).strip().splitlines() or [""]
    return {**base, "error": f"{type(err).__name__}: {lines[0][:300]}", "passed": False}


def randomise_zero_init(model: nn.Module, std: float = 0.02) -> int:
    """Draw every all-zero weight matrix afresh (adaLN-Zero modulations, the final layer): with them at zero the
    output is exactly zero and a comparison of outputs or gradients proves nothing. Returns how many were drawn."""
    drawn = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, std)
                drawn += 1
    return drawn


@contextlib.contextmanager
def _no_tf32():
    """Full fp32 matmuls and convolutions on CUDA for the fp32 comparison (cuDNN convolutions default to TF32),
    through whichever of torch's two TF32 switches the process already uses: reading the older one after the
    newer (fp32_precision) was set raises."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        saved = matmul.allow_tf32, conv.allow_tf32
    except RuntimeError:
        saved = None
    try:
        if saved is not None:
            matmul.allow_tf32 = conv.allow_tf32 = False
        else:
            newer = matmul.fp32_precision, conv.conv.fp32_precision
            matmul.fp32_precision = conv.conv.fp32_precision = "ieee"
        yield
    finally:
        if saved is not None:
            matmul.allow_tf32, conv.allow_tf32 = saved
        else:
            matmul.fp32_precision, conv.conv.fp32_precision = newer


def _norm_error(grads: dict, grads_ref: dict) -> float:
    """||g - g_ref|| / ||g_ref|| over every gradient at once, in fp64 (inf where g is not finite)."""
    diff = ref = 0.0
    for name, want in grads_ref.items():
        if name not in grads or not torch.isfinite(grads[name]).all():
            return float("inf")
        got, want = grads[name].detach().double().cpu(), want.detach().double().cpu()
        diff, ref = diff + (got - want).square().sum().item(), ref + want.square().sum().item()
    return (diff / max(ref, 1e-300)) ** 0.5


def _forward_backward(model: nn.Module, batch: tuple, upstream: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, dict]:
    """Output and the gradients of <output, upstream> for every parameter and the input image."""
    model.zero_grad(set_to_none=True)
    x, c_noise, labels = batch
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(x, c_noise, labels)
    (out.float() * upstream).sum().backward()
    grads = {"input": x.grad, **{name: p.grad for name, p in model.named_parameters() if p.grad is not None}}
    return out, grads


def device_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """The same weights on `device` (the tests change one of them here, to see the check fail)."""
    return copy.deepcopy(model).to(device)


def family_checks(device: torch.device, preset: str, size: int, batch: int, depth: int | None) -> Iterator[dict]:
    """Each family on `device` in fp32 and under bf16 autocast against the CPU in fp32, unrouted, same weights;
    one family's records at a time."""
    for family in FAMILIES:
        shape = f"{preset} {size}x{size}/2 batch {batch}"
        try:
            yield from _family_check(family, device, preset, size, batch, depth, shape)
        except Exception as err:  # noqa: BLE001 - one family that breaks is two rows of the report; the others run
            yield from [failed({"family": family, "precision": p, "shape": shape}, err) for p in FAMILY_TOLERANCE]


def _family_check(family: str, device: torch.device, preset: str, size: int, batch: int, depth: int | None, shape: str) -> list[dict]:
    from backbones import build_backbone

    torch.manual_seed(0)
    cpu = build_backbone(family, preset, input_size=size, in_channels=4, patch_size=2, num_classes=10, depth=depth).train()
    drawn = randomise_zero_init(cpu)
    g = torch.Generator().manual_seed(1)
    batch_cpu = (torch.randn(batch, 4, size, size, generator=g), torch.randn(batch, generator=g) * 0.5,
                 torch.randint(0, 10, (batch,), generator=g))
    upstream = torch.randn(batch, 4, size, size, generator=g)
    on_device = device_copy(cpu, device)  # before any forward: a module may keep non-leaf tensors of it
    out_ref, grads_ref = _forward_backward(cpu, batch_cpu, upstream, bf16=False)
    batch_dev = tuple(t.to(device) for t in batch_cpu)
    checks = []
    for precision, (tol_out, tol_grad) in FAMILY_TOLERANCE.items():
        with _no_tf32():
            out, grads = _forward_backward(on_device, batch_dev, upstream.to(device), bf16=precision == "bf16")
        missing = sorted(set(grads_ref) - set(grads))
        errors = {name: relative_error(grads[name], ref) for name, ref in grads_ref.items() if name in grads}
        worst = max(errors, key=errors.get)
        out_error, overall = relative_error(out, out_ref), _norm_error(grads, grads_ref)
        # fp32: every tensor within tolerance. bf16: the whole gradient vector (see FAMILY_TOLERANCE).
        grads_ok = (errors[worst] if precision == "fp32" else overall) <= tol_grad
        checks.append({"family": family, "precision": precision, "shape": shape, "redrawn_zero_layers": drawn,
                       "output_error": out_error, "worst_grad": worst, "grad_error": errors[worst], "grad_norm_error": overall,
                       "tolerance": [tol_out, tol_grad], "missing_grads": missing,
                       "passed": out_error <= tol_out and grads_ok and not missing})
    return checks


# CUDA's flash attention takes fp16/bf16 q, k, v of one dtype, a head dim that is a multiple of 8 up to 256, no
# attention mask, and a last dimension of stride 1 (torch's sdp_utils checks for it); anything else falls to the
# memory-efficient or the math kernel. The fp32 block after a route (routing.fp32_after_route, the official DiT's
# forward) is such a case: fp32 has no flash kernel.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_blockers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None) -> list[str]:
    """Why CUDA's flash attention could not take this scaled_dot_product_attention call ([] when it can)."""
    why = []
    if q.dim() != 4:
        why.append(f"{q.dim()}-D inputs (flash takes (B, heads, tokens, head dim))")
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        why.append(f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (flash takes one of fp16, bf16)")
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        why.append(f"head dim {q.shape[-1]} (flash takes multiples of 8 up to 256)")
    if attn_mask is not None:
        why.append("an attention mask")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        why.append("a last dimension that is not contiguous")
    return why


class _SDPACalls(torch.overrides.TorchFunctionMode):
    """Records every F.scaled_dot_product_attention call: its tokens, head dim, dtype and flash blockers."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.calls.append({"shape": f"{q.shape[-2]} tokens x head dim {q.shape[-1]} {str(q.dtype).removeprefix('torch.')}",
                               "blockers": flash_blockers(q, k, v, kwargs.get("attn_mask", args[3] if len(args) > 3 else None))})
        return func(*args, **kwargs)


def attention_checks(device: torch.device, preset: str, size: int, batch: int) -> Iterator[dict]:
    """DiT's attention at every shape its routes make (unrouted, TREAD's random route, SPRINT's), one training
    forward and backward each under bf16 autocast: every SDPA call must meet flash attention's conditions. On CUDA
    SDPA is also restricted to the flash kernel (torch.nn.attention.sdpa_kernel), so torch itself refuses a call
    flash cannot take; on a CPU only the conditions are checked (its own flash kernel takes more)."""
    for recipe in ("none", "random", "sprint"):
        base = {"check": "flash attention", "recipe": recipe, "shape": f"DiT-{preset}/2 {size}x{size} batch {batch}"}
        yield guarded(base, lambda: _attention_check(base, device, preset, size, batch))


def _attention_check(base: dict, device: torch.device, preset: str, size: int, batch: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from train.bench.routing import routed_pair

    torch.manual_seed(0)
    net, router = routed_pair("dit", preset, "random" if base["recipe"] == "none" else base["recipe"], size, 4, 2, 10, device)
    if base["recipe"] != "none":
        net.model.router = router
    g = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(batch, 4, size, size, generator=g).to(device), torch.rand(batch, generator=g).to(device) + 0.5
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)
    only_flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if device.type == "cuda" else contextlib.nullcontext()
    with _SDPACalls() as calls, only_flash, torch.autocast(device.type, dtype=torch.bfloat16):
        net(x, sigma, labels).float().square().mean().backward()
    shapes = sorted({c["shape"] for c in calls.calls})
    blockers = sorted({f"{c['shape']}: {b}" for c in calls.calls for b in c["blockers"]})
    return {**base, "calls": len(calls.calls), "shapes": shapes, "blockers": blockers, "torch_flash_only": device.type == "cuda",
            "passed": bool(calls.calls) and not blockers}
