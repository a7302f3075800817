"""A warm rank's process group: formed before the first call, kept for every call after, and
repaired in place when a failed call left collectives waiting.

A pool of warm ranks is a process group to its users (``%%distributed`` cells call
``dist.get_rank()`` or ``dist.all_reduce`` from the first one), so each rank joins the default
group as soon as it starts: gloo on the CPU; on GPUs the rank's device is set first and NCCL
makes its communicators on the first collective, as it does for any group. An ``Accelerator``
made later adopts that group. Code written for a launch calls ``init_process_group`` itself:
in a warm rank that call is answered by the pool's group when it asks for what the group is
(the same backend, or none named), and refused with what to do when it asks for another.

When one rank's call raised while another waits in a collective it will never complete, the
launcher asks the ranks to *release* the group: each shuts down its gloo connections, so every
waiting (and later) collective of that call raises at once instead of hanging. After the call the
launcher has every rank *re-form* it: a fresh gloo backend is registered in the same
``ProcessGroup`` object, so whatever holds the group (a DDP model, an Accelerator, a DeviceMesh)
goes on working. torch keeps one backend per backend type, so each re-forming takes a type the
group has not used yet: a pool can be re-formed ``len(_SPARE_TYPES)`` times; after that the
launcher ends the pool and says why. On NCCL a release is refused (not done yet): the cell waits
as a kernel would, the stall report names who waits, and the stop button ends the pool.

Example (what a warm rank does before serving calls)::

    form_pool_group()
    dist.init_process_group("gloo")   # a cell's own call: the pool's group serves it
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from typing import Any, Callable

from nblaunch.contract import variables as v

_SPARE_TYPES = ("CUSTOM", "UCC", "MPI", "XCCL")  # backend types a CPU group never uses itself
REFORMS = len(_SPARE_TYPES)  # how often one group can be re-formed
_REFORM_TIMEOUT = datetime.timedelta(minutes=30)  # gloo's default for a collective
_group: dict[str, Any] = {"sockets": [], "reformed": 0, "backend": None, "released": False}


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
    before = _tcp_connections()
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    _group.update(backend=backend, sockets=_new_connections(before))
    dist.init_process_group = _answered_by_the_pool(dist, backend)


def adopt_group() -> None:
    """Take the default group a launch's own code formed as the one to release and re-form (the
    batch-size search of ``find_executable_batch_size``): its connections are this process's TCP
    connections, the rendezvous store's left out (a forked rank holds no other: the launcher's
    descriptors were closed at the fork)."""
    import torch.distributed as dist

    if _group["backend"] is None and dist.is_initialized():
        _group.update(backend=dist.get_backend(), sockets=_new_connections({}))


def release_group() -> str:
    """Make every collective of the pool's group fail at once, the one waiting now included.

    Returns "" when done, or why it cannot be (the launcher then ends the pool, saying so)."""
    if _group["backend"] != "gloo":
        return f"a {_group['backend'] or 'missing'} group's waiting collectives cannot be released yet"
    for fd in _group["sockets"]:
        try:
            with socket.socket(fileno=os.dup(fd)) as connection:
                connection.shutdown(socket.SHUT_RDWR)  # gloo keeps its descriptor; it now reads EOF
        except OSError:
            pass  # already closed by the peer's side
    _group["released"] = True
    return ""


def reform_group(generation: int) -> None:
    """Every rank at once: a fresh gloo backend for the pool's group, in the same group object;
    nothing where the group was not released (a refused release leaves it as it was)."""
    if not _group["released"]:
        return
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo

    if reforms_left() == 0:
        raise RuntimeError(f"the pool's process group was re-formed {_group['reformed']} times, as often as torch "
                           "allows in one group")
    group = dist.distributed_c10d._get_default_group()
    store = dist.PrefixStore(f"nblaunch-reformed-{generation}", dist.distributed_c10d._get_default_store())
    before = _tcp_connections()
    fresh = ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), _REFORM_TIMEOUT)
    kind = getattr(ProcessGroup.BackendType, _SPARE_TYPES[_group["reformed"]])
    group._register_backend(torch.device("cpu"), kind, fresh)  # CPU collectives now dispatch to it
    _group.update(reformed=_group["reformed"] + 1, sockets=_new_connections(before), released=False)


def reforms_left() -> int:
    """How many more times the group can be re-formed."""
    return REFORMS - _group["reformed"]


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


def _tcp_connections() -> dict[int, tuple[int, int]]:
    """``{fd: (local port, peer port)}`` of this process's connected TCP sockets."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as s:
                if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                    found[int(name)] = (s.getsockname()[1], s.getpeername()[1])
        except OSError:
            continue  # not connected (a listening socket), or closed meanwhile
    return found


def _new_connections(before: dict[int, tuple[int, int]]) -> list[int]:
    """The group's own connections: made since ``before``, and not the rendezvous store's."""
    store_port = int(os.environ.get(v.MASTER_PORT, "0"))
    return [fd for fd, ports in _tcp_connections().items() if before.get(fd) != ports and store_port not in ports]
