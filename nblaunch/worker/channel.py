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

from nblaunch import wire

_fd: int | None = None
_rank: int | None = None
_lock = threading.Lock()  # the main thread and the stack-dump thread share the pipe


def open_channel(fd: int, rank: int) -> None:
    """Called once by the bootstrap; the user never needs it."""
    global _fd, _rank
    _fd, _rank = fd, rank


def close_channel() -> None:
    global _fd, _rank
    _fd, _rank = None, None


def in_launch() -> bool:
    """True inside a worker started by nblaunch."""
    return _fd is not None


def launch_rank() -> int | None:
    """The local rank of this worker, or None outside a launch."""
    return _rank


def send(kind: bytes, body: bytes) -> bool:
    """Send one frame to the launcher; False (nothing sent) outside a launch."""
    if _fd is None:
        return False
    with _lock:
        wire.write_frame(_fd, kind, body)
    return True


def log_metrics(values: dict[str, float], step: int | None = None) -> bool:
    """Send scalar metrics to the launching cell. Tensors are turned into Python numbers."""
    if _fd is None:
        return False
    plain = {str(k): _to_number(v) for k, v in values.items()}
    return send(wire.METRICS, pickle.dumps((plain, step)))


def report_progress(
    bar_id: int, n: float, total: float | None, desc: str = "", closed: bool = False
) -> bool:
    """Report the position of a progress bar; the launcher draws it."""
    if _fd is None:
        return False
    return send(wire.PROGRESS, pickle.dumps((bar_id, n, total, desc, closed)))


def _to_number(value):
    item = getattr(value, "item", None)  # torch / numpy scalars, without importing either
    if callable(item):
        value = item()
    if isinstance(value, (int, float, bool)):
        return value
    raise TypeError(f"metric values must be numbers or 1-element tensors, got {type(value).__name__}")
