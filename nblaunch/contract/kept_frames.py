"""A failed rank's frames, kept for the debugger and for the failure's locals block.

When a rank's function raises, the rank keeps its traceback's frames from the user's code
inward (:func:`keep`): where each was (file, line, function) and its local variables. A value
crosses whole where it pickles within ``VALUE_MAX_BYTES`` and lives on the CPU (a small tensor,
a number, a list); otherwise a :class:`KeptValue` stands in for it, saying its type and, for a
tensor, its shape, dtype, device and statistics (a GPU tensor never crosses: unpickling it would
start CUDA in the notebook's process). The record travels inside the rank's ``RankFailure``;
the launcher rebuilds real frames from it for pdb (``launch/post_mortem``), and shows the failing
line's locals (:func:`with_locals`).

Example::

    frames = keep(error.__traceback__)
    with_locals(text, frames)   # under 'raise ValueError(...)': '    locals:', '      x   Tensor[3, 5] float32 cpu'
"""

from __future__ import annotations

import pickle
import sys
import time
import types
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from nblaunch import frames as frame_text
from nblaunch.contract.limited_pickle import pickle_within

__all__ = ["KeptFrame", "KeptValue", "entries", "keep", "summary", "user_start", "with_locals"]

MAX_FRAMES = 40  # the innermost: a deep recursion keeps where it ended
VALUE_MAX_BYTES = 1 << 20  # one local, pickled
FRAMES_MAX_BYTES = 16 << 20  # all locals of all frames: past it, values are described only
# Past this, values are described only: the launcher waits 1 s for a failed rank's whole report.
KEEP_MAX_S = 0.4
_STATS_MAX_ELEMENTS = 1 << 27  # a tensor larger than this is not read for its statistics
_SUMMARY_CHARS = 80
# Kept for pdb, left out of the locals block: a script's imports and definitions are not its state.
_NOT_IN_THE_BLOCK = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)


@dataclass
class KeptValue:
    """Stands in for a local that did not cross whole: what it was, in words; a tensor's
    ``shape``, ``dtype`` and ``device`` as the rank had them (``p x.shape`` reads them)."""

    type_name: str
    summary: str
    shape: Any = None
    dtype: Any = None
    device: Any = None

    def __repr__(self) -> str:
        return f"<{self.summary}: not sent from the rank whole>"


@dataclass
class KeptFrame:
    """One frame of a failed rank: where it was, and its locals (pickled, or stood in for)."""

    filename: str
    lineno: int
    function: str
    qualname: str
    firstlineno: int
    module: str  # its globals' __name__: where the debugger finds them in this process
    kept: dict[str, bytes | KeptValue] = field(default_factory=dict)
    summaries: dict[str, str] = field(default_factory=dict)  # the locals block's: "Tensor[3, 5] float32 cpu"

    def values(self) -> dict[str, Any]:
        """The locals as the rank had them, rebuilt here (a :class:`KeptValue` where one cannot be)."""
        values = {}
        for name, kept in self.kept.items():
            if isinstance(kept, KeptValue):
                values[name] = kept
                continue
            try:
                values[name] = pickle.loads(kept)
            except Exception:  # noqa: BLE001  a class only the rank could import
                values[name] = KeptValue("?", self.summaries.get(name, "a value that cannot be rebuilt here"))
        return values


def keep(tb: TracebackType | None) -> list[KeptFrame]:
    """The frames of ``tb`` from the user's code inward, with their locals (see the module)."""
    budget = _Budget(FRAMES_MAX_BYTES, time.monotonic() + KEEP_MAX_S)
    return [_kept(entry, budget) for entry in entries(tb)]


@dataclass
class _Budget:
    bytes_left: int
    until: float  # time.monotonic()

    def spent(self) -> bool:
        return self.bytes_left <= 0 or time.monotonic() > self.until


def entries(tb: TracebackType | None) -> list[TracebackType]:
    """The entries of ``tb`` that :func:`keep` keeps, outermost first (a warm rank keeps their
    frames live, in this order, for the debugger's questions)."""
    found = []
    tb = user_start(tb)
    while tb is not None:
        found.append(tb)
        tb = tb.tb_next
    return found[-MAX_FRAMES:]


