"""Per-process distributed state: who am I, how many of us, which device, which process group.

:class:`PartialState` is what Accelerate calls the same thing: a shared ("Borg") object, so every
``PartialState()`` in a process sees the same rank, device and process group. It is built from the
variables the launcher sets in every worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...); with
none of them set it describes a single, non-distributed process.

On XLA (``notebook_launcher(..., start_method="xla")``, TPU hosts) one process runs several
ranks, one thread each, so there the state is shared per *thread* instead, and its ranks come
from ``torch_xla.runtime``, never from the environment (which the threads share).

Unlike Accelerate, the state can be thrown away: :func:`reset_process_state` destroys the process
group nblaunch created (never one it adopted) and forgets everything, and a state inherited through
``fork`` or built under other launch variables is rebuilt on its own. So an ``Accelerator`` made in
the notebook never stops a later ``notebook_launcher`` from working.

Example::

    from nblaunch.training import PartialState
    state = PartialState()
    print(state.process_index, state.num_processes, state.device)
    with state.main_process_first():
        download_dataset()
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from nblaunch.contract import variables as v
from nblaunch.contract.precision import AUTO, fast_precision, precision_from_environ
from nblaunch.training.runtime import xla
from nblaunch.training.runtime.environment import (DistributedType, debug_mode, env_int, forces_cpu, launch_key,
                                                   uses_xla)
from nblaunch.training.runtime.splitting import split_inputs
from nblaunch.worker import step_clock

__all__ = ["DistributedType", "PartialState", "AcceleratorState", "reset_process_state"]


class _ThreadState(threading.local):
    """The calling thread's state dict, for XLA, where each device thread is its own rank."""

    shared: dict[str, Any] | None = None


_thread_state = _ThreadState()


def _thread_dict() -> dict[str, Any]:
    shared = _thread_state.shared
    if shared is None:
        shared = _thread_state.shared = {}
    return shared


