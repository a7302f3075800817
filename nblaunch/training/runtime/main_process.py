"""What ``accelerate.utils`` offers for "the main process does it, the others wait": a progress
bar shown once per machine, and a barrier.

Example::

    from nblaunch.utils import tqdm, wait_for_everyone
    for batch in tqdm(loader):        # one bar per machine (drawn by the launching cell)
        ...
    wait_for_everyone()
"""

from __future__ import annotations

from typing import Any

from nblaunch.training.runtime.state import PartialState

__all__ = ["tqdm", "wait_for_everyone"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, disabled on every process but each machine's first unless
    ``main_process_only=False`` (Accelerate's ``accelerate.utils.tqdm``)."""
    try:
        from tqdm.auto import tqdm as _tqdm  # deferred: tqdm is optional
    except ImportError:
        raise ImportError("nblaunch.utils.tqdm needs tqdm: pip install tqdm") from None
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return _tqdm(*args, disable=disable, **kwargs)


def wait_for_everyone() -> None:
    """A barrier: every process waits here until all have arrived (nothing with one process)."""
    PartialState().wait_for_everyone()