def user_start(tb: TracebackType | None) -> TracebackType | None:
    """The entry of ``tb`` where the user's code begins: the frames of nblaunch, and of runpy
    starting a script, that led there are left out (the innermost is kept whatever it is)."""
    while tb is not None and tb.tb_next is not None and _before_user_code(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def with_locals(traceback: str, kept: list[KeptFrame]) -> str:
    """``traceback`` (as Python prints it) with the failing line's locals in one compact block
    under that line: the innermost frame of the user's own code (else the innermost), a line per
    name. Where that frame is not found in the text, the block ends it."""
    if not kept:
        return traceback
    own = [f for f in kept if frame_text.is_users(f.filename)]
    frame = (own or kept)[-1]
    if not frame.summaries:
        return traceback
    width = min(max(len(name) for name in frame.summaries), 24)
    block = ["    locals:"] + [f"      {name:<{width}}  {said}" for name, said in frame.summaries.items()]
    lines = traceback.splitlines()
    heading = f'  File "{frame.filename}", line {frame.lineno}, in {frame.function}'
    at = max((i for i, line in enumerate(lines) if line == heading), default=None)
    if at is None:
        return traceback.rstrip("\n") + "\n" + "\n".join(block) + "\n"
    at += 1
    while at < len(lines) and lines[at].startswith("    "):  # the frame's code, and its carets
        at += 1
    return "\n".join(lines[:at] + block + lines[at:]) + "\n"


def _before_user_code(path: str) -> bool:
    return frame_text.is_launcher_code(path) or frame_text.is_python_machinery(path)


def _kept(entry: TracebackType, budget: _Budget) -> KeptFrame:
    frame, code = entry.tb_frame, entry.tb_frame.f_code
    kept, summaries = {}, {}
    for name, value in list(frame.f_locals.items()):
        if name.startswith("__") and name.endswith("__"):
            continue  # a module's own (__spec__, __builtins__): the script's frame holds them
        said = summary(value)
        if not isinstance(value, _NOT_IN_THE_BLOCK):
            summaries[name] = said
        if budget.spent():
            kept[name] = KeptValue(type(value).__qualname__, said)
            continue
        try:
            pickled = None if _off_cpu(value) else pickle_within(value, min(VALUE_MAX_BYTES, budget.bytes_left))
            kept[name] = _stand_in(value, said) if pickled is None else pickled
        except Exception:  # noqa: BLE001  a value that cannot even be looked at is named only
            kept[name] = KeptValue(type(value).__qualname__, said)
            continue
        if pickled is not None:
            budget.bytes_left -= len(pickled)
    return KeptFrame(
        filename=code.co_filename, lineno=entry.tb_lineno, function=code.co_name,
        qualname=getattr(code, "co_qualname", code.co_name), firstlineno=code.co_firstlineno,
        module=str(frame.f_globals.get("__name__", "")), kept=kept, summaries=summaries,
    )


def summary(value: Any) -> str:
    """A value in a few words: ``Tensor[3, 5] float32 cpu``, ``list (4 items)``, ``float 0.1``."""
    try:
        if _is_tensor(value):
            shape = ", ".join(str(d) for d in value.shape)
            return f"Tensor[{shape}] {str(value.dtype).removeprefix('torch.')} {value.device}"
        shape = getattr(value, "shape", None)
        if isinstance(shape, tuple) and hasattr(value, "dtype"):  # numpy arrays and their like
            return f"{type(value).__name__}[{', '.join(str(d) for d in shape)}] {value.dtype}"
        if isinstance(value, (bool, int, float, complex, str, bytes)) or value is None:
            text = repr(value)
            text = text if len(text) <= _SUMMARY_CHARS else text[:_SUMMARY_CHARS - 3] + "..."
            return f"{type(value).__name__} {text}"
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            return f"{type(value).__name__} ({len(value)} items)"
        return type(value).__qualname__
    except Exception:  # noqa: BLE001  a value whose attributes raise is still named
        return type(value).__qualname__


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _off_cpu(value: Any) -> bool:
    # A tensor elsewhere than the CPU never crosses: the notebook's process would start CUDA.
    return _is_tensor(value) and value.device.type != "cpu"


def _stand_in(value: Any, said: str) -> KeptValue:
    if not _is_tensor(value):
        return KeptValue(type(value).__qualname__, said)
    return KeptValue("Tensor", said + _stats(value), shape=value.shape, dtype=value.dtype, device=value.device)


def _stats(tensor: Any) -> str:
    """``, min 0 max 1 mean 0.5`` of a floating tensor on the CPU or a GPU small enough to read
    ("" otherwise, or where reading it fails: a device whose context a fault poisoned). Not on
    other devices: a meta tensor has no values (and its mean imports torch._dynamo, 2 s), an XLA
    tensor would compile a graph."""
    try:
        if (tensor.device.type not in ("cpu", "cuda") or not tensor.is_floating_point() or tensor.numel() == 0
                or tensor.numel() > _STATS_MAX_ELEMENTS):
            return ""
        values = tensor.detach()
        low, high, mean = (float(x) for x in (values.min(), values.max(), values.float().mean()))
        return f", min {low:.4g} max {high:.4g} mean {mean:.4g}"
    except Exception:  # noqa: BLE001
        return ""
