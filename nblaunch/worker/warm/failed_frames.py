"""A warm rank keeps its failed call's frames live until its next call, as a kernel keeps the
last traceback: the notebook's debugger asks it to evaluate in them (``p``, ``pp``, a statement),
so what it reads is the value now, and what a statement assigns at a cell's top level stays in
the rank's namespace. The frames (and what they hold: tensors, GPU memory too) are let go when
the next call begins, except the debugger's own.

Example (what the kernel's ``p x.shape`` makes rank 1 run, on its innermost frame)::

    evaluate("repr", "x.shape", 1)      # 'torch.Size([3, 5])'
"""

from __future__ import annotations

import contextlib
import io
import pprint
from types import FrameType

from nblaunch.contract import kept_frames

_frames: list[FrameType] = []


def keep(error: BaseException) -> None:
    """Keep the frames of ``error``'s traceback that the failure's record describes, in its order."""
    _frames[:] = [entry.tb_frame for entry in kept_frames.entries(error.__traceback__)]


def forget() -> None:
    _frames.clear()


def evaluate(kind: str, source: str, index: int) -> str | None:
    """``source`` in frame ``index`` of the failed call: its ``repr`` or ``pformat``, or what it
    printed when run as a statement (``exec``); an error as pdb says it. None: no frames kept
    (a call ran since, or none failed)."""
    if not 0 <= index < len(_frames):
        return None
    frame = _frames[index]
    try:
        if kind == "exec":
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(source + "\n", "<stdin>", "single"), frame.f_globals, frame.f_locals)
            return printed.getvalue()
        value = eval(source, frame.f_globals, frame.f_locals)
        return pprint.pformat(value) if kind == "pformat" else repr(value)
    except Exception as error:  # noqa: BLE001  said as pdb says it
        return f"*** {type(error).__name__}: {error}"


evaluate.keeps_failed_frames = True  # the debugger's calls do not let the frames go
