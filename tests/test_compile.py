"""trainer.compile: blocks (each block compiled) and model (the whole denoiser in one graph), and trainer.cuda_graphs.

The whole-model cases train three steps of two micro-batches each with routes drawn by Router.set_draws, as the
trainer does: one graph, no recompile after the first step, the eager losses. The default suite checks the graph
with aot_eager (dynamo and AOT autograd, no code generation); inductor, which compiles C++ on the CPU for minutes,
runs in the slow ones.
"""

import collections
import copy

import pytest
import torch
import torch._dynamo

from backbones import build_backbone
from edm import EDMPrecond
from edm.objectives import EDM
from routing import ConfigError, Route, Router, build_policy
from train.build import compile_mode, compile_network, compiled_graphs
from train.compiling import CompiledNetwork
from conftest import FAST, compose_cfg

CASES = {
    "dit": ("dit", "random", [Route(0.5, 1, 2)]),
    "sprint": ("dit", "structured", [Route(0.75, 1, 2, mode="sprint", path_drop=0.25)]),
    "diffmoe": ("diffmoe", "random", [Route(0.5, 1, 2)]),  # global pool, its capacity predictor and threshold EMA
    "mamba": ("mamba", "structured", [Route(0.75, 1, 2, mode="sprint", path_drop=0.25)]),  # the selective scan as one op
    "rwkv": ("rwkv", "structured", [Route(0.75, 1, 2, mode="sprint", path_drop=0.25)]),  # the Bi-WKV scan as one op
}


def denoiser(case: str, seed: int = 0) -> EDMPrecond:
    family, policy, routes = CASES[case]
    torch.manual_seed(seed)
    model = build_backbone(family, "tiny", input_size=16, in_channels=1, patch_size=2, num_classes=4, depth=4)
    model.attach_router(Router(build_policy(policy), routes))
    return EDMPrecond(model).train()


