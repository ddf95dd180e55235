"""trainer.compile: the compiled step computes the same losses as eager, with few graphs for the whole stack."""

import pytest

from train.build import compiled_graphs
from train.trainer import Trainer
from conftest import FAST, compose_cfg


@pytest.mark.slow  # inductor compiles C++ for the CPU: about 2 minutes on 2 cores
def test_compiled_training_steps_match_eager(tmp_path):
    common = [*FAST, "routing=random", "trainer.max_steps=3"]
    eager = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'eager'}")).fit()
    before = compiled_graphs()
    compiled = Trainer(compose_cfg(*common, "trainer.compile=true", f"run_dir={tmp_path / 'compiled'}")).fit()
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    # The full sequence and the route's subset: one graph each, shared by every block (not one per block).
    assert 1 <= compiled_graphs() - before <= 4
