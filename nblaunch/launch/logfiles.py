"""Every rank's whole log on disk, while displays keep only the recent part in memory."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from nblaunch.events import Event, LaunchFinished, Output, RankFinished, RankState, Stacks

_KEEP_LAUNCHES = 20  # log folders of the latest launches are kept...
_PRUNE_AT = 40  # ...and older ones removed in batches, not one at every launch


def new_log_dir() -> str:
    root = os.path.join(tempfile.gettempdir(), f"nblaunch-{os.getuid()}", "logs")
    os.makedirs(root, mode=0o700, exist_ok=True)
    old = sorted(os.listdir(root))
    if len(old) >= _PRUNE_AT:
        for name in old[: len(old) - _KEEP_LAUNCHES + 1]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root)


class LogFiles:
    """A sink of launch events that writes ``rank{r}.log`` per rank into ``directory``."""

    def __init__(self, directory: str, num_ranks: int):
        self.directory = directory
        self._files = {
            r: open(os.path.join(directory, f"rank{r}.log"), "w", encoding="utf-8") for r in range(num_ranks)
        }

    def path(self, rank: int) -> str:
        return self._files[rank].name

    def on_event(self, event: Event) -> None:
        if isinstance(event, Output):
            if not event.transient:  # progress-bar redraws would bury the log
                self._files[event.rank].write("\n".join(event.lines) + "\n")
        elif isinstance(event, Stacks):
            self._files[event.rank].write(f"--- stack when the launch stopped ---\n{event.text}\n")
        elif isinstance(event, RankFinished) and event.state == RankState.FAILED:
            self._files[event.rank].write(f"--- rank {event.rank} failed ---\n{event.detail}\n")
        elif isinstance(event, LaunchFinished):
            self.close()

    def flush(self) -> None:
        for f in self._files.values():
            if not f.closed:
                f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
