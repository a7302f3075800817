"""The checks on a launch's arguments that do not depend on where its ranks run: each raises
:class:`~nblaunch.launch.errors.LaunchConfigError` with what to pass instead, before any process
starts.

Example::

    >>> positive_int("num_processes", 2)
    2
    >>> port_number("29500")
    29500
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import operator
import os
import resource
from typing import Any, Callable

from nblaunch.display import DISPLAY_CHOICES
from nblaunch.launch.errors import LaunchConfigError

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")


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


_FP8_BACKENDS = ("transformer_engine", "torchao", "msamp")  # what Accelerate's fp8 runs on


def check_fp8(mixed_precision: str, device_kind: str) -> None:
    """Refuse fp8 where no rank could run it: nblaunch's own Accelerator has no fp8, and
    Accelerate's needs CUDA GPUs and one of its fp8 backends installed."""
    if mixed_precision != "fp8":
        return
    if device_kind != "cuda":
        raise LaunchConfigError("mixed_precision='fp8' needs CUDA GPUs (Ada or Hopper and later); "
                                "on this machine use 'bf16' or 'no'")
    if not any(importlib.util.find_spec(name) for name in _FP8_BACKENDS):
        raise LaunchConfigError(
            "mixed_precision='fp8' runs only with Hugging Face Accelerate's own Accelerator and one of its fp8 "
            f"backends ({', '.join(_FP8_BACKENDS)}), and none is installed here; nblaunch's Accelerator does "
            "not do fp8. Use mixed_precision='bf16', or install an fp8 backend and use accelerate.Accelerator."
        )


def check_restarts(value: Any, num_nodes: int) -> int:
    """max_restarts, checked."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LaunchConfigError(f"max_restarts must be an int >= 0 (0: no restart), got {value!r}")
    if value and num_nodes > 1:
        raise LaunchConfigError(
            "max_restarts works on one machine only for now: with num_nodes > 1 the nodes could not agree on "
            "when to restart. Pass max_restarts=0, or resume from a checkpoint with a new launch."
        )
    return value


def check_elastic_arguments(request: Any) -> None:
    """Accelerate's elastic-launch arguments (``notebook_launcher``'s, by position too): those
    that mean something here are checked; those that would need torchelastic's dynamic
    rendezvous, which nblaunch does not use (it knows every rank up front), are refused."""
    r = request
    if (isinstance(r.monitor_interval, bool) or not isinstance(r.monitor_interval, (int, float))
            or not math.isfinite(r.monitor_interval) or r.monitor_interval <= 0):
        raise LaunchConfigError(f"monitor_interval must be a positive number of seconds, got {r.monitor_interval!r}")
    if r.rdzv_backend not in ("static", "c10d"):
        raise LaunchConfigError(
            f"rdzv_backend must be 'static' or 'c10d', got {r.rdzv_backend!r}; nblaunch knows every rank up front, "
            "so both mean the same here"
        )
    if not isinstance(r.rdzv_id, str):
        raise LaunchConfigError(f"rdzv_id must be a string (the job's name, TORCHELASTIC_RUN_ID in every rank), "
                                f"got {r.rdzv_id!r}")
    if r.rdzv_conf:
        raise LaunchConfigError(
            f"rdzv_conf={r.rdzv_conf!r} configures torchelastic's dynamic rendezvous, which nblaunch does not use: "
            "every rank is known up front. Leave it out (a timeout for the whole launch is timeout=)."
        )
    if r.log_line_prefix_template is not None:
        raise LaunchConfigError(
            "log_line_prefix_template is not supported: nblaunch tags every line with its rank itself "
            "('[rank 1] ...' in text, a column per rank in the dashboard). Leave it out."
        )


def rendezvous_point(master_addr: Any, use_port: Any, rdzv_endpoint: Any) -> tuple[Any, Any]:
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
    if master_addr not in ("127.0.0.1", host):  # 127.0.0.1: master_addr left at its default
        clashes.append(f"master_addr={master_addr!r}")
    if port and use_port is not None and str(use_port) != port:
        clashes.append(f"use_port={use_port!r}")
    if clashes:
        raise LaunchConfigError(f"rdzv_endpoint={rdzv_endpoint!r} and {' and '.join(clashes)} name different meeting "
                                "points: give one of them")
    return host, (port or use_port)
