"""A LoRA folder that save_lora writes is read by peft and diffusers as they are, with outputs equal to ours; folders
of the formats before it still load."""

from __future__ import annotations

import json

import pytest
import torch

from backbones.adapters import adapt, add_lora, load_lora, lora_parameters, lora_state_dict, model_config, save_lora
from test_adapters import build, call, inputs


def trained(family: str):
    """A tiny model of `family` with a LoRA whose B is not zero (alpha != rank, so a lost alpha would show)."""
    model = build(family)
    add_lora(model, rank=2, alpha=6, targets="attention_mlp")
    torch.manual_seed(1)
    for p in lora_parameters(model):
        torch.nn.init.normal_(p, std=0.1)
    return model


def output(model, family: str) -> torch.Tensor:
    x, t, cond = inputs(family)
    with torch.no_grad():
        return call(adapt(model).eval(), x, t, cond)


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "dit"])
def test_peft_loads_the_folder_with_outputs_equal_to_ours(family, tmp_path):
    from peft import PeftModel

    model = trained(family)
    save_lora(model, tmp_path / "lora")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 6
    assert json.loads((tmp_path / "lora" / "tread_zoo_lora.json").read_text())["format"] == "tread-zoo-lora/3"

    theirs = PeftModel.from_pretrained(build(family), tmp_path / "lora").base_model.model
    ours = output(model, family)
    assert (ours - output(theirs, family)).abs().max() <= 1e-6 < (ours - output(build(family), family)).abs().max()


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_diffusers_load_lora_adapter_reads_the_folder(family, tmp_path):
    model = trained(family)
    save_lora(model, tmp_path / "lora")
    theirs = build(family)
    # diffusers 0.42's load_lora_adapter looks for a pickled .bin unless told the folder holds safetensors.
    theirs.load_lora_adapter(tmp_path / "lora", prefix="transformer", use_safetensors=True)
    assert (output(model, family) - output(theirs, family)).abs().max() <= 1e-6


def test_a_folder_of_format_2_still_loads(tmp_path):
    """lora/ as runs wrote it before: the diffusers file, and our record under peft's adapter_config.json."""
    from backbones.adapters.lora_files import WEIGHTS

    model = trained("flux")
    save_lora(model, tmp_path / "lora")
    old = tmp_path / "old"
    old.mkdir()
    (old / WEIGHTS).write_bytes((tmp_path / "lora" / WEIGHTS).read_bytes())
    spec = model._tread_lora
    (old / "adapter_config.json").write_text(json.dumps({
        "format": "tread-zoo-lora/2", "weights": WEIGHTS,
        "lora": {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "targets": list(spec.targets)},
        "model": {"class": "FluxTransformer2DModel", "config": model_config(model)}, "diffusers_pipeline": "FluxPipeline"}))
    fresh = build("flux")
    assert load_lora(fresh, old) == spec
    assert torch.equal(output(fresh, "flux"), output(model, "flux"))
    restored = lora_state_dict(fresh)
    assert all(torch.equal(v, lora_state_dict(model)[k]) for k, v in restored.items())


def _cut_in_half(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_rank(path):
    record = json.loads(path.read_text())
    del record["lora"]["rank"]
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("name, damage, says", [
    ("tread_zoo_lora.json", _cut_in_half, "is not valid JSON"),
    ("tread_zoo_lora.json", lambda p: p.write_text(""), "is empty"),
    ("tread_zoo_lora.json", _drop_rank, "has no valid field 'lora.rank'"),
    ("pytorch_lora_weights.safetensors", _cut_in_half, "is cut short or damaged"),
    ("pytorch_lora_weights.safetensors", lambda p: p.write_bytes(bytes(range(256)) * 4), "is not a safetensors file"),
    ("adapter_config.json", _cut_in_half, "is not valid JSON"),
    ("adapter_model.safetensors", _cut_in_half, "is cut short or damaged"),
], ids=["record-half", "record-empty", "record-no-rank", "diffusers-half", "diffusers-random", "peft-config-half", "peft-weights-half"])
def test_a_damaged_file_of_the_folder_is_one_sentence_and_changes_nothing(name, damage, says, tmp_path, capsys):
    """load_lora raises FileError (a ConfigError: the commands print one line, exit 2) naming the file, before it adds
    a LoRA to the model; the folder is left as it is."""
    from routing import FileError
    from train.cli import friendly_errors

    save_lora(trained("dit"), tmp_path / "lora")
    damage(tmp_path / "lora" / name)
    before = {p.name: p.read_bytes() for p in (tmp_path / "lora").iterdir()}
    model = build("dit")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FileError) as err:
        load_lora(model, tmp_path / "lora")
    message = str(err.value)
    assert message.startswith(f"'{tmp_path / 'lora' / name}' {says}") and "\n" not in message and message.endswith(".")
    assert not hasattr(model, "_tread_lora") and model.state_dict().keys() == weights.keys()
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    with pytest.raises(SystemExit) as exit_:
        friendly_errors(lambda: load_lora(model, tmp_path / "lora"))()
    assert exit_.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    assert {p.name: p.read_bytes() for p in (tmp_path / "lora").iterdir()} == before
