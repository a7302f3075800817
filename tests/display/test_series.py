import math

from nblaunch.display.series import Series


def test_memory_stays_bounded_and_spread_over_the_whole_run():
    series = Series(capacity=100)
    for step in range(100_000):
        series.add(step, float(step))
    points = series.points()
    assert 50 <= len(points) <= 101
    assert points[0] == (0, 0.0) and points[-1] == (99_999, 99_999.0)
    gaps = {b[0] - a[0] for a, b in zip(points, points[1:-1])}
    assert len(gaps) == 1  # evenly thinned


def test_non_finite_values_are_remembered_but_not_drawn():
    series = Series()
    series.add(0, 1.0)
    series.add(1, math.nan)
    series.add(2, math.inf)
    assert series.points() == [(0, 1.0)]
    assert series.last[0] == 2 and math.isinf(series.last[1])
    assert series.count == 3
