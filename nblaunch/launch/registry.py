"""A small on-disk registry of running launches, to find ranks an earlier kernel left behind.

Ranks normally die with their launcher (PR_SET_PDEATHSIG), but not everywhere (not on macOS,
not if the launching thread outlived the kernel's death in odd ways, not the processes a rank
started in a session of their own: those are found by the launch's tag, see nblaunch.proctree). Each launch writes one JSON file naming its launcher and
its ranks, with their start times so a reused pid is never mistaken for a rank. A new launch
stops the ranks of any launch whose launcher is gone, and says so.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import tempfile
from dataclasses import dataclass, field

from nblaunch import proctree


def registry_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"nblaunch-{os.getuid()}", "launches")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def _start_time_of(pid: int) -> int | None:
    return proctree.start_ticks(pid)


def _own_start_time() -> int | None:
    return _start_time_of(os.getpid())  # keyed by pid: a forked child has its own


def _alive(pid: int, start_time: int | None) -> bool:
    return start_time is not None and proctree.start_ticks(pid) == start_time


@dataclass
class LaunchRecord:
    """One running launch, as written to disk."""

    launch_id: str
    launcher_pid: int
    port: int
    ranks: list[tuple[int, int | None]]  # (pid, start time) of each rank
    log_dir: str = ""  # never pruned while this record exists
    pipes: list[tuple[str, str]] = field(default_factory=list)  # the ranks' pipe ends (see nblaunch.proctree)

    @property
    def path(self) -> str:
        return os.path.join(registry_dir(), f"{self.launch_id}.json")

    def save(self) -> None:
        record = {
            "launcher": [self.launcher_pid, _own_start_time() if self.launcher_pid == os.getpid() else proctree.start_ticks(self.launcher_pid)],
            "port": self.port,
            "ranks": self.ranks,
            "log_dir": self.log_dir,
            "pipes": self.pipes,
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as out:
            json.dump(record, out)
        os.replace(tmp, self.path)  # never a half-written record

    def kill_marked(self) -> list[int]:
        """Stop what the launch's ranks left behind, found by its marks (see nblaunch.proctree).
        Pipe and socket inodes are reused over time: matched only among processes born since the launch."""
        since = min((start for _, start in self.ranks if start), default=None)
        pipes = {(str(link), str(mode)) for link, mode in self.pipes} if since is not None else set()
        return proctree.kill_marked(self.launch_id, pipes, since)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def live_log_dirs() -> set[str]:
    """The log folders of every launch with a record: running, or not yet swept."""
    found = set()
    directory = registry_dir()
    for name in os.listdir(directory):
        if name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    found.add(json.load(f).get("log_dir") or "")
            except (OSError, ValueError, AttributeError):
                continue  # being written or removed: its folder is young, which spares it too
    found.discard("")
    return found


def _group_members(pgid: int) -> list[int]:
    """Pids of live processes in process group ``pgid`` (Linux /proc; empty elsewhere)."""
    members = []
    for pid in proctree.pids():
        fields = proctree.stat_fields(pid)
        if fields and int(fields[2]) == pgid and fields[0] != b"Z":  # fields[2] is field 5 (pgrp)
            members.append(pid)
    return members


def _stale_processes(pid: int, start_time: int | None) -> list[int]:
    """The rank ``pid`` and whatever it started in its process group, if any still live.

    A rank leads its own process group. If the rank itself is dead but its group lives on (a
    server it started), the group id cannot have been reused: Linux keeps a pid reserved while
    a group of that id exists. If a *different* process now has the rank's pid (its start time
    differs), the group is someone else's: leave it alone.
    """
    now = proctree.start_ticks(pid)
    if now is not None and now != start_time:
        return []
    return _group_members(pid) or ([pid] if now is not None else [])


def stop_stale_ranks() -> list[str]:
    """Kill ranks (and what they started) whose launcher is gone; one message per launch."""
    messages = []
    directory = registry_dir()
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                record = json.load(f)
            launcher_pid, launcher_start = record["launcher"]
            stale = LaunchRecord(
                launch_id=name[: -len(".json")], launcher_pid=launcher_pid, port=record["port"],
                ranks=[(int(pid), int(start) if start else None) for pid, start in record["ranks"]],
                pipes=[(str(link), str(mode)) for link, mode in record.get("pipes") or []],
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
        if _alive(launcher_pid, launcher_start):
            continue  # a live launch of another kernel: not ours to touch
        stopped = []
        for pid, start in stale.ranks:
            left = _stale_processes(pid, start)
            if left:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proctree.kill_pids(left)
                stopped += left
        stopped += [pid for pid in stale.kill_marked() if pid not in stopped]
        if stopped:
            messages.append(
                f"stopped {len(stopped)} stale process(es) (pids {', '.join(map(str, sorted(stopped)))}) left by "
                f"an earlier launch of process {launcher_pid} that no longer exists (port {stale.port})"
            )
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return messages
