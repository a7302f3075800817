"""Helpers for tests that watch processes end."""

from __future__ import annotations

import time

import psutil


def gone(pids: list[int], within: float) -> bool:
    """True once none of ``pids`` is a live process; waits on their exits, ``within`` seconds
    at most (a backstop, not a sleep)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        try:
            psutil.wait_procs([psutil.Process(p) for p in alive], timeout=0.1)
        except psutil.NoSuchProcess:
            pass  # it went between the look and the wait
    return False
