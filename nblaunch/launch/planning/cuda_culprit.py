"""Which line of the user's initialised CUDA in this process, so the launch can say where.

A process that initialised CUDA cannot fork ranks (they would find CUDA broken); nblaunch then
starts them from its launch server, and says so. "CUDA is already initialised" alone sends
users hunting through their imports; the line that did it ends the hunt. torch runs the calls
queued with ``torch.cuda._lazy_call`` inside its lazy initialisation, on the stack of whatever
asked for CUDA: one queued call of ours notes the first frame there that is the user's. It is
queued as soon as both nblaunch and ``torch.cuda`` are imported, whichever came first
(``nblaunch.after_import``).

What it cannot see is said as such: CUDA initialised before nblaunch was imported, and the
driver initialised without torch's lazy initialisation (``torch.cuda.is_available()`` does that
unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``).

Example::

    watch()                          # at `import nblaunch`
    # ... the user's cell: model.cuda()
    where_cuda_started()             # 'cell In[3], line 2: model.cuda()'
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from types import ModuleType

from nblaunch.after_import import when_imported

_noted: str | None = None  # where torch initialised CUDA, once seen
_watching_since_import = False  # our call was queued before CUDA was initialised
_watch_asked = False
_TORCH_CUDA = "torch.cuda"


def where_cuda_started() -> str | None:
    """The user's line that initialised CUDA (``"cell In[3], line 2: model.cuda()"``), or None
    where it could not be seen."""
    return _noted


def unseen_reason() -> str:
    """Where CUDA was initialised when the line is not known, to follow "CUDA was initialised in this process"."""
    if not _watching_since_import:
        return "before nblaunch was imported (import nblaunch first to have the line named)"
    return ("by the CUDA driver alone, outside torch's own start of CUDA: torch.cuda.is_available() and "
            "device_count() do that unless PYTORCH_NVML_BASED_CUDA_CHECK=1 is set before them, and so may "
            "another CUDA library")


def watch() -> None:
    """Note where CUDA gets initialised from now on. Never imports torch; cheap; once per process."""
    global _watch_asked
    if not _watch_asked:
        _watch_asked = True
        when_imported(_TORCH_CUDA, _queue_note)


def _queue_note(torch_cuda: ModuleType) -> None:
    global _watching_since_import
    try:
        if torch_cuda.is_initialized():
            return  # too late to see it: unseen_reason says so
        torch_cuda._lazy_call(_note)
        _watching_since_import = True
    except Exception:  # noqa: BLE001  torch without the hook: the notice only loses its line
        pass


def _note() -> None:
    """Run by torch inside its lazy CUDA initialisation, on the stack that asked for CUDA."""
    global _noted
    try:
        frame = _users_frame(traceback.extract_stack()[:-1])
        if frame is not None and _noted is None:
            _noted = f"{_place(frame.filename, frame.lineno)}: {(frame.line or '').strip()}".rstrip(": ")
    except Exception:  # noqa: BLE001  never break the user's CUDA for a notice
        pass


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) + os.sep


def _users_frame(frames: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code: not torch's, nblaunch's or the interpreter's,
    and where possible no installed library's either (the user's line that called it is the one
    to name); else the innermost that is not torch's or nblaunch's."""
    torch = sys.modules.get("torch")
    ours = [_folder(os.path.dirname(os.path.dirname(__file__)))]  # the nblaunch package
    if torch is not None and getattr(torch, "__file__", None):
        ours.append(_folder(torch.__file__))
    libraries = {os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (p := sysconfig.get_path(key))}
    for skipped in (tuple(ours) + tuple(libraries), tuple(ours)):
        for frame in reversed(frames):
            name = frame.filename
            if not name.startswith("<frozen") and not os.path.abspath(name).startswith(skipped):
                return frame
    return None


def _place(filename: str, lineno: int | None) -> str:
    """``cell In[3], line 2`` for a notebook cell (IPython knows its number), else
    ``train.py, line 12``."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    cells = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
    if filename in cells:
        return f"cell In[{cells[filename]}], line {lineno}"
    return f"{os.path.basename(filename)}, line {lineno}"
