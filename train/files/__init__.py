"""Typed loaders of every file the project reads, and the one way it writes a file whole.

Each loader refuses a damaged, truncated or hand-edited file in one sentence that names the file, the field
and the fix (a ConfigError: exit code 2, no traceback), and returns typed values that need no second check:

    run_state.py      a checkpoint's state.json and config.yaml, checkpoints/latest, a run's .hydra/overrides.yaml
    metrics_log.py    metrics.jsonl (a last line cut short by a kill is dropped; any other bad line refused)
    latents.py        a latents folder's meta.json and stats.json
    fid_reference.py  an FID reference .npz (mu, sigma): size and finiteness, before any sample is drawn
    inception.py      the Inception weights file
    prompt_table.py   a prompt table's safetensors header
    weights.py        a network's weights file (.safetensors or torch.save), e.g. REPA's encoder (align.weights)
    typed.py          text, JSON, safetensors and typed fields (OmegaConf structured configs); the readers of text,
                      JSON and tensors are backbones/files.py's, which the model packages use too
    atomic.py         write_atomic: a temporary file renamed over the target, so no write is ever half done

This package imports nothing else from train (the import contracts in pyproject.toml).
"""

from train.files.atomic import as_os_error, write_atomic
from train.files.fid_reference import read_reference
from train.files.inception import check_weights
from train.files.latents import LatentsMeta, LatentStats, read_meta, read_stats
from train.files.metrics_log import read_metrics
from train.files.prompt_table import TableHeader, read_header
from train.files.run_state import CheckpointState, read_checkpoint_config, read_latest, read_overrides, read_state
from train.files.typed import damaged, read_config, read_json, read_tensors, read_text, safetensors_metadata, tensor_shapes, typed
from train.files.weights import read_weights

__all__ = ["CheckpointState", "as_os_error", "LatentStats", "LatentsMeta", "TableHeader", "check_weights", "damaged", "read_checkpoint_config", "read_overrides", "read_config",
           "read_header", "read_json", "read_latest", "read_meta", "read_metrics", "read_reference", "read_state", "read_stats",
           "read_tensors", "read_text", "read_weights", "safetensors_metadata", "tensor_shapes", "typed",
           "write_atomic"]
