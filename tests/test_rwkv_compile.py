"""A compiled RWKV block: Bi-WKV is one op (tread_zoo::bi_wkv, backbones/ops/wkv_op.py), so torch.compile traces the
whole block, forward and backward, without a graph break, and trains with the losses of eager.

On the CPU the op runs the chunked PyTorch Bi-WKV; on a GPU the Triton kernels (the same op, so the same graph).
The default suite compiles with aot_eager (Dynamo and AOT autograd, no code generation, seconds); Inductor, which
compiles C++ on the CPU for about a minute, runs in the slow case.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from backbones.ops.wkv import bi_wkv
from backbones.rwkv import Block

D, GRID = 32, (4, 4)


def _block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    block = Block(D, layer_idx=1, depth=4)
    # adaLN-Zero starts at zero (the block is the identity): randomise it so Bi-WKV's output reaches the loss.
    torch.nn.init.normal_(block.adaLN.proj[1].weight, std=0.2)
    return block


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, GRID[0] * GRID[1], D, generator=g), torch.randn(2, D, generator=g)


def _losses(block: Block, forward, steps: int = 3) -> list[float]:
    """Losses of `steps` AdamW steps on one fixed batch."""
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
    x, c = _data()
    losses = []
    for _ in range(steps):
        loss = forward(x, c, GRID).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_block_traces_as_one_graph_with_the_op():
    torch._dynamo.reset()
    x, c = _data()
    explained = torch._dynamo.explain(_block())(x, c, GRID)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    assert "tread_zoo.bi_wkv" in str(explained.graphs[0].code)


def test_op_gradients_match_the_chunked_autograd_function():
    # The op's backward (its own op; on the CPU it recomputes the chunked forward) against the eager path.
    g = torch.Generator().manual_seed(0)
    w, u = torch.rand(8, generator=g) / 20, torch.randn(8, generator=g) / 20
    k, v = torch.randn(2, 20, 8, generator=g), torch.randn(2, 20, 8, generator=g)
    grad_y = torch.randn(2, 20, 8, generator=g)
    eager = [t.clone().requires_grad_() for t in (w, u, k, v)]
    y_eager = bi_wkv(*eager)
    g_eager = torch.autograd.grad((y_eager * grad_y).sum(), eager)
    leaves = [t.clone().requires_grad_() for t in (w, u, k, v)]
    y, _ = torch.ops.tread_zoo.bi_wkv(*leaves, 32, False)
    grads = torch.autograd.grad((y * grad_y).sum(), leaves)
    torch.testing.assert_close(y, y_eager, atol=0, rtol=0)
    for name, a, b in zip("wukv", grads, g_eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    # Schema, fake (shapes and strides) and autograd registration of both ops.
    torch.library.opcheck(torch.ops.tread_zoo.bi_wkv.default, (w, u, k, v, 32, False))
    state = torch.empty(0)
    torch.library.opcheck(torch.ops.tread_zoo.bi_wkv_backward.default, (w, u, k, v, state, grad_y, 32, False))
    # The fake's strides are what compiled code trusts: every output contiguous, as the fake says.
    assert all(t.is_contiguous() for t in torch.ops.tread_zoo.bi_wkv_backward(w, u, k, v, state, grad_y, 32, False))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_block_trains_as_eager(backend):
    torch._dynamo.reset()
    eager = _block()
    compiled = copy.deepcopy(eager)
    forward = torch.compile(compiled, backend=backend, fullgraph=True)  # fullgraph: a graph break is an error
    expected = _losses(eager, eager)
    got = _losses(compiled, forward)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert expected[-1] < expected[0]  # it trained, so the comparison covers the gradients too


def test_kernel_op_registration():
    # The Triton path of the op (interpreter on the CPU): its fake gives the real shapes, dtypes and strides of y
    # and of the chunk carries the backward takes, and its autograd registration holds (what torch.compile uses
    # on a GPU). bf16 k, v with fp32 w, u, as bi_wkv passes them.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    w, u = (torch.rand(4, generator=g) / 20).to(device), (torch.randn(4, generator=g) / 20).to(device)
    k, v = (torch.randn(1, 18, 4, generator=g).to(device, torch.bfloat16) for _ in range(2))
    torch.library.opcheck(torch.ops.tread_zoo.bi_wkv.default, (w, u, k, v, 32, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    y, state = torch.ops.tread_zoo.bi_wkv(w, u, k, v, 32, True)
    assert y.dtype == torch.bfloat16 and state.shape == (6, 1, 2, 4)  # two chunks of 16 tokens
    grad_y = torch.randn(1, 18, 4, generator=g).to(device, torch.bfloat16)
    torch.library.opcheck(torch.ops.tread_zoo.bi_wkv_backward.default, (w, u, k, v, state, grad_y, 32, True),
                          test_utils=("test_schema", "test_faketensor"))
