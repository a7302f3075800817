"""A metric's points over time, thinned so memory stays bounded however long the run.

When ``capacity`` points are kept, every other point is dropped and from then on only every
second new point is kept (then every fourth, ...). The kept points stay evenly spread over the
whole run, which is what a small chart needs; the very last point is always known.

Example::

    loss = Series(capacity=4)
    for step in range(10):
        loss.add(step, 1 / (step + 1))
    loss.points()  # about 4 points from step 0 to step 9, always ending at step 9
"""

from __future__ import annotations

import math


class Series:
    def __init__(self, capacity: int = 1000) -> None:
        self.capacity = max(2, capacity)
        self.count = 0  # points ever added
        self.last: tuple[float, float] | None = None  # may be NaN / inf: the table shows it
        self._last_finite: tuple[float, float] | None = None
        self._kept: list[tuple[float, float]] = []
        self._stride = 1

    def add(self, x: float, y: float) -> None:
        self.last = (x, y)
        index = self.count
        self.count += 1
        if not math.isfinite(y):
            return
        self._last_finite = (x, y)
        if index % self._stride:
            return
        self._kept.append((x, y))
        if len(self._kept) > self.capacity:
            self._kept = self._kept[::2]
            self._stride *= 2

    def points(self) -> list[tuple[float, float]]:
        """Kept finite points in order, ending with the latest finite point added."""
        tail = self._last_finite
        if tail is not None and (not self._kept or self._kept[-1] != tail):
            return [*self._kept, tail]
        return list(self._kept)