class PartialState:
    """The distributed state of this process (of this thread on XLA), shared by every instance
    there.

    Args:
        cpu: train on the CPU (gloo) even if CUDA is available. ``NBLAUNCH_FORCE_CPU=1`` (set by
            ``debug_launcher``) does the same.
        backend: process-group backend; default gloo on CPU, nccl on CUDA.
        timeout: timeout of the process group's collectives.

    Attributes: ``process_index``, ``local_process_index``, ``num_processes``,
    ``num_local_processes``, ``device``, ``distributed_type``, ``backend``, ``is_main_process``,
    ``is_local_main_process``, ``is_last_process``, ``use_distributed``.

    If a process group already exists (one a cluster engine created), it is adopted: its rank and
    size are used, and :func:`reset_process_state` leaves it alone.

    On XLA (see :func:`xla_requested`) ``distributed_type`` is ``XLA`` whatever the number of
    devices, ``device`` is the thread's XLA device, and no process group is made: collectives go
    through XLA.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, backend: str | None = None,
                 timeout: timedelta | None = None, **kwargs: Any) -> None:
        key = launch_key()
        cpu = bool(cpu) or forces_cpu(key)
        shared = self._shared_state
        # The process's state, built here under the same variables, is never an XLA one: only
        # without it are the XLA variables read (so the CPU/CUDA path reads nothing more).
        # Asking for XLA in a process that already has a CPU state needs reset_process_state().
        on_xla = not (shared.get("_initialized") and shared["_key"] == key) and uses_xla(cpu)
        if on_xla:
            shared = _thread_dict()
        self.__dict__ = shared
        if shared.get("_initialized"):
            if self._key == key and (self._cpu == cpu or self._cpu_irrelevant(cpu)):
                return
            if self._owns_group and dist.is_initialized() and self._key[0] == os.getpid():
                raise RuntimeError(
                    "The process state was created with other settings (cpu="
                    f"{self._cpu}, backend={self.backend}); call "
                    "nblaunch.training.reset_process_state() before changing them."
                )
            # Stale: inherited through fork or built under other launch variables; nothing of
            # it can be used here, and the group (if any) is not ours to destroy in this pid.
            shared.clear()
        if on_xla:
            self._build_xla(key)
        else:
            self._build(key, cpu, backend, timeout)

    def __getattr__(self, name: str) -> Any:
        # Only reached for missing attributes: after reset_process_state() everything is missing.
        if not name.startswith("__") and not self.__dict__.get("_initialized"):
            raise RuntimeError(
                f"PartialState.{name}: the process state was reset (reset_process_state()); "
                "create a new Accelerator or PartialState")
        raise AttributeError(name)

    # -- construction -----------------------------------------------------------------------

    def _cpu_irrelevant(self, cpu: bool) -> bool:
        # Asking for the CPU changes nothing where there is no CUDA device anyway.
        return self.device.type == "cpu" and (cpu or not torch.cuda.is_available())

    def _build_xla(self, key: tuple) -> None:
        s = self.__dict__
        s.update(xla.rank_state())
        s.update(_cpu=False, _owns_group=False, _key=key, backend="xla",
                 distributed_type=DistributedType.XLA, debug=debug_mode(), _initialized=True)

    def _build(self, key: tuple, cpu: bool, backend: str | None, timeout: timedelta | None) -> None:
        s = self.__dict__
        s["_cpu"] = cpu
        s["debug"] = debug_mode()
        s["_owns_group"] = False
        s["_key"] = key
        use_cuda = not cpu and torch.cuda.is_available()
        if dist.is_available() and dist.is_initialized():
            # Adopt the group someone else made; local rank from the environment if given.
            rank, world = dist.get_rank(), dist.get_world_size()
            local_world = env_int(v.LOCAL_WORLD_SIZE, world)
            local_rank = env_int(v.LOCAL_RANK, rank % max(local_world, 1))
            s["backend"] = dist.get_backend()
            use_cuda = use_cuda and s["backend"] != "gloo"
        else:
            world = env_int(v.WORLD_SIZE, 1)
            rank = env_int(v.RANK, 0)
            local_rank = env_int(v.LOCAL_RANK, rank)
            local_world = env_int(v.LOCAL_WORLD_SIZE, world)
            s["backend"] = None
            if world > 1:
                backend = backend or ("nccl" if use_cuda else "gloo")
                if use_cuda:  # before nccl touches a device
                    torch.cuda.set_device(local_rank % torch.cuda.device_count())
                init_kwargs: dict[str, Any] = {"backend": backend, "init_method": "env://",
                                               "rank": rank, "world_size": world}
                if timeout is not None:
                    init_kwargs["timeout"] = timeout
                dist.init_process_group(**init_kwargs)
                s["backend"] = backend
                s["_owns_group"] = True
        s["process_index"] = rank
        s["local_process_index"] = local_rank
        s["num_processes"] = world
        s["num_local_processes"] = local_world
        if use_cuda:
            # One visible device per rank (CUDA_VISIBLE_DEVICES narrowed) or all of them.
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        s["device"] = device
        if world > 1:
            s["distributed_type"] = DistributedType.MULTI_GPU if use_cuda else DistributedType.MULTI_CPU
        else:
            s["distributed_type"] = DistributedType.NO
        s["_initialized"] = True

    # -- properties ---------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return bool(self.__dict__.get("_initialized"))

    @property
    def use_distributed(self) -> bool:
        """True when collectives go through a process group (more than one process)."""
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def adopted_process_group(self) -> bool:
        """True when the process group was made by someone else (never destroyed by us)."""
        return self.use_distributed and not self._owns_group

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n")

    def ensure_process_group(self) -> None:
        """A process group even for one process (FSDP shards over one: CPU offload, and the
        checkpoints Accelerate writes on one GPU), made here in memory if there is none."""
        if dist.is_initialized():
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.__dict__.update(backend=backend, _owns_group=True)

    # -- synchronisation ------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a barrier); no-op with one process
        (on XLA always an ``xm.rendezvous``)."""
        if self.distributed_type is DistributedType.XLA:
            xla.barrier("nblaunch.wait_for_everyone")
        elif self.num_processes > 1:
            with step_clock.collective("barrier"):
                if self.backend == "nccl":
                    dist.barrier(device_ids=[self.device.index])
                else:
                    dist.barrier()

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy ``group``, or (None) the process group this state made, and forget the state;
        a group nblaunch adopted is left alone. As in Accelerate, call it at the end."""
        if group is not None:
            dist.destroy_process_group(group)
        else:
            reset_process_state()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on the main process first, then on the others (e.g. a download)."""
        return self._leader_first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Like :meth:`main_process_first`, per node."""
        return self._leader_first(self.is_local_main_process)

    @contextlib.contextmanager
    def _leader_first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of a list, tuple, tensor or dict of those.

        The first ``len % num_processes`` processes get one item more; with ``apply_padding`` the
        others repeat their last item so every share has the same length (for ``gather``).

        Example::

            with state.split_between_processes(["a", "b", "c"]) as prompts:
                ...  # rank 0: ["a", "b"], rank 1: ["c"]
        """
        yield split_inputs(inputs, self.process_index, self.num_processes, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- decorators -----------------------------------------------------------------------------

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` on the main process only (others get None)."""
        return self._on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self._on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        return self._on(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._on(function, lambda: self.process_index == process_index)

    @staticmethod
    def _on(function: Callable, test: Callable[[], bool]) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs) if test() else None
        return wrapper


class AcceleratorState(PartialState):
    """Accelerate's ``AcceleratorState``: the same shared process state, plus the launch's mixed
    precision. (In nblaunch, settings such as mixed precision belong to each ``Accelerator``.)"""

    @property
    def mixed_precision(self) -> str:
        """The launch's mixed precision (``NBLAUNCH_MIXED_PRECISION``), "auto" as this device runs it."""
        mode = precision_from_environ()
        if mode == AUTO:
            capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
            mode = fast_precision(self.device.type, capability)
        return mode

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Accelerate's reset; the process state goes with ``reset_partial_state=True``."""
        if reset_partial_state:
            reset_process_state()


# Destroyed groups are kept until the process exits. A DDP model that outlives its group holds
# the last reference to it; dropping that reference with the GIL held runs ~ProcessGroupGloo,
# which joins a gloo worker thread that is itself waiting for the GIL (a finished collective's
# thread state holds a Python object), and the rank hangs for good. Ranks leave with os._exit.
_RETIRED_GROUPS: list[Any] = []


def reset_process_state() -> None:
    """Forget this process's distributed state (and the calling thread's XLA state); destroy the
    process group if nblaunch made it.

    A group that was adopted (created by someone else) is left alone. Safe to call at any time,
    also when nothing was ever initialised. Tests call it between cases.
    """
    s = PartialState._shared_state
    if (s.get("_owns_group") and s.get("_key", (None,))[0] == os.getpid()
            and dist.is_available() and dist.is_initialized()):
        _RETIRED_GROUPS.append(dist.group.WORLD)
        dist.destroy_process_group()
    s.clear()
    if _thread_state.shared is not None:
        _thread_state.shared.clear()
