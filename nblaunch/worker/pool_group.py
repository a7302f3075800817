"""A warm rank's process group: formed before the first call, kept for every call after.

A pool of warm ranks is a process group to its users (``%%distributed`` cells call
``dist.get_rank()`` or ``dist.all_reduce`` from the first one), so each rank joins the default
group as soon as it starts: gloo on the CPU; on GPUs the rank's device is set first and NCCL
makes its communicators on the first collective, as it does for any group. An ``Accelerator``
made later adopts that group. Code written for a launch calls ``init_process_group`` itself:
in a warm rank that call is answered by the pool's group when it asks for what the group is
(the same backend, or none named), and refused with what to do when it asks for another.

Example (what a warm rank does before serving calls)::

    form_pool_group()
    dist.init_process_group("gloo")   # a cell's own call: the pool's group serves it
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

from nblaunch.contract import variables as v


def form_pool_group() -> None:
    """Join the default process group of the pool (every rank calls it before serving)."""
    # Deferred: the worker package loads without torch; a warm rank imports it here, once.
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    rank, world = int(os.environ[v.RANK]), int(os.environ[v.WORLD_SIZE])
    backend = "gloo"
    if os.environ.get(v.FORCE_CPU) != "1" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get(v.LOCAL_RANK, "0")) % torch.cuda.device_count())
        backend = "nccl"  # no device_id: NCCL makes its communicators lazily
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    dist.init_process_group = _answered_by_the_pool(dist, backend)


def _answered_by_the_pool(dist: Any, pool_backend: str) -> Callable[..., Any]:
    """``dist.init_process_group``, answered by the pool's group while it exists."""
    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():  # the user destroyed the pool's group: theirs to remake
            return init(backend, *args, **kwargs)
        if backend not in (None, "", pool_backend):
            raise RuntimeError(
                f"init_process_group(backend={backend!r}): these warm ranks already form a process group "
                f"({pool_backend}, {dist.get_world_size()} ranks), which every call uses. Leave the call out, "
                "or call dist.destroy_process_group() first to make another."
            )
        return None

    return init_process_group
