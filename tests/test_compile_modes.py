"""trainer.compile = off | blocks | model and trainer.cuda_graphs, as the trainer takes them (train/compiling.py
builds what the step calls)."""

from __future__ import annotations

import pytest

from routing import ConfigError
from train.trainer import Trainer
from conftest import FAST, compose_cfg


def trainer(tmp_path, *overrides):
    return Trainer(compose_cfg(*FAST, "trainer.log_with=none", f"run_dir={tmp_path / 'run'}", *overrides))


def test_an_unknown_mode_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ConfigError) as err:
        trainer(tmp_path, "trainer.compile=fast")
    message = str(err.value)
    assert message.startswith("trainer.compile='fast' is unknown; choose one of off, blocks, model") and "\n" not in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value, mode", [("true", "blocks"), ("false", "off"), ("off", "off"), ("model", "model")])
def test_old_switch_values_map_to_modes_and_model_wraps_the_network(tmp_path, value, mode):
    t = trainer(tmp_path, f"trainer.compile={value}")
    assert t.compile_mode == mode
    assert (t.forward is t.net) == (mode != "model")  # model: the compiled whole network beside the eager `net`
    t._release_run_dir()


def test_cuda_graphs_without_their_conditions_say_why_in_one_line(tmp_path, capsys):
    t = trainer(tmp_path, "trainer.compile=model", "trainer.cuda_graphs=true")
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("trainer.cuda_graphs")]
    assert "not used" in line and "CUDA" in line
    t._release_run_dir()


@pytest.mark.slow  # inductor compiles C++ for the CPU: minutes on 2 cores
def test_the_whole_compiled_model_trains_as_eager_with_a_route(tmp_path):
    common = [*FAST, "trainer.max_steps=3", "routing=random", "trainer.log_with=none"]
    eager = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'eager'}")).fit()
    compiled = Trainer(compose_cfg(*common, "trainer.compile=model", f"run_dir={tmp_path / 'model'}")).fit()
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
