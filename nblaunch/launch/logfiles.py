"""Every rank's whole log on disk, while displays keep only the recent part in memory."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from nblaunch.events import (CallFailed, Event, LaunchFinished, LaunchRestarting, Output, RankFinished, RankState, Stacks,
                             Stalled)
from nblaunch.launch import registry

_KEEP_LAUNCHES = 20  # log folders of the latest launches are kept...
_PRUNE_AT = 40  # ...and older ones removed in batches, not one at every launch


_YOUNG_S = 600  # a folder made this recently may belong to a launch not yet recorded
_STAMP = "%Y%m%d-%H%M%S"
_SHARED_KEEP_S = 7 * 24 * 3600  # a shared folder's logs: a week after their last line
_PRUNE_EVERY_S = 60.0  # a loop of launches would list the folder at each one (1 ms at 700 folders;
# a shared one on a network file system, a stat per folder)
_last_pruned: dict[str, float] = {}


def new_log_dir(shared_root: str | None = None) -> str:
    """A new folder for one launch's logs; old folders of finished launches are pruned, at most
    once every ``_PRUNE_EVERY_S`` per folder of logs.

    ``shared_root``: a folder other machines' launches write to as well (a cluster's shared home
    directory), whose running launches this machine cannot see: only folders untouched for
    ``_SHARED_KEEP_S`` are pruned there."""
    root = shared_root or os.path.join(tempfile.gettempdir(), f"nblaunch-{os.getuid()}", "logs")
    os.makedirs(root, mode=0o700, exist_ok=True)
    if time.monotonic() - _last_pruned.get(root, -_PRUNE_EVERY_S) >= _PRUNE_EVERY_S:
        _last_pruned[root] = time.monotonic()
        (_prune_untouched if shared_root else _prune)(root)
    return tempfile.mkdtemp(prefix=time.strftime(_STAMP) + "-", dir=root)


def _prune_untouched(root: str) -> None:
    """Remove the folders of a shared ``root`` untouched for ``_SHARED_KEEP_S``, but for the
    latest ``_KEEP_LAUNCHES``."""
    for name in sorted(os.listdir(root))[:-_KEEP_LAUNCHES]:
        path = os.path.join(root, name)
        try:
            if time.time() - os.path.getmtime(path) > _SHARED_KEEP_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # removed meanwhile by another machine's launch


def _prune(root: str) -> None:
    """Remove the oldest folders of ``root`` once there are ``_PRUNE_AT``, but for the latest
    ``_KEEP_LAUNCHES``, young ones and those of running launches (in any kernel)."""
    old = sorted(os.listdir(root))
    if len(old) >= _PRUNE_AT:
        # Names start with their creation time: no stat per folder on a launch's path.
        cutoff = time.strftime(_STAMP, time.localtime(time.time() - _YOUNG_S))
        candidates = [name for name in old[: len(old) - _KEEP_LAUNCHES + 1] if name[: len(cutoff)] < cutoff]
        live = registry.live_log_dirs() if candidates else set()  # any kernel's running launches
        for name in candidates:
            path = os.path.join(root, name)
            if path not in live:
                shutil.rmtree(path, ignore_errors=True)


class LogFiles:
    """A sink of launch events that writes ``rank{r}.log`` per rank into ``directory``.

    Each event's lines reach the file at once (line buffering: one write per batch of lines), so
    a launcher killed mid-launch (an OOM-killed kernel) leaves every line it had received.
    """

    keeps_logs = True  # for Fanout's message if this sink fails

    def __init__(self, directory: str, num_ranks: int):
        self.directory = directory
        self._files = {
            # backslashreplace: text from a rank may hold lone surrogates (an exception's message)
            r: open(os.path.join(directory, f"rank{r}.log"), "w", encoding="utf-8", errors="backslashreplace",
                    buffering=1)
            for r in range(num_ranks)
        }

    def path(self, rank: int) -> str:
        return self._files[rank].name

    def on_event(self, event: Event) -> None:
        if isinstance(event, Output):
            if not event.transient:  # progress-bar redraws would bury the log
                self._files[event.rank].write("\n".join(event.lines) + "\n")
        elif isinstance(event, Stacks):
            when = {"stop": "when the launch stopped", "asked": "when asked", "quiet": "after a quiet while"}[event.why]
            self._files[event.rank].write(f"--- stack {when} ({time.strftime('%H:%M:%S')}) ---\n{event.text}\n")
        elif isinstance(event, RankFinished) and event.state == RankState.FAILED:
            self._files[event.rank].write(f"--- rank {event.rank} failed ---\n{event.detail}\n")
        elif isinstance(event, CallFailed):  # a warm rank's call raised; the rank serves on
            failure = event.failure
            self._files[event.rank].write(f"--- call {event.call_id} raised ---\n{failure.reason}\n{failure.traceback}")
        elif isinstance(event, (LaunchRestarting, Stalled)):
            line = event.line if isinstance(event, LaunchRestarting) else f"stalled: {event.verdict}"
            for file in self._files.values():
                file.write(f"--- {line} ---\n")
        elif isinstance(event, LaunchFinished):
            self.close()

    def flush(self) -> None:
        for f in self._files.values():
            if not f.closed:
                f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
