"""``SavedByStrategy``: which prepared models and optimizers a strategy put in a checkpoint itself.

Example::

    written = SavedByStrategy(models={0}, optimizers={0})
    0 in written.models     # the checkpoint writes no plain weights for model 0
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SavedByStrategy"]


@dataclass
class SavedByStrategy:
    """Which prepared models and optimizers (by index) a strategy saved or loaded itself; the
    checkpoint writes the others in Accelerate's plain layout."""

    models: set[int] = field(default_factory=set)
    optimizers: set[int] = field(default_factory=set)
