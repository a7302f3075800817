"""Refusing collectives in a call that runs on some ranks only (``%%distributed --rank 0``).

The ranks a call leaves out sit in their call loop: a collective the others start would wait for
them for ever. While such a call runs, torch.distributed's collectives (as ``torch.distributed``
and its ``distributed_c10d`` module offer them, which is where torch's, Accelerate's and
nblaunch's own helpers find them) raise at once, saying what to do instead.

Example::

    with collectives_refused((0,)):     # this call runs on rank 0 only
        dist.all_reduce(t)              # RuntimeError: ... run the cell without --rank
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list", "_broadcast_coalesced",
)


@contextlib.contextmanager
def collectives_refused(only: tuple[int, ...] | None) -> Iterator[None]:
    """While the block runs, a collective raises if ``only`` names some ranks, not all."""
    dist = sys.modules.get("torch.distributed")
    if only is None or dist is None or not dist.is_initialized():
        yield
        return
    modules = [dist, sys.modules["torch.distributed.distributed_c10d"]]
    saved = [(m, name, getattr(m, name)) for m in modules for name in _COLLECTIVES if hasattr(m, name)]
    for module, name, original in saved:
        setattr(module, name, _refused(name, original, only))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _refused(name: str, original: Callable[..., Any], only: tuple[int, ...]) -> Callable[..., Any]:
    which = ", ".join(map(str, only))

    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{name.lstrip('_')}() needs every rank of the pool, and this cell runs on rank{'s' if len(only) > 1 else ''} "
            f"{which} only (--rank): the others would never join it. Run the cell without --rank/--ranks, "
            f"or guard it with `if dist.get_rank() in ({which},)` in a cell every rank runs."
        )

    return refuse