def train(net: EDMPrecond, forward, steps: int = 3, batch: int = 8, micro: int = 4) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of `steps` AdamW steps of EDM on fixed random data, each of batch / micro micro-batches; and the route
    masks of every micro-batch. No recompile is allowed after the first step."""
    objective, router = EDM(sigma_data=0.5), net.model.router
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, masks = [], []
    try:
        for step in range(steps):
            y, labels = torch.randn(batch, 1, 16, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)
            sigma, noise = objective.sample_time(batch, g), torch.randn(batch, 1, 16, 16, generator=g)
            total = 0.0
            for start in range(0, batch, micro):
                router.set_draws(torch.Generator().manual_seed(100 + step), start, batch)  # seeded by the step only
                part = slice(start, start + micro)
                loss = objective.loss(forward, y[part], labels[part], sigma[part], noise[part]).mean()
                (loss * micro / batch).backward()
                total += float(loss.detach()) * micro / batch
                masks.append(torch.stack(router.last_masks).clone())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
            torch._dynamo.config.error_on_recompile = True  # from the second step on, a recompile fails the test
    finally:
        torch._dynamo.config.error_on_recompile = False
    return losses, masks


def check_whole_model(case: str, backend: str) -> None:
    eager_net = denoiser(case)
    eager_net.model.router.fp32_after_route = True  # its autocast-off region stays inside the graph too
    compiled_net = copy.deepcopy(eager_net)
    eager, eager_masks = train(eager_net, eager_net)
    torch._dynamo.reset()
    before = compiled_graphs()
    forward = compile_network(compiled_net, compiled_net.model, "model", backend=backend)
    assert isinstance(forward, CompiledNetwork) and forward.module is compiled_net
    losses, masks = train(compiled_net, forward)
    assert compiled_graphs() - before == 1, "the whole routed forward is one graph: no break anywhere"
    assert losses == pytest.approx(eager, rel=1e-5, abs=1e-5)
    for a, b in zip(masks, eager_masks):
        assert torch.equal(a, b), "the compiled forward routes exactly the tokens the eager one routes"
    assert not torch.equal(masks[0], masks[2]), "each step draws new routes"


# SPRINT covers TREAD's gather and scatter too; DiT and DiffMoE take 12 and 24 s more, so the default suite checks
# their graphs with explain (below) only.
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "sprint" else pytest.mark.slow) for c in sorted(CASES)])
def test_whole_model_compile_is_one_graph_without_recompiles_and_trains_as_eager(case):
    check_whole_model(case, "aot_eager")


@pytest.mark.slow  # inductor generates and compiles C++ for the CPU: about 3 minutes per case on 2 shared cores
@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_model_compile_with_inductor_trains_as_eager(case):
    check_whole_model(case, "inductor")


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "diffmoe" else pytest.mark.slow) for c in sorted(CASES)])
def test_the_whole_routed_forward_has_no_graph_break_under_autocast_and_fp32_after_route(case):
    net = denoiser(case)
    net.model.router.fp32_after_route = True
    net.model.router.set_draws(torch.Generator().manual_seed(0), 0, 4)
    x, sigma, labels = torch.randn(4, 1, 16, 16), torch.rand(4) + 0.1, torch.tensor([0, 1, 2, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(net)(x, sigma, labels)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_cuda_graphs_that_cannot_capture_fall_back_with_one_line_saying_why():
    net = denoiser("dit")
    lines = []
    assert compile_network(net, net.model, "off", cuda_graphs=True, log=lines.append) is net
    assert lines == ["trainer.cuda_graphs: not used: they capture the whole compiled network, and trainer.compile=off; "
                     "set trainer.compile=model; the step runs without CUDA graphs."]
    lines.clear()
    forward = compile_network(net, net.model, "model", cuda_graphs=True, log=lines.append)  # compiles lazily: cheap
    assert lines == ["trainer.cuda_graphs: not used: the model runs on the CPU, and CUDA graphs need a CUDA device; "
                     "the step runs without CUDA graphs."]
    assert isinstance(forward, CompiledNetwork) and not forward.cuda_graphs
    assert forward.sigma_data == net.sigma_data and list(forward.parameters()) == list(net.parameters()), "a drop-in for net"


def test_captured_steps_accumulate_gradients_in_buffers_outside_the_graphs_pool():
    """The CUDA-graph wrapper's bookkeeping, on the CPU with the eager network standing in for the captured one: each
    step starts from zeroed .grad buffers (one flat tensor), micro-batches add into them, and it says once why the
    first step and a new shape run uncaptured."""
    net, reference = denoiser("dit"), denoiser("dit")
    lines = []
    forward = CompiledNetwork(net, net, cuda_graphs=True, log=lines.append)
    objective = EDM(sigma_data=0.5)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        y, noise, sigma = torch.randn(4, 1, 16, 16, generator=g), torch.randn(4, 1, 16, 16, generator=g), torch.rand(4, generator=g) + 0.1
        labels = torch.tensor([0, 1, 2, 3])
        for model, call in ((net, forward), (reference, reference)):
            model.zero_grad(set_to_none=True)
            for start in (0, 2):  # two micro-batches accumulate
                model.model.router.set_draws(torch.Generator().manual_seed(step), start, 4)
                part = slice(start, start + 2)
                objective.loss(call, y[part], labels[part], sigma[part], noise[part]).mean().backward()
        (flat,) = forward.grads.values()
        for p, q in zip(net.parameters(), reference.parameters()):
            assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), "every .grad is a view of the buffer"
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    net.model.router.set_draws(torch.Generator().manual_seed(2), 0, 3)
    forward(torch.randn(3, 1, 16, 16), torch.rand(3) + 0.1, torch.tensor([0, 1, 2]))
    assert len(lines) == 2 and lines[0].startswith("trainer.cuda_graphs: the first step runs uncaptured")
    assert "new shape" in lines[1]


def test_compile_modes_and_the_old_switch():
    assert [compile_mode(v) for v in (None, False, True, "off", "blocks", "model")] == ["off", "off", "blocks", "off", "blocks", "model"]
    with pytest.raises(ConfigError, match="trainer.compile='graph' is unknown; choose off, blocks"):
        compile_mode("graph")


def test_the_routing_benchmark_takes_the_compile_modes():
    from train.bench.routing import main

    with pytest.raises(SystemExit):
        main(["--compile", "graph"])
    # `--compile` alone stays the per-block compile of older commands; off needs nothing compiled.
    rows = main(["--presets", "tiny", "--input-size", "8", "--channels", "1", "--batch", "2", "--repeats", "1", "--warmup", "0",
                 "--compile", "off", "--cuda-graphs"])
    assert rows[0]["compile_s"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["sprint", "dit"])
def test_cuda_graphs_replay_fresh_routes_and_train_as_eager(case):
    """Not run in this session (no GPU): the captured step draws new routes each step and matches the compiled one."""
    eager_net = denoiser(case).cuda()
    graphed_net = copy.deepcopy(eager_net)
    lines = []
    forward = compile_network(graphed_net, graphed_net.model, "model", cuda_graphs=True, log=lines.append)
    assert forward.cuda_graphs and lines == []
    train_cuda = _cuda_trainer()
    eager, eager_masks = train_cuda(eager_net, eager_net)
    graphed, masks = train_cuda(graphed_net, forward)
    assert graphed == pytest.approx(eager, rel=1e-4, abs=1e-5)  # inductor's fused kernels round differently
    assert all(torch.equal(a, b) for a, b in zip(masks, eager_masks)), "replays route what eager routes, step by step"
    assert not torch.equal(masks[-1], masks[-3]), "fresh routes on every replayed step"
    assert lines[0].startswith("trainer.cuda_graphs: the first step runs uncaptured")
    from torch._dynamo.utils import counters

    assert counters["inductor"]["cudagraph_skips"] == 0, "every graph captured"


def _cuda_trainer():
    def run(net, forward, steps=5, batch=8, micro=4):
        objective, router = EDM(sigma_data=0.5), net.model.router
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        losses, masks = [], []
        for step in range(steps):
            y, labels = torch.randn(batch, 1, 16, 16, generator=g).cuda(), torch.randint(0, 4, (batch,), generator=g).cuda()
            sigma, noise = objective.sample_time(batch, g).cuda(), torch.randn(batch, 1, 16, 16, generator=g).cuda()
            for start in range(0, batch, micro):
                router.set_draws(torch.Generator(device="cuda").manual_seed(100 + step), start, batch)
                part = slice(start, start + micro)
                loss = objective.loss(forward, y[part], labels[part], sigma[part], noise[part]).mean()
                loss.backward()
                masks.append(torch.stack(router.last_masks).clone())
                losses.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return losses, masks

    return run


@pytest.mark.slow  # inductor compiles C++ for the CPU: about 2 minutes on 2 cores
def test_compiled_training_steps_match_eager(tmp_path):
    from train.trainer import Trainer

    common = [*FAST, "routing=random", "trainer.max_steps=3"]
    eager = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'eager'}")).fit()
    before = compiled_graphs()
    compiled = Trainer(compose_cfg(*common, "trainer.compile=blocks", f"run_dir={tmp_path / 'compiled'}")).fit()
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    # The full sequence and the route's subset: one graph each, shared by every block (not one per block).
    assert 1 <= compiled_graphs() - before <= 4


@pytest.mark.slow  # two short runs, one compiled whole (aot_eager: the graph, not inductor's C++): about 30 s
def test_the_trainer_with_compile_model_trains_one_graph_as_eager(tmp_path, monkeypatch):
    import functools

    import train.trainer.setup as setup
    from train.trainer import Trainer

    common = [*FAST, "routing=sprint", "trainer.max_steps=3", "trainer.grad_accum=2"]
    eager = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'eager'}")).fit()
    monkeypatch.setattr(setup, "compile_network", functools.partial(compile_network, backend="aot_eager"))
    torch._dynamo.reset()
    before = compiled_graphs()
    compiled = Trainer(compose_cfg(*common, "trainer.compile=model", f"run_dir={tmp_path / 'compiled'}")).fit()
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
    assert compiled_graphs() - before == 1, "one graph for both micro-batches of every step"


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "dit" else pytest.mark.slow) for c in ("dit", "mamba", "rwkv")])
def test_compile_regions_reuse_one_block_graph_and_train_as_eager(case):
    """trainer.compile_regions: the route's two blocks (same shape) are one nested region, traced once and called
    twice in the single whole-model graph; the losses are the eager ones. The blocks before and after the route, one
    each here, are used once. The scan families' ops are inside the region."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, inputs)

    eager_net = denoiser(case)
    compiled_net = copy.deepcopy(eager_net)
    eager, _ = train(eager_net, eager_net)
    torch._dynamo.reset()
    forward = compile_network(compiled_net, compiled_net.model, "model", regions=True, backend=backend)
    losses, _ = train(compiled_net, forward)
    assert losses == pytest.approx(eager, rel=1e-5, abs=1e-5)
    assert len(graphs) == 1, "one whole-model graph, no break"
    regions = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    # torch 2.14 inlines the blocks outside the route; 2.11 (the GPU machines' image) keeps each in a region of its own.
    uses = sorted(collections.Counter(n.args[1] for n in regions).values())
    assert uses in ([2], [1, 1, 2]), [n.args[:2] for n in regions]


