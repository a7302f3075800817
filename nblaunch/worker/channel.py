"""The worker's line back to the launching cell, for metrics and progress.

Inside a launch, the bootstrap opens the channel before the user's function runs; outside one
(a plain script, the notebook itself) every call here is a cheap no-op that returns False, so
training code can log unconditionally.

Example (inside a function started by ``notebook_launcher``)::

    from nblaunch.worker import channel
    channel.log_metrics({"loss": 0.25}, step=10)
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import cloudpickle

from nblaunch import wire

_lock = threading.Lock()  # every thread of the rank (and the stack-dump thread) writes through it


class _Endpoint(threading.local):
    """Where this thread's frames go. A process-wide default, overridden per thread on XLA,
    where one process runs several ranks, one thread each."""

    fd: int | None = None


_process_fd: int | None = None
_thread = _Endpoint()


def open_channel(fd: int, *, this_thread_only: bool = False) -> None:
    """Called by the bootstrap before the user's function runs; the user never needs it."""
    global _process_fd
    if this_thread_only:
        _thread.fd = fd
    else:
        _process_fd = fd


def close_channel() -> None:
    global _process_fd
    _process_fd = None
    _thread.fd = None


def _endpoint() -> int | None:
    return _thread.fd if _thread.fd is not None else _process_fd


def in_launch() -> bool:
    """True inside a worker started by nblaunch."""
    return _endpoint() is not None


def send(kind: bytes, body: bytes, fd: int | None = None) -> bool:
    """Send one frame to the launcher (to ``fd`` if given); False outside a launch."""
    fd = _endpoint() if fd is None else fd
    if fd is None:
        return False
    with _lock:
        wire.write_frame(fd, kind, body)
    return True


def pickle_value(value: Any) -> bytes:
    """A value sent back to the launcher: plain pickle, or cloudpickle for classes and lambdas
    defined in a notebook (which need pickling by value). Raises what cloudpickle raises."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def log_metrics(values: dict[str, float], step: int | None = None) -> bool:
    """Send scalar metrics to the launching cell. Tensors are turned into Python numbers."""
    if not in_launch():
        return False
    plain = {str(k): _to_number(v) for k, v in values.items()}
    return send(wire.METRICS, pickle.dumps((plain, step)))


def report_device(device: str, precision: str) -> bool:
    """Tell the launcher what this rank computes on (its row shows it): ``("cuda:0", "bf16")``."""
    return send(wire.DEVICE, pickle.dumps((device, precision)))


def report_progress(
    bar_id: int, n: float, total: float | None, desc: str = "", closed: bool = False, auto: bool = False
) -> bool:
    """Report the position of a progress bar; the launcher draws it. ``auto``: a bar nblaunch
    draws by itself (a prepared DataLoader's), which gives way to the user's own bars."""
    if not in_launch():
        return False
    return send(wire.PROGRESS, pickle.dumps((bar_id, n, total, desc, closed, auto)))


def _to_number(value):
    item = getattr(value, "item", None)  # torch / numpy scalars, without importing either
    if callable(item):
        value = item()
    if isinstance(value, (int, float, bool)):
        return value
    raise TypeError(f"metric values must be numbers or 1-element tensors, got {type(value).__name__}")
