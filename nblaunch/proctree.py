"""Finding and stopping every process a rank started, whatever session or group it is in.

A rank's process group covers what it starts plainly (DataLoader workers), not a helper started
with ``start_new_session=True`` or a daemon that called ``setsid()``. Three nets catch those:

* each rank is a *child subreaper*: a daemon that double-forks is re-parented to the rank, not
  to init, so while the rank lives every process it started is below it in the process tree;
* a rank that ends stops everything below it first, and the launcher does the same to a rank it
  stops (``kill_tree``);
* when a launch ends and a rank was killed before it could clean up, any process started since
  the launch began that is marked as the launch's is stopped (``kill_marked``): programs it
  executed carry ``NBLAUNCH_LAUNCH_ID`` in their environment (inherited from the rank), and
  processes it forked without executing anything (their environment block is the kernel's)
  still hold one of the launch's pipes.

What none of these finds: a process that a killed rank forked (no exec) and that then closed
every inherited descriptor; only a cgroup or a PID namespace would hold that one.
Linux only (/proc); elsewhere these find nothing.
"""

from __future__ import annotations

import os
import signal

from nblaunch.contract.variables import LAUNCH_ID

_ROUNDS = 20  # a tree that forks while it is being killed: look again, a bounded number of times


def pids() -> list[int]:
    """Every process id in /proc (empty where there is none)."""
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (of all its threads)."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree."""
    found, todo = [], children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children(child)
    return found


def kill_pids(pids: list[int]) -> None:
    """SIGKILL each of ``pids``; those already gone (or not ours) are skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_descendants(pid: int) -> None:
    """SIGKILL everything below ``pid``; look again for what was forked meanwhile."""
    for _ in range(_ROUNDS):
        below = [p for p in descendants(pid) if not _is_zombie(p)]
        if not below:
            return
        kill_pids(below)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and everything below it."""
    below = descendants(pid)  # before the kill: a dead process's children move away
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
            break
        except (ProcessLookupError, PermissionError):
            continue
    kill_pids(below)


def kill_marked(launch_id: str, pipe_ends: set[tuple[str, str]], since_ticks: int | None) -> list[int]:
    """SIGKILL every process marked as the launch's (see above); return their pids.

    ``since_ticks`` (a start time in clock ticks since boot, as /proc/<pid>/stat field 22) skips
    older processes without reading anything else: only processes of the launch can be marked.
    ``pipe_ends`` are ("pipe:[inode]" or "socket:[inode]", "w" or "r") of the *ranks'* ends: a
    fork of the launcher's process (the user's DataLoader worker) may hold the launcher's ends of
    the same pipes, never these.
    """
    marker = f"{LAUNCH_ID}={launch_id}".encode()
    pipes = dict(pipe_ends)
    me = os.getpid()
    found = []
    for pid in pids():
        if pid == me:
            continue
        if since_ticks is not None:
            started = start_ticks(pid)
            if started is None or started < since_ticks:
                continue
        if _has_marker(pid, marker) or _holds_any(pid, pipes):
            found.append(pid)
    kill_pids(found)
    return found


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False  # gone, or another user's


def _holds_any(pid: int, pipes: dict[str, str]) -> bool:
    if not pipes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            mode = pipes.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            if mode is not None and _access_mode(pid, fd) == mode:
                return True
        except OSError:
            continue
    return False


def _access_mode(pid: int, fd: str) -> str:
    """"r" or "w": how ``pid`` opened its descriptor ``fd`` (from /proc/<pid>/fdinfo)."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("flags:"):
                return "w" if int(line.split()[1], 8) & 0o3 == os.O_WRONLY else "r"
    return "?"


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat from field 3 (state) on, split; None if the process is gone. The name
    (field 2) is skipped: it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 of stat(5)
    except (IndexError, ValueError):
        return None


_PF_EXITING = 0x4  # the flags of stat(5): the process has begun to exit
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def running(pid: int) -> bool:
    """Whether ``pid`` runs now: not gone, not a zombie, not exiting, no SIGKILL pending (a big
    process takes milliseconds to die, and its children get their death signal only then)."""
    fields = stat_fields(pid)
    if not fields or fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
        return False
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            pending = [int(line.split()[1], 16) for line in status if line.startswith((b"SigPnd:", b"ShdPnd:"))]
    except OSError:
        return False
    return not any(p & _SIGKILL_BIT for p in pending)


def _is_zombie(pid: int) -> bool:
    fields = stat_fields(pid)
    return not fields or fields[0] == b"Z"
