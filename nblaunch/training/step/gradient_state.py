"""What one ``Accelerator`` knows about gradient accumulation and the DataLoader being iterated:
read by the prepared optimizer, scheduler and ``accumulate``, updated by the prepared loaders.

Example::

    gs = GradientState(num_steps=2)
    gs.sync_gradients   # True on the micro-step whose gradients are all-reduced
"""

from __future__ import annotations

import weakref
from typing import Any

from nblaunch.worker import calls

__all__ = ["GradientState"]


class GradientState:
    """Gradient-accumulation bookkeeping of one Accelerator (not shared between Accelerators).

    ``sync_gradients`` is True on the micro-step where gradients are all-reduced and the optimizer
    really steps; ``end_of_dataloader`` is True while the last batch of a prepared DataLoader is
    being processed; ``active_dataloader`` is the prepared DataLoader being iterated (innermost).
    """

    __slots__ = ("num_steps", "sync_gradients", "step", "_loaders", "sync_with_dataloader", "__weakref__")

    def __init__(self, num_steps: int = 1, sync_with_dataloader: bool = True) -> None:
        self.num_steps = num_steps
        self.sync_gradients = True
        self.step = 0  # micro-steps since the last sync
        self._loaders: list[Any] = []  # prepared DataLoaders being iterated, innermost last
        self.sync_with_dataloader = sync_with_dataloader
        _alive.add(self)

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's reset of its shared gradient state; here each Accelerator has its own."""

    @property
    def active_dataloader(self) -> Any:
        return self._loaders[-1] if self._loaders else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self._loaders)

    @property
    def end_of_dataloader(self) -> bool:
        """True while the last batch of the innermost prepared DataLoader is being used."""
        return self._loaders[-1].end_of_dataloader if self._loaders else False

    def loader_started(self, loader: Any) -> None:
        """A prepared DataLoader begins handing out an epoch's batches (it is the active one)."""
        self._loaders.append(loader)

    def loader_stopped(self, loader: Any) -> None:
        """``loader``'s epoch ended or was abandoned (loaders nest: the innermost goes first)."""
        for i in range(len(self._loaders) - 1, -1, -1):
            if self._loaders[i] is loader:
                del self._loaders[i]
                break

    def __repr__(self) -> str:
        return (f"GradientState(num_steps={self.num_steps}, sync_gradients={self.sync_gradients}, "
                f"end_of_dataloader={self.end_of_dataloader})")


_alive: weakref.WeakSet[GradientState] = weakref.WeakSet()


def forget_loop_state() -> None:
    """Start every live Accelerator's bookkeeping afresh: no micro-steps counted towards the next
    sync, no DataLoader being iterated. A warm rank does this before each call, so a call never
    inherits half an accumulation window or a loop the previous call left."""
    for state in list(_alive):
        state.step = 0
        state.sync_gradients = True
        state._loaders.clear()


calls.before_each_call(forget_loop_state)  # a warm rank's call never inherits an interrupted loop
