"""torch.compile of a whole Mamba block: the selective scan is a custom op (backbones/ops/selective_scan_op.py),
so Dynamo captures the block in one graph, and the compiled training steps compute eager's losses.

On the CPU the op runs the pure-PyTorch scan (so the same op compiles in CI); with backend="triton" it runs
the Triton kernels (the interpreter here, the compiled kernels on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from backbones.mamba import Block
from backbones.ops import selective_scan_triton as sst
from test_selective_scan_triton import fast_interpreter_scan  # noqa: F401  (autouse: the interpreter's scan, sped up)


def _device(backend: str) -> str:
    """The Triton path on a GPU machine runs the compiled kernels, which take CUDA tensors only."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _block(seed: int = 0, device: str = "cpu", layer_idx: int = 0, scan_order: str = "row") -> Block:
    """A tiny block whose zero-initialised modulation is randomised, so the mixer shapes the loss from step 0."""
    torch.manual_seed(seed)
    block = Block(hidden_size=16, layer_idx=layer_idx, depth=2, d_state=4, mlp_ratio=2.0, scan_order=scan_order)
    with torch.no_grad():
        block.adaLN.proj[1].weight.normal_(0, 0.1)
    return block.to(device)


def _batch(seed: int = 1, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x, c = torch.randn(2, 12, 16, generator=g), torch.randn(2, 16, generator=g)  # tokens (B, L, D), condition (B, D)
    return x.to(device), c.to(device)


def _losses(block, steps: int, device: str = "cpu") -> list[float]:
    """Losses of `steps` SGD steps on a fixed batch."""
    x, c = _batch(device=device)
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        loss = block(x, c, (3, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _scan_args(backend: str):
    g = torch.Generator().manual_seed(0)
    b, d, n, length = 2, 6, 4, 9
    tensors = [torch.randn(b, d, length, generator=g), torch.randn(b, d, length, generator=g) * 0.5,
               -(torch.rand(d, n, generator=g) + 0.1), torch.randn(b, n, length, generator=g),
               torch.randn(b, n, length, generator=g), torch.randn(d, generator=g), torch.randn(b, d, length, generator=g),
               torch.randn(d, generator=g) * 0.3]
    return (*(t.to(_device(backend)).requires_grad_() for t in tensors), True, backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_op_passes_opcheck(backend):
    """Schema, fake implementation (shapes, dtypes, the states' layout), autograd registration and AOT tracing."""
    torch.library.opcheck(torch.ops.tread.selective_scan.default, _scan_args(backend))


def test_op_gradients_equal_the_eager_scan():
    """The op's backward (a recomputed forward on the CPU path) gives the eager scan's gradients."""
    from backbones.ops.cuda_kernels import scan_fn
    from backbones.ops.selective_scan_op import selective_scan_compilable

    args = _scan_args("torch")
    leaves = args[:8]
    results = []
    for fn in (scan_fn, selective_scan_compilable):
        out = fn(*leaves, delta_softplus=True, backend="torch")
        results.append((out, torch.autograd.grad(out, leaves, torch.cos(out.detach()))))
    (y_eager, g_eager), (y_op, g_op) = results
    torch.testing.assert_close(y_op, y_eager, rtol=0, atol=0)
    for a, b in zip(g_op, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend,layer_idx", [("torch", 0), ("triton", 0), ("torch", 1)],
                         ids=["torch", "triton", "column_major"])
def test_block_compiles_without_graph_break(monkeypatch, backend, layer_idx):
    """Dynamo alone (no code generation): one graph for the block's forward, the scan a single op node; also for
    the second layer of scan_order=alternate, which permutes the tokens into column-major order and back."""
    monkeypatch.setenv("TREAD_SCAN_BACKEND", backend)
    torch._dynamo.reset()
    x, c = _batch(device=_device(backend))
    block = _block(device=_device(backend), layer_idx=layer_idx, scan_order="alternate")
    assert block.order == ("row", "col")[layer_idx]
    explained = torch._dynamo.explain(block)(x, c, (3, 4))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    ops = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
    # The two directions of the bidirectional mixer (the target is the op packet, tread.selective_scan).
    assert sum(op.startswith("tread.selective_scan") for op in ops) == 2, ops


@pytest.mark.parametrize(
    "compiler",
    # AOT autograd without code generation: the op's fake, forward and backward in the compiled graphs (~10 s).
    ["aot_eager",
     # Inductor generates and builds C++ for the CPU: about 90 s on 2 shared cores.
     pytest.param("inductor", marks=pytest.mark.slow)],
)
def test_compiled_block_trains_like_eager(compiler):
    """fullgraph=True (a graph break is an error): three SGD steps give eager's losses within 1e-5."""
    torch._dynamo.reset()
    eager = _losses(_block(), steps=3)
    compiled = _losses(torch.compile(_block(), backend=compiler, fullgraph=True), steps=3)
    assert eager[0] != eager[-1]  # the steps change the weights
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


@pytest.mark.slow  # the interpreter runs the kernels of 2 steps x 2 directions, eager and compiled (~20 s of CPU)
@pytest.mark.skipif(not sst._INTERPRETED and not torch.cuda.is_available(), reason="needs a GPU or the interpreter")
def test_compiled_block_on_the_triton_path_trains_like_eager(monkeypatch):
    """The same through the Triton kernels (AOT autograd), with eager on the Triton path as the reference."""
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "triton")
    torch._dynamo.reset()
    device = _device("triton")
    eager = _losses(_block(device=device), steps=2, device=device)
    compiled = _losses(torch.compile(_block(device=device), backend="aot_eager", fullgraph=True), steps=2, device=device)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
