"""The step split in the cell: each rank's step as a stacked bar with its numbers, the straggler
in the header, the summary at the end (HTML), and the same as lines for the text display.

The bar's width is the rank's typical step against the slowest rank's, so a rank that waits shows
the same length as the one it waits for, its colours saying where the time went.

Example::

    cell = split_cell(report[1], widest=report_widest(report))   # one row's <td> content
    html = finding_html(report)                                   # "rank 1 holds the others up: ..."
"""

from __future__ import annotations

from html import escape

from nblaunch.step_split import LaunchSteps, RankSteps
from nblaunch.step_split.launch_steps import ms, rank_line

PART_COLOURS = {"data": "#e67e22", "compute": "#2ca02c", "communication": "#d62728", "optimizer": "#9467bd",
                "other": "#9e9e9e"}
BAR_PX = 120  # as wide as a progress bar's track, which it sits under


def widest(report: LaunchSteps) -> float:
    """The slowest rank's typical step: the full width of every rank's bar."""
    return max((r.step for r in report), default=0.0)


def split_cell(steps: RankSteps | None, full: float) -> str:
    """A rank's step: the stacked bar, the step's length and its biggest part (every part in the
    tooltip), laid out as a progress bar is (``render._bar``), so it sits under the rank's bars."""
    if steps is None or full <= 0:
        return ""
    segments = "".join(
        f'<span class="nbl-part" data-part="{name}" style="display: inline-block; height: 9px; '
        f'width: {max(0.0, value) / full * BAR_PX:.1f}px; background: {PART_COLOURS[name]}"></span>'
        for name, value in steps.parts().items())
    largest = max(steps.parts(), key=lambda p: steps.parts()[p])
    tip = escape(rank_line(steps))
    return (f'<div class="nbl-split" data-step="{steps.step:.6f}" title="{tip}" style="white-space: nowrap; '
            f'margin: 1px 0"><span style="display: inline-block; width: {BAR_PX}px; height: 9px; overflow: hidden; '
            f'margin-right: 8px; vertical-align: middle; line-height: 9px">{segments}</span>'
            f'<span style="vertical-align: middle">step {ms(steps.step)} · '
            f'<span style="color: {PART_COLOURS[largest]}">{largest} {ms(steps.parts()[largest])}</span></span></div>')


def legend_html() -> str:
    return " ".join(f'<span style="color: {colour}">■</span> {name}' for name, colour in PART_COLOURS.items())


def finding_html(report: LaunchSteps) -> str:
    """The straggler or the biggest cost, in the header's words ("" when nothing stands out)."""
    if not report.finding:
        return ""
    return f'<div class="nbl-finding" style="color: #b45309">⚠ {escape(report.finding)}</div>'


def summary_html(report: LaunchSteps | None) -> str:
    """The end of a launch: what the ranks buy, the finding, what to do, the notes."""
    if report is None:
        return ""
    lines = [report.buys] if report.ranks else []
    lines += [report.finding] if report.finding else []
    lines += [f"→ {report.advice}"] if report.advice else []
    lines += list(report.notes)
    body = "".join(f"<div>{escape(line)}</div>" for line in lines if line)
    legend = f'<div style="opacity: 0.7">{legend_html()}</div>' if report.ranks else ""
    return (f'<div class="nbl-steps" data-straggler="{"" if report.straggler is None else report.straggler}" '
            f'data-cause="{report.cause or ""}" style="margin: 4px 0">{body}{legend}</div>')


def live_lines(report: LaunchSteps) -> list[str]:
    """For the text display, every so often: each rank's split now, and the finding."""
    lines = [f"[rank {r.rank}] steps: {rank_line(r)}" for r in report]
    if report.finding:
        lines.append(f"nblaunch: {report.finding}")
    return lines
