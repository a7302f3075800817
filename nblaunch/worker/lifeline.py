"""Tie a worker's life to its launcher, and name it so people can find it in `ps`.

Linux only where the kernel offers it; elsewhere these are no-ops and the worker's watch
thread (EOF on the control pipe) is the only lifeline.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36

# Every worker's kernel-visible name starts with this; tests and the stale-rank sweep look for it.
PROCESS_NAME_PREFIX = "nblaunch-r"


def _prctl(option: int, arg) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0) == 0


def die_with_parent(expected_parent_pid: int) -> None:
    """Get SIGKILLed when the parent dies, even while blocked in C++ (a collective, a recv).

    SIGKILL, not SIGTERM or SIGINT: a process blocked in gloo/NCCL cannot run a Python handler,
    and those signals would leave it alive. The kernel sends it when the *thread* that forked us
    exits, so the launcher forks from a thread that lives as long as the launch (forked ranks:
    ``nblaunch.launch.processes.forking_thread``, which lives as long as the process).
    The parent may have died between fork and prctl: check, then exit.
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != expected_parent_pid:
        os._exit(1)


def become_subreaper() -> None:
    """Orphans below this rank (a daemon that double-forked) become its children, not init's,
    so the rank can find and stop everything it started (see nblaunch.proctree)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_process_name(label: str) -> None:
    """Name the process `nblaunch-r<label>` (shown by ps/top; 15 characters at most)."""
    name_process(f"{PROCESS_NAME_PREFIX}{label}")


def name_process(name: str) -> None:
    """Name the process ``name`` in ps/top (15 characters at most)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])
