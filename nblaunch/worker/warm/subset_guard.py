"""Refusing collectives in a call that runs on some ranks only (``%%distributed --rank 0``).

The ranks a call leaves out sit in their call loop: a collective the others start would wait for
them for ever. While such a call runs, torch.distributed's collectives (as ``torch.distributed``
and its ``distributed_c10d`` module offer them, which is where torch's, Accelerate's and
nblaunch's own helpers find them) raise at once, saying what to do instead; so does the forward
of a ``DistributedDataParallel`` model that would all-reduce its gradients in backward (from C++,
where no Python function can stop it). Collectives that other C++ code starts (FSDP's) are not
caught here: such a cell waits, the stall report names it, and the stop button releases it.

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
    modules = [dist, dist.distributed_c10d]  # loaded with torch.distributed, which re-exports its functions
    saved = [(m, name, getattr(m, name)) for m in modules for name in _COLLECTIVES if hasattr(m, name)]
    for module, name, original in saved:
        setattr(module, name, _refused(name, original, only))
    ddp = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    if ddp is not None:  # its backward all-reduces from C++, past any Python function
        saved.append((ddp, "forward", ddp.forward))
        ddp.forward = _ddp_forward_refused(ddp.forward, only)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _ddp_forward_refused(forward: Callable[..., Any], only: tuple[int, ...]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            raise _refusal("a DistributedDataParallel model's backward (its gradient all-reduce)", only,
                           "or run the model under torch.no_grad() (evaluation), or its .module, or inside "
                           "`with model.no_sync():`")
        return forward(self, *args, **kwargs)

    return guarded


def _refusal(what: str, only: tuple[int, ...], instead: str = "") -> RuntimeError:
    which = ", ".join(map(str, only))
    return RuntimeError(
        f"{what} needs every rank of the pool, and this cell runs on rank{'s' if len(only) > 1 else ''} "
        f"{which} only (--rank): the others would never join it. Run the cell without --rank/--ranks, "
        f"{instead + ', ' if instead else ''}or guard it with `if dist.get_rank() in ({which},)` in a cell every "
        "rank runs.")


def _refused(name: str, original: Callable[..., Any], only: tuple[int, ...]) -> Callable[..., Any]:
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _refusal(f"{name.lstrip('_')}()", only)

    return refuse