def test_compile_regions_leave_hooked_blocks_inline_and_refuse_other_modes(monkeypatch):
    """A block with a forward hook (an aligned layer's capture) runs outside any region, whose body must have no side
    effects; every other block goes through the region. Regions need the whole-model compile and a router."""
    import routing.router as router_module

    ran = []
    monkeypatch.setattr(router_module, "_call_region", lambda block, *args: ran.append(block) or block(*args))
    net = denoiser("dit")
    blocks = net.model.blocks
    blocks[1].register_forward_hook(lambda module, args, out: None)
    net.model.router.regions = True
    net(torch.randn(2, 1, 16, 16), torch.rand(2) + 0.1, torch.tensor([0, 1]))
    assert [id(b) for b in ran] == [id(blocks[i]) for i in (0, 2, 3)]
    with pytest.raises(ConfigError, match=r"trainer.compile_regions=true needs trainer.compile=model \(it is blocks\)"):
        compile_network(net, net.model, "blocks", regions=True)
    with pytest.raises(ConfigError, match="has no router"):
        compile_network(net, torch.nn.Linear(2, 2), "model", regions=True)
    stepped = torch.nn.Module()  # a router but no blocks: a fine-tuned model runs its steps
    stepped.router = Router()
    with pytest.raises(ConfigError, match="not to a fine-tuned model's steps"):
        compile_network(net, stepped, "model", regions=True)
    moe = denoiser("diffmoe")  # its blocks append aux losses as they run: dynamo fails inside a region
    with pytest.raises(ConfigError, match="DiffMoE's blocks record"):
        compile_network(moe, moe.model, "model", regions=True)
    from train.trainer.setup import check_config

    # The trainer refuses it before any work starts, naming both keys.
    with pytest.raises(ConfigError, match=r"trainer.compile_regions=true needs trainer.compile=model \(it is off\)"):
        check_config(compose_cfg("run_dir=/tmp/unused", "trainer.compile_regions=true"))
    with pytest.raises(ConfigError, match="DiffMoE's blocks record"):
        check_config(compose_cfg("run_dir=/tmp/unused", "backbone=diffmoe", "trainer.compile_regions=true", "trainer.compile=model"))
    check_config(compose_cfg("run_dir=/tmp/unused", "trainer.compile_regions=true", "trainer.compile=model"))


def test_the_bare_step_runs_fp32_matmuls_as_the_trainer_does():
    """The benches' bare step and the trainer turn on TF32 on CUDA through one function, so the fp32 block after a
    route is timed as it trains; on the CPU nothing changes."""
    from train.compiling import tf32_matmuls

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        tf32_matmuls("cpu")
        assert not matmul.allow_tf32 and not cudnn.allow_tf32
        tf32_matmuls(torch.device("cuda"))
        assert matmul.allow_tf32 and cudnn.allow_tf32
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
