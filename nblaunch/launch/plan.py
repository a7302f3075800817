"""Deciding how a launch will run, from the user's arguments and what this machine has.

All checks happen here, before any process starts: a refused launch leaves nothing behind.
"""

from __future__ import annotations

import inspect
import math
import operator
import os
import resource
import sys
from dataclasses import dataclass
from typing import Any, Callable

from nblaunch.display import DISPLAY_CHOICES
from nblaunch.launch import devices, ports, xla
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.threads import threads_per_worker

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")
START_METHODS = ("fork", "spawn", "xla")
CLUSTER_CHOICES = (None, "ray")  # None: this machine


@dataclass(frozen=True)
class LaunchPlan:
    """How one launch runs: who, where, how it starts, where the ranks meet."""

    function_name: str
    num_processes: int  # ranks on this node
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    start_method: str
    start_reason: str
    device_kind: str  # "cpu", "cuda" or "xla"
    threads: int | None
    mixed_precision: str
    force_cpu: bool
    xla_environ: dict[str, str] | None = None  # XLA only: what the host process adds to its environment
    max_restarts: int = 0  # after a rank fails, start every rank again up to this many times
    restart: int = 0  # which start this is: 0 first, 1 the first restart, ...
    port_pinned: bool = False  # use_port given: every restart meets there again

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def devices(self) -> str:
        if self.device_kind == "xla":
            return f"{plural(self.num_processes, 'XLA device')} ({os.environ.get('PJRT_DEVICE') or 'TPU'})"
        if self.device_kind == "cuda":
            return plural(self.num_processes, "CUDA GPU")
        threads = f", {plural(self.threads, 'thread')} each" if self.threads else ""
        return f"CPU{threads}"

    def rank_environ(self, local_rank: int) -> dict[str, str]:
        """The variables torch.distributed (and our Accelerator) read in rank ``local_rank``."""
        env = {
            "RANK": str(self.node_rank * self.num_processes + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.num_processes),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NBLAUNCH_MIXED_PRECISION": self.mixed_precision,
            # What Hugging Face Accelerate (and so transformers' Trainer) reads, as its own
            # launchers set it: code that keeps `accelerate` gets the same launch.
            "ACCELERATE_MIXED_PRECISION": self.mixed_precision,
        }
        if self.device_kind == "cpu" and self.world_size > 1:
            # Without it Accelerate's state joins no process group on a CPU: every rank would
            # train the whole data set alone. (With one rank it would make a group of one.)
            env["ACCELERATE_USE_CPU"] = "true"
        if self.max_restarts:
            # torchrun's names: code written for elastic restarts reads them to resume.
            env["TORCHELASTIC_RESTART_COUNT"] = str(self.restart)
            env["TORCHELASTIC_MAX_RESTARTS"] = str(self.max_restarts)
        if self.force_cpu:
            env["NBLAUNCH_FORCE_CPU"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def port_number(value: Any) -> int | None:
    if value is None:
        return None
    try:
        # Accelerate's callers pass strings such as "29500"; numpy ints are ints; 2.5 is no port
        # (int() would say 2)
        port = int(value) if isinstance(value, str) else operator.index(value)
    except (TypeError, ValueError):
        port = -1
    if isinstance(value, bool) or not 0 < port < 65536:
        raise LaunchConfigError(f"use_port must be a port number (1-65535) or None for a free port, got {value!r}")
    return port


def plural(count: int, noun: str) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def start_method_for(requested: str | None, force_cpu: bool) -> tuple[str, str]:
    """How ranks would start here, and why: ``("fork", "the quickest start: ...")``."""
    if requested is not None and requested not in START_METHODS:
        raise LaunchConfigError(f"start_method must be None (choose for me), 'fork', 'spawn' or 'xla', got {requested!r}")
    cuda_in_parent = not force_cpu and devices.cuda_initialized()
    if requested == "spawn":
        return "spawn", "asked for with start_method='spawn'"
    if not hasattr(os, "fork") or sys.platform != "linux":
        if requested == "fork":
            raise LaunchConfigError(f"start_method='fork' is not safe on {sys.platform}; use start_method=None")
        return "spawn", f"fork is not safe on {sys.platform}"
    if cuda_in_parent:
        if requested == "fork":
            raise LaunchConfigError(
                "start_method='fork' would break CUDA in the workers: CUDA is already initialised in this "
                "process. Use start_method=None (nblaunch then spawns), or move the CUDA code into the function."
            )
        return "spawn", "CUDA is already initialised in this process, and forked workers could not use it"
    if requested == "fork":
        return "fork", "asked for with start_method='fork'"
    return "fork", "the quickest start: each process begins as a copy of this one"


def check_call(function: Callable, args: tuple) -> None:
    """Refuse, before any process starts, a function that each rank could not call and return
    from: coroutine and generator functions, and arguments that do not fit its signature."""
    name = getattr(function, "__qualname__", None) or repr(function)
    if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
        raise LaunchConfigError(
            f"{name} is an async function; each rank calls it plainly, with no event loop. Launch a plain "
            f"function that runs it: def train(*args): return asyncio.run({name}(*args))"
        )
    if inspect.isgeneratorfunction(function):
        raise LaunchConfigError(
            f"{name} is a generator function; its generator could not be sent back from the ranks. "
            "Return a list instead (e.g. return list(...))."
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # builtins and some C callables have none: nothing to check against
    try:
        signature.bind(*args)
    except TypeError as error:
        raise LaunchConfigError(
            f"{name}{signature} cannot be called with args={args!r}: {error}. Pass args=(...) with one "
            "value per parameter."
        ) from None


# Open files the launcher holds per rank: 4 pipe ends, a pidfd, a log file (and, while a rank
# starts, its 4 other pipe ends); plus a few for the launch itself.
_FILES_PER_RANK = 10
_FILES_PER_LAUNCH = 16


def check_open_files(num_processes: int) -> None:
    """Refuse a launch that would run out of file descriptors halfway through starting."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        return
    needed = in_use + _FILES_PER_RANK * num_processes + _FILES_PER_LAUNCH
    if needed > soft:
        can_raise = hard == resource.RLIM_INFINITY or needed <= hard
        how = (f"raise the limit first: import resource; resource.setrlimit(resource.RLIMIT_NOFILE, "
               f"({needed}, {'resource.RLIM_INFINITY' if hard == resource.RLIM_INFINITY else hard}))"
               if can_raise else f"the hard limit is {hard}: use fewer processes or raise it (ulimit -Hn)")
        raise LaunchConfigError(
            f"num_processes={num_processes} needs about {needed} open files in this process, but the limit "
            f"is {soft} (ulimit -n); {how}"
        )


def check_basics(function: Any, args: Any, mixed_precision: Any, timeout: Any, display: Any) -> str:
    """The checks every launch shares, wherever its ranks run; returns ``mixed_precision``
    in lower case. Raises LaunchConfigError."""
    if not callable(function):
        raise LaunchConfigError(f"function must be callable (the training function to run), got {type(function).__name__}")
    if not isinstance(args, tuple):
        raise LaunchConfigError(f"args must be a tuple of arguments for the function, got {type(args).__name__}; e.g. args=(lr,)")
    if not isinstance(mixed_precision, str) or mixed_precision.lower() not in MIXED_PRECISION_CHOICES:
        raise LaunchConfigError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, got {mixed_precision!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise LaunchConfigError(
            f"timeout must be a positive, finite number of seconds, or None for no limit; got {timeout!r}"
        )
    if isinstance(display, str):
        if display not in DISPLAY_CHOICES:
            raise LaunchConfigError(f"display must be one of {', '.join(DISPLAY_CHOICES)}, got {display!r}")
    elif not (callable(getattr(display, "on_event", None)) and callable(getattr(display, "close", None))):
        raise LaunchConfigError(
            f"display must be one of {', '.join(DISPLAY_CHOICES)} or an object with on_event(event) and "
            f"close() methods; got a {type(display).__name__}"
        )
    check_call(function, args)
    return mixed_precision.lower()


def make_plan(
    function: Callable,
    args: Any,
    num_processes: Any,
    mixed_precision: Any,
    use_port: Any,
    master_addr: Any,
    node_rank: Any,
    num_nodes: Any,
    start_method: Any,
    timeout: Any,
    display: Any,
    force_cpu: bool,
    max_restarts: Any = 0,
    monitor_interval: Any = 0.1,
    rdzv_backend: Any = "static",
) -> LaunchPlan:
    """Check every argument and decide how to launch; raises LaunchConfigError on bad input."""
    mixed_precision = check_basics(function, args, mixed_precision, timeout, display)
    num_nodes = positive_int("num_nodes", num_nodes)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < num_nodes:
        raise LaunchConfigError(f"node_rank must be an int in 0..num_nodes-1 (num_nodes={num_nodes}), got {node_rank!r}")
    if not isinstance(master_addr, str) or not master_addr:
        raise LaunchConfigError(f"master_addr must be a host name or address, got {master_addr!r}")
    max_restarts = _restarts(max_restarts, num_nodes, start_method)
    check_elastic_arguments(monitor_interval, rdzv_backend)
    port = port_number(use_port)
    if port is None and num_nodes > 1:
        raise LaunchConfigError(
            "with num_nodes > 1, every node must agree on the port: pass the same use_port=... on every node"
        )

    if start_method == "xla" or (start_method is None and not force_cpu and xla.tpu_markers()):
        if max_restarts:
            raise LaunchConfigError("max_restarts is not supported on XLA (torch_xla's xmp.spawn starts the ranks)")
        return _xla_plan(function, num_processes, mixed_precision, master_addr, start_method, port)
    gpus = 0 if force_cpu else devices.cuda_device_count()
    if num_processes is None:
        if gpus < 2:
            found = "1 GPU" if gpus == 1 else "no GPU"
            raise LaunchConfigError(
                f"num_processes=None uses one process per accelerator, but this machine has {found}. "
                "Pass num_processes=N: e.g. num_processes=2 runs 2 CPU processes."
            )
        num_processes = gpus
    num_processes = positive_int("num_processes", num_processes)
    device_kind = "cuda" if gpus else "cpu"
    if device_kind == "cuda" and num_processes > gpus:
        raise LaunchConfigError(
            f"num_processes={num_processes} but only {gpus} GPU(s) are visible: pass num_processes<={gpus}, "
            "or use debug_launcher to run more processes on the CPU."
        )
    if mixed_precision == "fp8" and device_kind != "cuda":
        raise LaunchConfigError("mixed_precision='fp8' needs CUDA GPUs; on the CPU use 'bf16' or 'no'")
    check_open_files(num_processes)
    method, reason = start_method_for(start_method, force_cpu)
    master_port = ports.choose_port(master_addr, port, hosted_here=node_rank == 0)
    return LaunchPlan(
        function_name=getattr(function, "__qualname__", None) or repr(function),
        num_processes=num_processes,
        num_nodes=num_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        start_method=method,
        start_reason=reason,
        device_kind=device_kind,
        threads=threads_per_worker(num_processes),
        mixed_precision=mixed_precision,
        force_cpu=force_cpu,
        max_restarts=max_restarts,
        port_pinned=port is not None,
    )


def _restarts(value: Any, num_nodes: int, start_method: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LaunchConfigError(f"max_restarts must be an int >= 0 (0: no restart), got {value!r}")
    if value and num_nodes > 1:
        raise LaunchConfigError(
            "max_restarts works on one machine only for now: with num_nodes > 1 the nodes could not agree on "
            "when to restart. Pass max_restarts=0, or resume from a checkpoint with a new launch."
        )
    return value


def check_elastic_arguments(monitor_interval: Any, rdzv_backend: Any) -> None:
    """Accelerate's elastic-launch arguments: accepted where they mean something here."""
    if (isinstance(monitor_interval, bool) or not isinstance(monitor_interval, (int, float))
            or not math.isfinite(monitor_interval) or monitor_interval <= 0):
        raise LaunchConfigError(f"monitor_interval must be a positive number of seconds, got {monitor_interval!r}")
    if rdzv_backend not in ("static", "c10d"):
        raise LaunchConfigError(
            f"rdzv_backend must be 'static' or 'c10d', got {rdzv_backend!r}; nblaunch knows every rank up front, "
            "so both mean the same here"
        )


def _xla_plan(function: Callable, num_processes: Any, mixed_precision: str, master_addr: str,
              requested: str | None, port: int | None) -> LaunchPlan:
    """A launch through torch_xla's xmp.spawn: every local XLA device is a rank."""
    if num_processes is not None:
        num_processes = positive_int("num_processes", num_processes)
    xla.check_usable()
    if mixed_precision in ("fp16", "fp8"):
        raise LaunchConfigError(f"mixed_precision={mixed_precision!r} is not supported on XLA devices; use 'bf16' or 'no'")
    count, host_environ = xla.local_device_count(num_processes)
    if requested == "xla":
        reason = "asked for with start_method='xla'"
    else:
        reason = f"TPU host ({', '.join(xla.tpu_markers())})"
    return LaunchPlan(
        function_name=getattr(function, "__qualname__", None) or repr(function),
        num_processes=count,
        num_nodes=1,
        node_rank=0,
        master_addr=master_addr,
        master_port=ports.choose_port(master_addr, port, hosted_here=True),  # unused by XLA; kept for the record
        start_method="xla",
        start_reason=reason + "; torch_xla's xmp.spawn starts one process per chip",
        device_kind="xla",
        threads=None,
        mixed_precision=mixed_precision,
        force_cpu=False,
        xla_environ=dict(host_environ, NBLAUNCH_MIXED_PRECISION=mixed_precision, NBLAUNCH_XLA="1"),
    )
