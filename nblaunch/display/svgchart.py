"""Small line charts as inline SVG text.

An SVG polyline inside an HTML widget needs no plotting library, no JavaScript and no extra
widget model, renders the same in every frontend (and in a saved notebook on GitHub), and costs
a few kilobytes per update. Colours of axes and text follow the page (``currentColor``), so
light and dark themes both work.

Example::

    svg = line_chart("loss", [("rank 0", "#1f77b4", [(0, 2.3), (10, 1.1), (20, 0.7)])])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

Point = tuple[float, float]

WIDTH, HEIGHT = 340, 190
_RIGHT, _TOP, _BOTTOM = 10, 24, 22  # room for the title above and the step labels below
_CHAR_W = 6.2  # width of a digit at 11px sans-serif: the left margin is sized to the y labels
LOG_SCALE_SPAN = 100.0  # positive data spanning this factor or more is drawn on a log scale
_TICKS = 4  # about this many labelled values per axis


def format_number(value: float) -> str:
    """Short, readable numbers for ticks and tables: 0.1235, 1.2e-05, 12000."""
    return f"{value:.4g}"


def line_chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[Point]]],
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """One chart: ``series`` is ``[(label, colour, [(x, y), ...]), ...]`` drawn over shared axes.

    The y axis is logarithmic when every value is positive and they span two decades or more
    (a loss falling from 2 to 1e-5 stays readable); the title then says so.
    """
    drawn = [(label, colour, points) for label, colour, points in series if points]
    xs = [x for _, _, points in drawn for x, _ in points]
    ys = [y for _, _, points in drawn for _, y in points]
    log = bool(ys) and min(ys) > 0 and max(ys) / min(ys) >= LOG_SCALE_SPAN
    if drawn:
        x0, x1 = _span(min(xs), max(xs))
        y0, y1 = _span(math.log10(min(ys)), math.log10(max(ys))) if log else _span(min(ys), max(ys))
        y_ticks = _log_ticks(y0, y1) if log else _ticks(y0, y1)
        y_labels = [format_number(10 ** t if log else t) for t in y_ticks]
    else:
        y_labels = []
    left = max(36, round(max((len(label) for label in y_labels), default=0) * _CHAR_W) + 10)
    plot_w, plot_h = width - left - _RIGHT, height - _TOP - _BOTTOM
    parts = [
        f'<svg class="nbl-chart" data-metric="{escape(title)}" data-scale="{"log" if log else "linear"}" '
        f'xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'style="font: 11px sans-serif; overflow: visible">',
        f'<text x="{left}" y="14" fill="currentColor"><tspan font-weight="bold">{escape(title)}</tspan>'
        + ('<tspan fill-opacity="0.6"> (log scale)</tspan>' if log else "") + "</text>",
        f'<rect x="{left}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
        'stroke="currentColor" stroke-opacity="0.3"/>',
    ]
    if len(drawn) > 1:
        legend_x = width - _RIGHT
        for label, colour, _ in reversed(drawn):
            parts.append(
                f'<text x="{legend_x}" y="14" fill="{colour}" text-anchor="end">{escape(label)}</text>'
            )
            legend_x -= 7 * len(label) + 10
    if not drawn:
        parts.append("</svg>")
        return "".join(parts)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        value = math.log10(y) if log else y
        return _TOP + (y1 - value) / (y1 - y0) * plot_h

    bottom = _TOP + plot_h
    for tick, label in zip(y_ticks, y_labels):
        y = _TOP + (y1 - tick) / (y1 - y0) * plot_h
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="currentColor" stroke-opacity="0.1"/>')
        parts.append(_label(left - 4, y + 4, label, "end"))
    for tick in _ticks(x0, x1):
        parts.append(_label(sx(tick), bottom + 14, format_number(tick), "middle"))
    for label, colour, points in drawn:
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
        parts.append(
            f'<polyline class="nbl-line" data-series="{escape(label)}" data-points="{len(points)}" '
            f'points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5" '
            'stroke-linejoin="round"/>'
        )
        if len(points) == 1:  # a polyline of one point draws nothing
            x, y = points[0]
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _span(low: float, high: float) -> tuple[float, float]:
    """An axis range that is never empty, with a little air around flat data."""
    if high > low:
        return low, high
    pad = abs(low) * 0.1 or 1.0
    return low - pad, high + pad


def _ticks(low: float, high: float) -> list[float]:
    """Round values between ``low`` and ``high``, about _TICKS of them: steps of 1, 2 or 5 × 10^k."""
    raw = (high - low) / _TICKS
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9)
    ticks = [(first + i) * step for i in range(int((high - low) / step + 1e-9) + 2)]
    # Rounded to the step's own precision: 0.30000000000000004 is 0.3.
    digits = max(0, -math.floor(math.log10(step)) + 1)
    return [round(t, digits) for t in ticks if low - 1e-9 * step <= t <= high + 1e-9 * step]


def _log_ticks(low: float, high: float) -> list[float]:
    """Whole powers of ten (as exponents) between ``low`` and ``high``, thinned to about _TICKS + 1."""
    exponents = list(range(math.floor(high), math.ceil(low) - 1, -1))  # from the top: 1 is kept
    stride = max(1, math.ceil(len(exponents) / (_TICKS + 1)))
    return sorted(float(e) for e in exponents[::stride]) or [low, high]


def _label(x: float, y: float, text: str, anchor: str) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" fill="currentColor" fill-opacity="0.7" '
        f'text-anchor="{anchor}">{escape(text)}</text>'
    )
