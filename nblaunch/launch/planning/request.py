"""The request: one launch's settings, one typed object from the cell to the ranks' cluster.

``notebook_launcher``, ``debug_launcher``, ``WarmRanks``, ``nblaunch launch``, a detached
launch's supervisor and a Ray node's agent all hold a :class:`LaunchRequest`. Its checks and
defaults live in one place, :meth:`LaunchRequest.__post_init__`: a request that exists is a
checked one, and a bad argument is refused (``LaunchConfigError``, with what to pass instead)
before anything starts. Whoever needs a variant (a node's part of a Ray launch, warm ranks
showing each call in its own cell) makes it with ``dataclasses.replace``, which checks again.

What depends on where the ranks run (GPUs here, nodes of a cluster, a free port) is the
cluster's to decide, in its :class:`~nblaunch.launch.planning.plan.LaunchPlan`.

Example::

    >>> request = LaunchRequest(print, ("hi",), num_processes=2, mixed_precision="BF16")
    >>> request.mixed_precision
    'bf16'
    >>> LaunchRequest(print, num_processes=0)
    Traceback (most recent call last):
    ...
    nblaunch.launch.errors.LaunchConfigError: num_processes must be a positive int or None (one per GPU), got 0
"""

from __future__ import annotations

import inspect
import math
import os
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nblaunch.contract.precision import parse_precision
from nblaunch.display import DISPLAY_CHOICES
from nblaunch.events import Display
from nblaunch.launch.errors import LaunchConfigError

START_METHODS = ("fork", "spawn", "xla")
DEFAULT_MASTER_ADDR = "127.0.0.1"
STALL_AFTER_S = 60.0  # long enough for a slow step, short enough that a hang is named early


