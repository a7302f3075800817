"""The static record of a launch, left in the cell once it is over (see render for the parts).

Example::

    html = summary_html(view, now=time.monotonic())
"""

from __future__ import annotations

from html import escape

from nblaunch import frames
from nblaunch.display import step_view
from nblaunch.display.render import (FONT, MONO, STATE_COLOURS, badge, fold, log_lines, metrics_html, plain_text,
                                     pre_block, rank_colour, ranks_html)
from nblaunch.display.view_state import LaunchView
from nblaunch.events import RankState

SUMMARY_LOG_LINES = 40  # log tail per rank in the static summary: enough to see the end, small to save


def summary_html(view: LaunchView, now: float) -> str:
    """The static record of the launch, left in the cell output once it is over.

    Self-contained: header, rank table, results or the error with its traceback, where every
    rank was stopped, metrics, and the last lines of every rank's log (folded).
    """
    finished = view.finished
    state = view.state
    title = escape(view.plan.function_name) if view.plan else "launch"
    parts = [
        f'<div class="nbl-summary" data-state="{state.value}" style="{FONT} border-left: 3px solid '
        f'{STATE_COLOURS[state]}; padding: 4px 10px">',
        f'<div style="font-size: 14px"><b>{title}</b> &nbsp;{badge(state)} &nbsp;'
        f"in {view.elapsed(now):.1f} s</div>",
    ]
    error = finished.error if finished is not None else None
    if finished is not None and finished.summary and finished.root_cause_rank is None:
        parts.append(f'<div class="nbl-summary-text">{pre_block(finished.summary)}</div>')
    if error is not None:
        # The error's headline and what it adds (other ranks, a hint); its traceback is the
        # exception's, shown once, below the cell's outputs.
        where = f" (root cause: rank {finished.root_cause_rank})" if finished.root_cause_rank is not None else ""
        parts.append(
            f'<div class="nbl-error"><b style="color: {STATE_COLOURS[RankState.FAILED]}">'
            f"{escape(type(error).__name__)}{where}</b>{pre_block(str(error))}</div>"
        )
    elif finished is not None and finished.results is not None:
        parts.append(_results(finished.results))
    parts.append(ranks_html(view, now))
    parts.append(step_view.summary_html(finished.steps if finished is not None else None))
    for rank in view.ranks.values():
        if rank.detail and rank.state is RankState.FAILED and not (finished and finished.error):
            parts.append(fold(f"rank {rank.rank}: {rank.detail.strip().splitlines()[-1]}", pre_block(rank.detail), True))
    stacks = [r for r in view.ranks.values() if r.stacks and r.stacks_why == "stop"]
    for rank in stacks:
        # Folded, the place in the label: the whole stack is one click away (and in the log).
        where = frames.where(rank.stacks or "")
        label = f"rank {rank.rank}: where it was stopped" + (f" · {escape(where)}" if where else "")
        parts.append(fold(label, pre_block(rank.stacks or ""), False, escaped=True))
    metrics = metrics_html(view)
    if metrics:
        parts.append(f'<div style="margin-top: 6px">{metrics}</div>')
    for rank in view.ranks.values():
        ring = rank.log
        if not ring.total and not ring.view():
            continue
        shown = min(SUMMARY_LOG_LINES, len(ring.view()))
        label = f"rank {rank.rank} log: last {shown} of {ring.total} lines"
        path = view.log_path(rank.rank)
        if path:
            label += f" · {escape(path)}"
        body = f'<pre style="{MONO} white-space: pre-wrap; margin: 2px 0">' + log_lines(ring, False, SUMMARY_LOG_LINES) + "</pre>"
        parts.append(fold(label, body, False, escaped=True))
    parts.append("</div>")
    return "".join(parts)


def _results(results: list) -> str:
    cell = "padding: 1px 10px; text-align: left; vertical-align: top;"
    rows = "".join(
        f'<tr><td style="{cell} color: {rank_colour(r)}">rank {r}</td>'
        f'<td style="{cell} {MONO}">{plain_text(_short_repr(value))}</td></tr>'
        for r, value in enumerate(results)
    )
    return f'<table class="nbl-results" style="{FONT} border-collapse: collapse; margin: 4px 0">{rows}</table>'


def _short_repr(value: object, limit: int = 300) -> str:
    try:
        text = repr(value)
    except Exception as error:  # a broken __repr__ must not break the summary
        text = f"<unprintable {type(value).__name__}: {error}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"
