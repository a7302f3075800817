"""HTML for each part of the dashboard, from a :class:`~nblaunch.display.state.LaunchView`.

Plain functions from the view to HTML text, used twice: by the live widget (one HTML widget
per part) and for the static summary left in the cell at the end, which a saved notebook shows
without a widget manager (GitHub, nbviewer). Only inline styles and inline SVG: no scripts, no
stylesheets, nothing a frontend could strip or that could leak into the page. Elements carry
``nbl-*`` classes and ``data-*`` attributes so tests (and curious users) can find them.

Example::

    html = ranks_html(view, now=time.monotonic())
"""

from __future__ import annotations

import re
from html import escape

from nblaunch import frames
from nblaunch.display.logring import LogRing
from nblaunch.display.state import Bar, LaunchView, RankView
from nblaunch.display.svgchart import format_number, line_chart
from nblaunch.events import RankState

RANK_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)
STATE_COLOURS = {
    RankState.STARTING: "#7f7f7f",
    RankState.RUNNING: "#1f77b4",
    RankState.DONE: "#2ca02c",
    RankState.FAILED: "#d62728",
    RankState.STOPPED: "#e67e22",
}
STATE_MARKS = {
    RankState.STARTING: "…", RankState.RUNNING: "▶", RankState.DONE: "✔",
    RankState.FAILED: "✘", RankState.STOPPED: "■",
}
SUMMARY_LOG_LINES = 40  # log tail per rank in the static summary: enough to see the end, small to save

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # colour codes and cursor moves from tools' output
# line-height: widget stylesheets set a tall one for one-line controls, too airy for tables.
_FONT = "font-family: var(--jp-ui-font-family, system-ui, sans-serif); font-size: 13px; line-height: 1.45;"
_MONO = "font-family: var(--jp-code-font-family, monospace); font-size: 12px;"
_MUTED = "opacity: 0.7;"


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def format_duration(seconds: float) -> str:
    """``42 s``, ``3:07``, ``1:02:03``: whole seconds, so a ticking clock changes once a second."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def badge(state: RankState) -> str:
    colour = STATE_COLOURS[state]
    return (
        f'<span class="nbl-state" data-state="{state.value}" style="color: {colour}; '
        f'font-weight: 600; white-space: nowrap">{STATE_MARKS[state]} {state.value}</span>'
    )


# -- header ------------------------------------------------------------------------------------


def header_html(view: LaunchView, now: float) -> str:
    """What was launched, how long it has run, and how it is going."""
    plan = view.plan
    if plan is None:
        return f'<div class="nbl-header" style="{_FONT}">{badge(view.state)} waiting for the launch…</div>'
    ranks = f"{plan.num_processes} process{'es' if plan.num_processes != 1 else ''}"
    if plan.world_size != plan.num_processes:
        ranks += f" (node {plan.node_rank}, world size {plan.world_size})"
    facts = [
        ranks,
        f"devices: {escape(plan.devices)}",
        f"start: {escape(plan.start_method)}"
        + (f' <span style="{_MUTED}">({escape(plan.start_reason)})</span>' if plan.start_reason else ""),
        f"rendezvous: {escape(plan.rendezvous)}",
    ]
    if view.restarted is not None:
        r = view.restarted
        facts.append(f'<span style="color: #b45309">restart {r.restart} of {r.max_restarts} '
                     f'(rank {r.failed_rank} failed)</span>')
    logs = ""
    if plan.log_dir:
        logs = (
            f'<div style="{_MUTED}">full logs: <code class="nbl-logdir">'
            f"{escape(plan.log_dir)}</code></div>"
        )
    return (
        f'<div class="nbl-header" data-state="{view.state.value}" style="{_FONT}">'
        f'<div><b style="font-size: 14px">{escape(plan.function_name)}</b> &nbsp;{badge(view.state)}'
        f' &nbsp;<span class="nbl-elapsed">{format_duration(view.elapsed(now))}</span></div>'
        f'<div style="{_MUTED}">{" · ".join(facts)}</div>{logs}</div>'
    )


# -- ranks ---------------------------------------------------------------------------------


def ranks_html(view: LaunchView, now: float) -> str:
    """One row per rank: state, progress bars, last line (or why it ended), elapsed."""
    rows = "".join(_rank_row(rank, now) for rank in view.ranks.values())
    cell = "padding: 2px 8px; text-align: left; vertical-align: top;"
    head = "".join(
        f'<th style="{cell} font-weight: 600">{name}</th>'
        for name in ("rank", "state", "progress", "last line", "elapsed")
    )
    return (
        f'<table class="nbl-ranks" style="{_FONT} border-collapse: collapse; width: 100%; '
        f'table-layout: auto"><thead><tr style="border-bottom: 1px solid rgba(127,127,127,.4)">'
        f"{head}</tr></thead><tbody>{rows}</tbody></table>"
    )


def _rank_row(rank: RankView, now: float) -> str:
    cell = "padding: 3px 8px; text-align: left; vertical-align: top;"
    if rank.started_t is None:
        elapsed = ""
    else:
        elapsed = format_duration((rank.finished_t if rank.finished_t is not None else now) - rank.started_t)
    bars = "".join(_bar(bar, rank_colour(rank.rank)) for bar in rank.shown_bars())
    if rank.state in (RankState.FAILED, RankState.STOPPED) and rank.detail:
        last = rank.detail.strip().splitlines()[-1]
        last_html = f'<span style="color: {STATE_COLOURS[rank.state]}">{_text(last)}</span>'
    else:
        last_html = _text(rank.last_line)
    return (
        f'<tr class="nbl-rank" data-rank="{rank.rank}" data-state="{rank.state.value}">'
        f'<td style="{cell} color: {rank_colour(rank.rank)}; font-weight: 600">{rank.rank}</td>'
        f'<td style="{cell}">{badge(rank.state)}</td>'
        f'<td style="{cell} min-width: 260px">{bars}</td>'
        f'<td class="nbl-last" style="{cell} {_MONO} max-width: 40em; overflow: hidden; '
        f'text-overflow: ellipsis; white-space: nowrap">{last_html}</td>'
        f'<td style="{cell} white-space: nowrap">{elapsed}</td></tr>'
    )


def _bar(bar: Bar, colour: str) -> str:
    if bar.total:
        fraction = min(max(bar.n / bar.total, 0.0), 1.0)
        count = f"{format_number(bar.n)}/{format_number(bar.total)} ({fraction:.0%})"
    else:  # unknown length: a faint full bar and a count
        fraction = None
        count = format_number(bar.n)
    facts = [escape(bar.desc), count] if bar.desc else [count]
    rate = bar.rate()
    if rate is not None:
        facts.append(_format_rate(rate))
        if fraction is not None and fraction < 1 and not bar.closed:
            facts.append(f"{format_duration((bar.total - bar.n) / rate)} left")
    width = f"{fraction * 100:.1f}%" if fraction is not None else "100%"
    fill_opacity = "1" if fraction is not None else "0.35"
    return (
        f'<div class="nbl-bar" data-bar="{bar.bar_id}" data-n="{bar.n:g}" '
        f'data-total="{"" if bar.total is None else f"{bar.total:g}"}" '
        'style="display: flex; align-items: center; gap: 8px; margin: 1px 0">'
        '<div style="flex: 0 0 140px; height: 9px; border-radius: 3px; overflow: hidden; '
        'background: rgba(127,127,127,.22)">'
        f'<div class="nbl-fill" style="width: {width}; height: 100%; background: {colour}; '
        f'opacity: {fill_opacity}"></div></div>'
        f'<span style="white-space: nowrap">{" · ".join(facts)}</span></div>'
    )


def _format_rate(rate: float) -> str:
    """Like tqdm: ``2.5 s/it`` for slow loops, ``12.3 it/s`` / ``56,870 it/s`` for fast ones."""
    if rate < 1:
        return f"{1 / rate:.3g} s/it"
    return f"{rate:.3g} it/s" if rate < 100 else f"{rate:,.0f} it/s"


# -- logs ----------------------------------------------------------------------------------


def log_html(view: LaunchView, rank: int | None, height_em: int = 22) -> str:
    """The tail of one rank's log (or of all ranks, each line marked), newest at the bottom.

    The scroll box is laid out bottom-up (``column-reverse``), so each redraw shows the newest
    lines without any script.
    """
    ring = view.merged if rank is None else view.ranks[rank].log
    body = _log_lines(ring, merged=rank is None)
    return (
        f'<div class="nbl-log" data-rank="{"all" if rank is None else rank}" style="{_FONT}">'
        f'<div style="max-height: {height_em}em; overflow: auto; display: flex; '
        'flex-direction: column-reverse; border: 1px solid rgba(127,127,127,.3); border-radius: 3px">'
        # flex: none, overflow: visible: some frontends give <pre> its own scrolling, which
        # would shrink it into the box and scroll it from the top.
        f'<pre style="{_MONO} flex: none; overflow: visible; margin: 0; padding: 4px 6px; '
        f'white-space: pre-wrap; word-break: break-all; background: transparent">{body}</pre></div>'
        f'<div style="{_MUTED} font-size: 11px">{_log_note(view, ring, rank)}</div></div>'
    )


def _log_lines(ring: LogRing, merged: bool, last: int | None = None) -> str:
    lines = ring.view()
    if last is not None:
        lines = lines[-last:]
    out = []
    for line in lines:
        text = _text(line.text)
        if line.stream == "stderr":
            text = f'<span style="color: #c0392b">{text}</span>'
        if merged:
            colour = rank_colour(line.rank)
            text = f'<span style="color: {colour}; user-select: none">[{line.rank}]</span> {text}'
        out.append(text)
    return "\n".join(out)


def _log_note(view: LaunchView, ring: LogRing, rank: int | None) -> str:
    shown = len(ring.view())
    note = f"{ring.total} line{'s' if ring.total != 1 else ''}"
    if ring.dropped:
        note += f", last {shown} shown"
    if rank is not None and view.log_path(rank):
        note += f" · full log: <code>{escape(view.log_path(rank) or '')}</code>"
    elif rank is None and view.plan and view.plan.log_dir:
        note += f" · full logs: <code>{escape(view.plan.log_dir)}</code>"
    return note


# -- metrics ---------------------------------------------------------------------------------


def metrics_html(view: LaunchView) -> str:
    """A chart per metric (a line per rank that logged it) and a table of the latest values."""
    if not view.metrics:
        return ""
    charts = []
    for name, by_rank in view.metrics.items():
        series = [(f"rank {r}", rank_colour(r), s.points()) for r, s in by_rank.items()]
        charts.append(f'<div style="flex: 0 0 auto">{line_chart(name, series)}</div>')
    ranks = sorted({r for by_rank in view.metrics.values() for r in by_rank})
    cell = "padding: 1px 10px; text-align: right;"
    head = "".join(f'<th style="{cell} color: {rank_colour(r)}">rank {r}</th>' for r in ranks)
    rows = []
    for name, by_rank in view.metrics.items():
        values = []
        for r in ranks:
            last = by_rank[r].last if r in by_rank else None
            values.append(f'<td style="{cell}">{format_number(last[1]) if last else ""}</td>')
        step = max((s.last[0] for s in by_rank.values() if s.last), default=0)
        rows.append(
            f'<tr class="nbl-metric" data-metric="{escape(name)}"><td style="{cell} text-align: left">'
            f'{escape(name)}</td>{"".join(values)}<td style="{cell} {_MUTED}">{format_number(step)}</td></tr>'
        )
    table = (
        f'<table class="nbl-metrics" style="{_FONT} border-collapse: collapse; align-self: flex-start">'
        f'<thead><tr><th style="{cell} text-align: left">metric</th>{head}'
        f'<th style="{cell} {_MUTED}">step</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )
    return (
        f'<div class="nbl-metrics-panel" style="display: flex; flex-wrap: wrap; gap: 8px 16px; '
        f'align-items: flex-start">{"".join(charts)}{table}</div>'
    )


# -- the end ---------------------------------------------------------------------------------


def summary_html(view: LaunchView, now: float) -> str:
    """The static record of the launch, left in the cell output once it is over.

    Self-contained: header, rank table, results or the error with its traceback, where every
    rank was stopped, metrics, and the last lines of every rank's log (folded).
    """
    finished = view.finished
    state = view.state
    title = escape(view.plan.function_name) if view.plan else "launch"
    parts = [
        f'<div class="nbl-summary" data-state="{state.value}" style="{_FONT} border-left: 3px solid '
        f'{STATE_COLOURS[state]}; padding: 4px 10px">',
        f'<div style="font-size: 14px"><b>{title}</b> &nbsp;{badge(state)} &nbsp;'
        f"in {view.elapsed(now):.1f} s</div>",
    ]
    error = finished.error if finished is not None else None
    if finished is not None and finished.summary and finished.root_cause_rank is None:
        parts.append(f'<div class="nbl-summary-text">{_pre(finished.summary)}</div>')
    if error is not None:
        # The error's headline and what it adds (other ranks, a hint); its traceback is the
        # exception's, shown once, below the cell's outputs.
        where = f" (root cause: rank {finished.root_cause_rank})" if finished.root_cause_rank is not None else ""
        parts.append(
            f'<div class="nbl-error"><b style="color: {STATE_COLOURS[RankState.FAILED]}">'
            f"{escape(type(error).__name__)}{where}</b>{_pre(str(error))}</div>"
        )
    elif finished is not None and finished.results is not None:
        parts.append(_results(finished.results))
    parts.append(ranks_html(view, now))
    for rank in view.ranks.values():
        if rank.detail and rank.state is RankState.FAILED and not (finished and finished.error):
            parts.append(_fold(f"rank {rank.rank}: {rank.detail.strip().splitlines()[-1]}", _pre(rank.detail), True))
    stacks = [r for r in view.ranks.values() if r.stacks]
    for rank in stacks:
        # Folded, the place in the label: the whole stack is one click away (and in the log).
        where = frames.where(rank.stacks or "")
        label = f"rank {rank.rank}: where it was stopped" + (f" · {escape(where)}" if where else "")
        parts.append(_fold(label, _pre(rank.stacks or ""), False, escaped=True))
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
        body = f'<pre style="{_MONO} white-space: pre-wrap; margin: 2px 0">' + _log_lines(ring, False, SUMMARY_LOG_LINES) + "</pre>"
        parts.append(_fold(label, body, False, escaped=True))
    parts.append("</div>")
    return "".join(parts)


def _results(results: list) -> str:
    cell = "padding: 1px 10px; text-align: left; vertical-align: top;"
    rows = "".join(
        f'<tr><td style="{cell} color: {rank_colour(r)}">rank {r}</td>'
        f'<td style="{cell} {_MONO}">{_text(_short_repr(value))}</td></tr>'
        for r, value in enumerate(results)
    )
    return f'<table class="nbl-results" style="border-collapse: collapse; margin: 4px 0">{rows}</table>'


def _short_repr(value: object, limit: int = 300) -> str:
    try:
        text = repr(value)
    except Exception as error:  # a broken __repr__ must not break the summary
        text = f"<unprintable {type(value).__name__}: {error}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fold(label: str, body: str, open_: bool, escaped: bool = False) -> str:
    return (
        f'<details{" open" if open_ else ""} style="margin: 3px 0"><summary style="cursor: pointer">'
        f"{label if escaped else escape(label)}</summary>{body}</details>"
    )


def _pre(text: str) -> str:
    return (
        f'<pre style="{_MONO} white-space: pre-wrap; margin: 2px 0; padding: 4px 6px; '
        f'background: rgba(127,127,127,.08)">{_text(text)}</pre>'
    )


def _text(text: str) -> str:
    return escape(_ANSI.sub("", text))
