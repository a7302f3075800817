"""Whether the out-of-memory killer struck during a launch, as the machine counts it.

A rank killed by SIGKILL was killed by the kernel's out-of-memory killer only if the kernel says
so: this machine's count of its kills (``oom_kill`` in ``/proc/vmstat``) or the count of the
launcher's memory cgroup (v2 ``memory.events``, v1 ``memory.oom_control``: a container's limit)
rose since the launch began. Otherwise something else sent the signal: the user's code, another
process, a scheduler. Read once when the launch starts and once per SIGKILL: a few files.

Example::

    kills = OomKills()          # as the launch starts
    ...
    kills.rose()                # True, False, or None where nothing can be read
"""

from __future__ import annotations

import os

_VMSTAT = "/proc/vmstat"
_CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


class OomKills:
    """The out-of-memory kill counts when it was made (see the module)."""

    def __init__(self) -> None:
        self._files = _counter_files()
        self._before = {path: _count(path) for path in self._files}

    def rose(self) -> bool | None:
        """Whether any count rose since then; None where none could be read."""
        seen = False
        for path, before in self._before.items():
            now = _count(path)
            if before is None or now is None:
                continue
            seen = True
            if now > before:
                return True
        return False if seen else None


def _counter_files() -> list[str]:
    files = [_VMSTAT]
    try:
        with open("/proc/self/cgroup") as lines:
            for line in lines:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":  # cgroup v2: memory.events counts the subtree's kills
                    files += [os.path.join(root, path.lstrip("/"), "memory.events") for root in _CGROUP_ROOTS]
                elif "memory" in controllers.split(","):  # v1: this cgroup's own
                    files.append(os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control"))
    except OSError:
        pass
    return [f for f in files if os.path.exists(f)]


def _count(path: str) -> int | None:
    """The ``oom_kill N`` line's N in ``path``."""
    try:
        with open(path) as lines:
            for line in lines:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None
