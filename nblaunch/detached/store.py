"""Where detached launches live on disk: one private folder per launch, in a folder only its user
can open (mode 0700, checked), so only that user can list, attach, cancel or read a launch.

Layout of ``<state>/detached/<launch id>/`` (``<state>`` is ``$NBLAUNCH_STATE_DIR``, else
``$XDG_STATE_HOME/nblaunch``, else ``~/.local/state/nblaunch``)::

    request.pkl      what to run: the job, with the launch's request (cloudpickle; see jobs)
    where.json       the kernel's folder and sys.path, to read request.pkl as the kernel would
    state.json       id, function, started, ranks, log folder, the supervisor's pid and start time
    journal/         every event of the launch, as it happened (nblaunch.detached.journal)
    outcome.pkl      the results, or the error, once the launch has ended
    collected        written when a kernel has had the outcome from result()
    supervisor.log   the supervisor process's own output (where to look if it died)

Example::

    for folder in launch_folders():
        print(read_state(folder)["function"])
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import warnings
from typing import Any

import cloudpickle

from nblaunch import proctree
from nblaunch.contract.variables import STATE_DIR

__all__ = ["finish", "supervisor_alive", "state_root", "detached_root", "launch_folders", "new_launch_folder", "read_state",
           "read_job", "write_state",
           "write_atomically", "prune", "NotYoursError", "RETENTION_S", "COLLECTED_RETENTION_S"]

# An outcome nobody collected is kept a week; one a kernel collected, a day (documented in docs/usage.md).
RETENTION_S = 7 * 24 * 3600
COLLECTED_RETENTION_S = 24 * 3600


class NotYoursError(PermissionError):
    """A launch folder (or the folder of them) that is not this user's own, or others can read."""


def state_root() -> str:
    """nblaunch's state folder for this user."""
    explicit = os.environ.get(STATE_DIR)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "nblaunch")


def detached_root() -> str:
    """The folder of this user's detached launches, made private if new; refused if it is not."""
    root = os.path.join(state_root(), "detached")
    os.makedirs(root, mode=0o700, exist_ok=True)
    _check_private(root)
    return root


def _check_private(path: str) -> None:
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise NotYoursError(f"{path} belongs to another user: launches there are not yours to see or attach")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise NotYoursError(f"{path} can be read by other users: run `chmod 700 {path}` (nblaunch keeps "
                            "launches, their code and results there)")


def new_launch_folder(launch_id: str) -> str:
    folder = os.path.join(detached_root(), launch_id)
    os.mkdir(folder, mode=0o700)
    os.mkdir(os.path.join(folder, "journal"), mode=0o700)
    return folder


def launch_folders(kind: str | None = None) -> list[str]:
    """This user's launch folders, oldest first (by when they were started); only those of
    ``kind`` ("launch" or "pool", detached warm ranks) if given."""
    root = detached_root()
    states = {}
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        try:
            states[folder] = read_state(folder)
        except FileNotFoundError:
            continue  # being made, or removed by another kernel's prune
        except (OSError, ValueError) as error:  # one bad folder must not hide the others
            warnings.warn(f"skipping {folder}: {error} (remove it if it is not a launch of yours)", stacklevel=2)
    folders = [folder for folder, state in states.items() if kind is None or state.get("kind") == kind]
    return sorted(folders, key=lambda folder: states[folder].get("started", 0.0))


def supervisor_alive(state: dict[str, Any]) -> bool:
    """Whether the supervisor ``state`` names still runs (its pid with the same start time, not
    a zombie nobody reaped); a supervisor still starting counts as alive for 30 s."""
    pid = state.get("supervisor_pid")
    if pid is None:
        return time.time() - state.get("started", 0) < 30
    fields = proctree.stat_fields(pid)
    return bool(fields) and fields[0] != b"Z" and proctree.start_ticks(pid) == state.get("supervisor_start")


def read_state(folder: str) -> dict[str, Any]:
    _check_private(folder)
    with open(os.path.join(folder, "state.json"), encoding="utf-8") as file:
        return json.load(file)


def read_job(folder: str) -> Any:
    """The job the kernel left in ``folder`` (it imports what the job names: read it where the
    kernel's modules import, as the daemon does)."""
    _check_private(folder)
    with open(os.path.join(folder, "request.pkl"), "rb") as file:
        return cloudpickle.loads(file.read())


def write_state(folder: str, **changes: Any) -> dict[str, Any]:
    """Update ``state.json`` (written whole, then renamed: a reader never sees half of it)."""
    path = os.path.join(folder, "state.json")
    state: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            state = json.load(file)
    state.update(changes)
    write_atomically(path, json.dumps(state, indent=1).encode())
    return state


def write_atomically(path: str, data: bytes) -> None:
    partial = f"{path}.{os.getpid()}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def prune(now: float | None = None) -> list[str]:
    """Remove finished launches past their retention (their rank logs stay where they are).
    Returns the ids removed."""
    now = time.time() if now is None else now
    removed = []
    for folder in launch_folders():
        try:
            state = read_state(folder)
        except (OSError, ValueError):
            continue  # removed meanwhile, or unreadable (launch_folders said so)
        ended = state.get("ended")
        if ended is None and not supervisor_alive(state):  # lost: ended when its state last changed
            ended = os.path.getmtime(os.path.join(folder, "state.json"))
        if ended is None:
            continue
        collected = os.path.exists(os.path.join(folder, "collected"))
        if now - ended > (COLLECTED_RETENTION_S if collected else RETENTION_S):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(state["id"])
    return removed


def finish(folder: str, status: str, outcome: tuple) -> None:
    """Keep a job's ``outcome`` (``("ok", results)`` or ``("error", exception)``) for ``result()``,
    then mark it ended."""
    try:
        data = cloudpickle.dumps(outcome)
    except Exception as error:  # results that cannot be pickled: say so instead of losing the end
        data = cloudpickle.dumps(("error", RuntimeError(f"the job ended ({status}) but its outcome could not "
                                                        f"be kept: {error!r}")))
    write_atomically(os.path.join(folder, "outcome.pkl"), data)
    write_state(folder, status=status, ended=time.time())
