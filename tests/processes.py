"""Helpers for tests that watch processes end."""

from __future__ import annotations

import json
import os
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


def stop_every_launch_in(state_dir: str) -> None:
    """Cancel every detached launch (or pool) a test left in ``state_dir``, and wait for its supervisor."""
    from nblaunch.detached.detached_launch import DetachedLaunch

    root = os.path.join(state_dir, "detached")
    for name in os.listdir(root) if os.path.isdir(root) else ():
        state_file = os.path.join(root, name, "state.json")
        if os.path.exists(state_file):
            pid = json.load(open(state_file)).get("supervisor_pid")
            if DetachedLaunch(os.path.join(root, name)).cancel() and pid:
                psutil.wait_procs([psutil.Process(pid)] if psutil.pid_exists(pid) else [], timeout=30)
