"""Small line charts as inline SVG text.

An SVG polyline inside an HTML widget needs no plotting library, no JavaScript and no extra
widget model, renders the same in every frontend (and in a saved notebook on GitHub), and costs
a few kilobytes per update. Colours of axes and text follow the page (``currentColor``), so
light and dark themes both work.

Example::

    svg = line_chart("loss", [("rank 0", "#1f77b4", [(0, 2.3), (10, 1.1), (20, 0.7)])])
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

Point = tuple[float, float]

WIDTH, HEIGHT = 340, 190
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 10, 24, 22  # room for tick labels and the title


def format_number(value: float) -> str:
    """Short, readable numbers for ticks and tables: 0.1235, 1.2e-05, 12000."""
    return f"{value:.4g}"


def line_chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[Point]]],
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """One chart: ``series`` is ``[(label, colour, [(x, y), ...]), ...]`` drawn over shared axes."""
    drawn = [(label, colour, points) for label, colour, points in series if points]
    xs = [x for _, _, points in drawn for x, _ in points]
    ys = [y for _, _, points in drawn for _, y in points]
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    parts = [
        f'<svg class="nbl-chart" data-metric="{escape(title)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'style="font: 11px sans-serif; overflow: visible">',
        f'<text x="{_LEFT}" y="14" fill="currentColor" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
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

    x0, x1 = _span(min(xs), max(xs))
    y0, y1 = _span(min(ys), max(ys))

    def sx(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return _TOP + (y1 - y) / (y1 - y0) * plot_h

    bottom = _TOP + plot_h
    parts += [
        _label(_LEFT - 4, _TOP + 4, format_number(y1), "end"),
        _label(_LEFT - 4, bottom, format_number(y0), "end"),
        _label(_LEFT, bottom + 14, format_number(x0), "start"),
        _label(_LEFT + plot_w, bottom + 14, format_number(x1), "end"),
    ]
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


def _label(x: float, y: float, text: str, anchor: str) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" fill="currentColor" fill-opacity="0.7" '
        f'text-anchor="{anchor}">{escape(text)}</text>'
    )
