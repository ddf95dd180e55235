"""Host reads inside a training step, recorded where they happen (tests/test_host_sync.py, test_host_reads_matrix.py).

A host read makes the host wait for the device: on CUDA every one of them stalls the step's queue. Two layers see them:
- the aten ops that read a tensor's value to the host, or whose output shape depends on its values
  (`_local_scalar_dense` behind item / bool / int / float, `nonzero`, `unique`, `equal`, `is_nonzero`, `masked_select`,
  indexing with a boolean mask), through a TorchDispatchMode;
- the Python methods that read without an aten op (`tolist`, `numpy`, `cpu`, and the conversions), patched on
  torch.Tensor for the duration.

Each read is recorded with the first frame of the project that made it (`file:line function`), so a test can name the
reads it allows and report the others where they are.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
READ_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default,
            aten.is_nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
            aten.unique_dim.default, aten.unique_consecutive.default, aten.argwhere.default}
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>")
METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


def where() -> str:
    """`path:line function` of the innermost frame of this project outside tests/, else the innermost test frame."""
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(str(ROOT)) and "/.venv/" not in f.filename
              and f.filename != __file__]
    own = [f for f in frames if not f.filename.startswith(str(ROOT / "tests"))] or frames
    if not own:
        return "?"
    f, name = own[-1], own[-1].name
    # Python 3.12 inlines comprehensions into their function (PEP 709), 3.11 runs them in a frame of their own: name a
    # read by the function that holds the comprehension on both.
    for outer in reversed(own[:-1]):
        if name not in COMPREHENSIONS or outer.filename != f.filename:
            break
        name = outer.name
    return f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {name}"


def _boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _AtenReads(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READ_OPS:
            self.record(f"aten.{func.overloadpacket.__name__}")
        elif func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and _boolean_index(args):
            self.record(f"aten.{func.overloadpacket.__name__} with a boolean mask")
        return func(*args, **(kwargs or {}))


class HostReads:
    """Records host reads while `armed`; `reads` holds (what, where) pairs. Use as `with HostReads() as reads:`."""

    def __init__(self, armed: bool = True):
        self.armed, self.reads = armed, []
        self._busy = False  # a read inside a patched method (tolist -> item) counts once

    def record(self, what: str) -> None:
        if self.armed and not self._busy:
            self.reads.append((what, where()))

    @contextmanager
    def paused(self):
        """Host work by design (the data read): not recorded."""
        before, self.armed = self.armed, False
        try:
            yield
        finally:
            self.armed = before

    def __enter__(self) -> HostReads:
        self._originals = {name: getattr(torch.Tensor, name) for name in METHODS}
        for name in METHODS:
            setattr(torch.Tensor, name, self._patched(name))
        self._mode = _AtenReads(self.record)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _patched(self, name):
        original = self._originals[name]

        def read(tensor, *args, **kwargs):
            self.record(f"Tensor.{name}")
            before, self._busy = self._busy, True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._busy = before
        return read

    def summary(self) -> str:
        """One line per distinct read: `what at where (n times)`."""
        counts: dict = {}
        for read in self.reads:
            counts[read] = counts.get(read, 0) + 1
        return "; ".join(f"{what} at {at} ({n}x)" for (what, at), n in counts.items())
