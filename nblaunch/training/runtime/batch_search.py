"""``find_executable_batch_size`` across the ranks of a launch: every rank tries the same batch
size, and an out-of-memory error on any of them makes them all retry the next smaller one together.

Each rank on its own (Accelerate's way) would hang or split: the rank that ran out of memory
retries while the others wait for it in the all-reduce of the larger batch. Here the rank that ran
out first lets go of the process group (``nblaunch.worker.warm.group``: its connections shut, so a
peer waiting on it in a collective raises at once instead of waiting for ever); then every rank,
its attempt over one way or another, votes through the rendezvous store (ok, out of memory, or
lost: a peer let go). Any out-of-memory vote means every rank re-forms the group and retries with
the next size; otherwise each rank returns its result or raises its own error. A rank whose
attempt raised another error votes "error" without waiting and raises at once, the group kept, as
without the search: its report then reaches the launcher before its peers lose it. Rank 0 says the
sizes in the cell.

Example (what the decorator does on each rank)::

    search = BatchSearch.here()          # None outside a launch of several ranks
    verdicts = search.vote(attempt, "oom")
"""

from __future__ import annotations

import datetime
import itertools
import sys

__all__ = ["BatchSearch"]

_VOTE_TIMEOUT = datetime.timedelta(minutes=30)  # a rank may train a whole attempt before it votes
_searches = itertools.count()


class BatchSearch:
    """One decorated call's votes among the ranks."""

    def __init__(self, store: object, rank: int, world_size: int, search: int) -> None:
        self._store = store
        self.rank = rank
        self._world_size = world_size
        self._search = search
        self.tried: list[int] = []

    @classmethod
    def here(cls) -> "BatchSearch | None":
        """The search among this launch's ranks; None in a single process (Accelerate's way then)."""
        import torch.distributed as dist

        from nblaunch.training.runtime.state import PartialState

        if not dist.is_available():
            return None
        if not dist.is_initialized():
            PartialState()  # a launch of several ranks joins its group from the environment here
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank(), dist.get_world_size(), next(_searches))

    def ran_out(self) -> None:
        """This rank's attempt ran out of memory (or lost a peer that did): let go of the group, so
        peers waiting on it in a collective raise now and vote."""
        from nblaunch.worker.warm import group

        group.adopt_group()
        group.release_group()

    def vote(self, attempt: int, outcome: str) -> dict[int, str]:
        """Every rank's outcome of ``attempt`` ("ok", "oom", "lost" or "error"), once all voted."""
        keys = self._keys(attempt)
        self._store.set(keys[self.rank], outcome)
        self._store.wait(keys, _VOTE_TIMEOUT)
        return {r: self._store.get(key).decode() for r, key in enumerate(keys)}

    def leave(self, attempt: int) -> None:
        """This rank raises its own error: its vote says so, and it waits for no one."""
        self._store.set(self._keys(attempt)[self.rank], "error")

    def _keys(self, attempt: int) -> list[str]:
        prefix = f"nblaunch/batch/{self._search}/{attempt}/"
        return [f"{prefix}{r}" for r in range(self._world_size)]

    def retry_together(self, attempt: int) -> None:
        """Every rank, after an out-of-memory vote: a fresh group for the next attempt."""
        from nblaunch.worker.warm import group

        group.adopt_group()
        group.release_group()
        if group.reforms_left() == 0:
            tried = ", ".join(map(str, self.tried))
            raise RuntimeError(
                f"find_executable_batch_size ran out of memory at every size it tried ({tried}) and cannot try "
                f"another: a launch's process group can be re-formed {group.REFORMS} times. Start lower, at "
                f"starting_batch_size={self.tried[-1] // 2} or below")
        group.reform_group(f"batch-{self._search}-{attempt}")

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(f"nblaunch: find_executable_batch_size: {line}", file=sys.stderr, flush=True)
