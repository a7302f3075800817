"""Reading the dashboard's HTML in tests: its elements carry nbl-* classes and data-* attributes."""

from __future__ import annotations

import html
import re


def rank_states(markup: str) -> dict[int, str]:
    """{rank: state} from the rows of a rank table."""
    return {int(r): s for r, s in re.findall(r'<tr class="nbl-rank" data-rank="(\d+)" data-state="(\w+)"', markup)}


def bars(markup: str) -> list[tuple[float, float | None]]:
    """(n, total) of every progress bar drawn."""
    found = re.findall(r'class="nbl-bar" data-bar="\d+" data-n="([^"]*)" data-total="([^"]*)"', markup)
    return [(float(n), float(t) if t else None) for n, t in found]


def chart_points(markup: str, metric: str) -> dict[str, int]:
    """{series label: number of points} of the chart of ``metric``."""
    chart = re.search(rf'<svg class="nbl-chart" data-metric="{re.escape(html.escape(metric))}".*?</svg>', markup)
    if chart is None:
        return {}
    return {
        label: int(n) for label, n in re.findall(r'data-series="([^"]*)" data-points="(\d+)"', chart.group(0))
    }


def text(markup: str) -> str:
    """The visible text, tags removed and entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))