@dataclass(frozen=True)
class LaunchRequest:
    """What the caller asked for, checked: see the module's docstring."""

    function: Callable[..., Any]
    args: tuple = ()
    num_processes: int | None = None  # ranks per node; None: one per GPU, or 2 CPU ranks (the cluster decides)
    mixed_precision: str = "no"  # one of nblaunch.contract.precision.PRECISIONS (another spelling becomes one)
    use_port: int | None = None  # the rendezvous port; None: a free one
    master_addr: str = DEFAULT_MASTER_ADDR
    node_rank: int = 0
    num_nodes: int | None = None  # None: the cluster decides (1; every node of a Slurm allocation)
    start_method: str | None = None  # None: fork where it is safe, else spawn
    timeout: float | None = None  # seconds for the whole launch, restarts included
    display: str | Display = "auto"
    cpu: bool = False  # every rank on the CPU, the GPUs hidden
    max_restarts: int = 0
    run_id: str = "none"  # torchrun's TORCHELASTIC_RUN_ID (Accelerate's rdzv_id)
    cluster: str | None = None  # which cluster: read by nblaunch.clusters, nowhere else
    resources: Mapping[str, Any] | None = None  # what a cluster's class asks it for (Slurm, outside an allocation)
    stall_after: float | None = STALL_AFTER_S  # seconds without progress before the cell shows a stall; None: never
    resume: bool | str = False  # True: the latest checkpoint, loaded before the first step; a str: that folder

    def __post_init__(self) -> None:
        function, args = self.function, self.args
        if not callable(function):
            raise LaunchConfigError(f"function must be callable (the training function to run), got "
                                    f"{type(function).__name__}")
        if not isinstance(args, tuple):
            raise LaunchConfigError(f"args must be a tuple of arguments for the function, got "
                                    f"{type(args).__name__}; e.g. args=(lr,)")
        try:
            self._set("mixed_precision", parse_precision(self.mixed_precision))
        except ValueError as error:
            raise LaunchConfigError(str(error)) from None
        _check_timeout(self.timeout)
        check_stall_after(self.stall_after)
        _check_display(self.display)
        check_call(function, args)
        if self.num_processes is not None:
            positive_int("num_processes", self.num_processes, " or None (one per GPU)")
        num_nodes = 1 if self.num_nodes is None else positive_int("num_nodes", self.num_nodes, " or None")
        node_rank = self.node_rank
        if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < num_nodes:
            raise LaunchConfigError(f"node_rank must be an int in 0..num_nodes-1 (num_nodes={num_nodes}), "
                                    f"got {node_rank!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise LaunchConfigError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        self._set("use_port", port_number(self.use_port))
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise LaunchConfigError(f"start_method must be None (choose for me), 'fork', 'spawn' or 'xla', "
                                    f"got {self.start_method!r}")
        if not isinstance(self.cpu, bool):
            raise LaunchConfigError(f"cpu must be True or False, got {self.cpu!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise LaunchConfigError(f"max_restarts must be an int >= 0 (0: no restart), got {self.max_restarts!r}")
        if not isinstance(self.run_id, str):
            raise LaunchConfigError(f"rdzv_id must be a string (the job's name, TORCHELASTIC_RUN_ID in every rank), "
                                    f"got {self.run_id!r}")
        if self.cluster is not None and not isinstance(self.cluster, str):
            raise LaunchConfigError(f"cluster must be None (this machine) or a cluster's name, got {self.cluster!r}")
        self._set("resume", _checked_resume(self.resume, self.num_processes, self.num_nodes))
        if self.resources is not None and not isinstance(self.resources, Mapping):
            raise LaunchConfigError(f"resources must be a dict of what to ask the cluster for (e.g. "
                                    f"{{'partition': 'gpu', 'time': '1:00:00'}}), got {self.resources!r}")

    @classmethod
    def from_call(cls, function: Callable[..., Any], args: tuple = (), *, rdzv_backend: Any = "static",
                  rdzv_endpoint: Any = "", rdzv_conf: Any = None, rdzv_id: Any = "none", monitor_interval: Any = 0.1,
                  log_line_prefix_template: Any = None, **settings: Any) -> "LaunchRequest":
        """The request of a ``notebook_launcher(...)`` call, Accelerate's elastic-launch
        arguments among ``settings``: those that mean something here are folded in
        (``rdzv_endpoint`` is ``master_addr`` and ``use_port``; ``rdzv_id`` the run id), those
        that would need torchelastic's dynamic rendezvous, which nblaunch does not use (it knows
        every rank up front), are refused."""
        if (isinstance(monitor_interval, bool) or not isinstance(monitor_interval, (int, float))
                or not math.isfinite(monitor_interval) or monitor_interval <= 0):
            raise LaunchConfigError(f"monitor_interval must be a positive number of seconds, got {monitor_interval!r}")
        if rdzv_backend not in ("static", "c10d"):
            raise LaunchConfigError(
                f"rdzv_backend must be 'static' or 'c10d', got {rdzv_backend!r}; nblaunch knows every rank up front, "
                "so both mean the same here")
        if rdzv_conf:
            raise LaunchConfigError(
                f"rdzv_conf={rdzv_conf!r} configures torchelastic's dynamic rendezvous, which nblaunch does not use: "
                "every rank is known up front. Leave it out (a timeout for the whole launch is timeout=).")
        if log_line_prefix_template is not None:
            raise LaunchConfigError(
                "log_line_prefix_template is not supported: nblaunch tags every line with its rank itself "
                "('[rank 1] ...' in text, a column per rank in the dashboard). Leave it out.")
        master_addr, use_port = _rendezvous_point(settings.pop("master_addr", DEFAULT_MASTER_ADDR),
                                                  settings.pop("use_port", None), rdzv_endpoint)
        return cls(function, args, master_addr=master_addr, use_port=use_port, run_id=rdzv_id, **settings)

    @property
    def function_name(self) -> str:
        return getattr(self.function, "__qualname__", None) or repr(self.function)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: a checked value in its one form


def positive_int(name: str, value: Any, alternative: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchConfigError(f"{name} must be a positive int{alternative}, got {value!r}")
    return value


def port_number(value: Any) -> int | None:
    """``use_port`` as an int (Accelerate's callers pass "29500"), or None for a free one."""
    if value is None:
        return None
    try:
        # numpy ints are ints; 2.5 is no port (int() would say 2)
        port = int(value) if isinstance(value, str) else operator.index(value)
    except (TypeError, ValueError):
        port = -1
    if isinstance(value, bool) or not 0 < port < 65536:
        raise LaunchConfigError(f"use_port must be a port number (1-65535) or None for a free port, got {value!r}")
    return port


def check_call(function: Callable, args: tuple) -> None:
    """Refuse, before any process starts, a function that each rank could not call and return
    from: coroutine and generator functions, and arguments that do not fit its signature."""
    name = getattr(function, "__qualname__", None) or repr(function)
    if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
        raise LaunchConfigError(
            f"{name} is an async function; each rank calls it plainly, with no event loop. Launch a plain "
            f"function that runs it: def train(*args): return asyncio.run({name}(*args))")
    if inspect.isgeneratorfunction(function):
        raise LaunchConfigError(
            f"{name} is a generator function; its generator could not be sent back from the ranks. "
            "Return a list instead (e.g. return list(...)).")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # builtins and some C callables have none: nothing to check against
    try:
        signature.bind(*args)
    except TypeError as error:
        raise LaunchConfigError(
            f"{name}{signature} cannot be called with args={args!r}: {error}. Pass args=(...) with one "
            "value per parameter.") from None


def _checked_resume(resume: Any, num_processes: int | None, num_nodes: int | None) -> bool | str:
    """``resume=`` as True/False or an absolute folder; a folder that is missing, half written or
    saved by another number of processes is refused here, before any process starts."""
    if isinstance(resume, bool):
        return resume
    if not isinstance(resume, (str, os.PathLike)):
        raise LaunchConfigError(f"resume must be True (the latest checkpoint), False, or a checkpoint folder; "
                                f"got {resume!r}")
    folder = os.path.abspath(os.fspath(resume))
    if not os.path.isdir(folder):
        raise LaunchConfigError(f"resume={os.fspath(resume)!r}: no such folder. Give a folder save_state wrote "
                                "(the cell of an interrupted launch names it), or resume=True for the latest")
    # Deferred: the training side imports torch, which a launch that resumes nothing never needs here.
    from nblaunch.training.checkpoint import completeness, resume as resuming

    try:
        if num_processes is None:  # one per GPU, counted later: the ranks check the count as they load
            completeness.check_complete(folder)
        else:  # the ranks' own check, here before any process starts
            resuming.check_resumable(folder, num_processes * (num_nodes or 1))
    except ValueError as error:  # IncompleteCheckpointError is one
        raise LaunchConfigError(str(error)) from None
    return folder


def _check_timeout(timeout: Any) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise LaunchConfigError(
            f"timeout must be a positive, finite number of seconds, or None for no limit; got {timeout!r}")


def check_stall_after(stall_after: Any) -> None:
    if stall_after is not None and (isinstance(stall_after, bool) or not isinstance(stall_after, (int, float))
                                    or not math.isfinite(stall_after) or stall_after <= 0):
        raise LaunchConfigError(
            f"stall_after must be a positive, finite number of seconds (the cell names the ranks that hold the "
            f"others up after that long without progress; default {STALL_AFTER_S:g}), or None to never look; "
            f"got {stall_after!r}")


def _check_display(display: Any) -> None:
    if isinstance(display, str):
        if display not in DISPLAY_CHOICES:
            raise LaunchConfigError(f"display must be one of {', '.join(DISPLAY_CHOICES)}, got {display!r}")
    elif not (callable(getattr(display, "on_event", None)) and callable(getattr(display, "close", None))):
        raise LaunchConfigError(
            f"display must be one of {', '.join(DISPLAY_CHOICES)} or an object with on_event(event) and "
            f"close() methods; got a {type(display).__name__}")


def _rendezvous_point(master_addr: Any, use_port: Any, rdzv_endpoint: Any) -> tuple[Any, Any]:
    """``(master_addr, use_port)`` with Accelerate's ``rdzv_endpoint="host:port"`` folded in:
    the same meeting point, said the elastic way; refused where the two disagree."""
    if rdzv_endpoint in ("", None):
        return master_addr, use_port
    if not isinstance(rdzv_endpoint, str):
        raise LaunchConfigError(f"rdzv_endpoint must be 'host:port' or 'host', got {rdzv_endpoint!r}")
    host, _, port = rdzv_endpoint.rpartition(":") if ":" in rdzv_endpoint else (rdzv_endpoint, "", "")
    host = host.strip("[]")  # an IPv6 address in brackets
    if not host:
        raise LaunchConfigError(f"rdzv_endpoint must be 'host:port' or 'host', got {rdzv_endpoint!r}")
    clashes = []
    if master_addr not in (DEFAULT_MASTER_ADDR, host):  # the default: master_addr left out
        clashes.append(f"master_addr={master_addr!r}")
    if port and use_port is not None and str(use_port) != port:
        clashes.append(f"use_port={use_port!r}")
    if clashes:
        raise LaunchConfigError(f"rdzv_endpoint={rdzv_endpoint!r} and {' and '.join(clashes)} name different meeting "
                                "points: give one of them")
    return host, (port or use_port)
