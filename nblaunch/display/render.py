"""HTML for each part of the dashboard, from a :class:`~nblaunch.display.view_state.LaunchView`.

Plain functions from the view to HTML text, used twice: by the live widget (one HTML widget
per part) and by :mod:`nblaunch.display.summary` for the static record left in the cell at the
end, which a saved notebook shows without a widget manager (GitHub, nbviewer). Inline styles and inline SVG, no scripts; the one
stylesheet is two keyframes of our own names (the live view's "not updated since" note), which
nothing else on the page can match. Elements carry
``nbl-*`` classes and ``data-*`` attributes so tests (and curious users) can find them.

Example::

    html = ranks_html(view, now=time.monotonic())
"""

from __future__ import annotations

import re
import time
from html import escape

from nblaunch import frames
from nblaunch.display import step_view
from nblaunch.display.logring import LogRing
from nblaunch.display.svgchart import format_number, line_chart
from nblaunch.display.view_state import Bar, LaunchView, RankView
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

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # colour codes and cursor moves from tools' output
# line-height: widget stylesheets set a tall one for one-line controls, too airy for tables.
FONT = "font-family: var(--jp-ui-font-family, system-ui, sans-serif); font-size: 13px; line-height: 1.45;"
MONO = "font-family: var(--jp-code-font-family, monospace); font-size: 12px;"
MUTED = "opacity: 0.7;"


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
        return f'<div class="nbl-header" style="{FONT}">{badge(view.state)} waiting for the launch…</div>'
    ranks = f"{plan.num_processes} process{'es' if plan.num_processes != 1 else ''}"
    if plan.world_size != plan.num_processes:
        ranks += f" (node {plan.node_rank}, world size {plan.world_size})"
    facts = [
        ranks,
        f"devices: {escape(plan.devices)}",
        f"start: {escape(plan.start_method)}"
        + (f' <span style="{MUTED}">({escape(plan.start_reason)})</span>' if plan.start_reason else ""),
        f"rendezvous: {escape(plan.rendezvous)}" if view.placed is None else escape(view.placed.line),
    ]
    if view.stopping is not None and view.finished is None:
        facts.append(f'<span style="color: #b45309">{escape(view.stopping.line)}</span>')
    if view.waiting is not None and view.placed is None:
        facts.append(f'<span style="color: #b45309">{escape(view.waiting.line)}</span>')
    if view.restarted is not None:
        r = view.restarted
        facts.append(f'<span style="color: #b45309">restart {r.restart} of {r.max_restarts} '
                     f'(rank {r.failed_rank} failed)</span>')
    logs = ""
    if plan.log_dir:
        logs = (
            f'<div style="{MUTED}">full logs: <code class="nbl-logdir">'
            f"{escape(plan.log_dir)}</code></div>"
        )
    claim = f'{badge(view.state)} &nbsp;<span class="nbl-elapsed">{format_duration(view.elapsed(now))}</span>'
    stale = ""
    if view.finished is None and view.state is RankState.RUNNING:  # redrawn every second from now on
        claim = _stale_mark(claim)
        stale = (
            f'{_STALE_STYLE}<div class="nbl-stale" style="font-size: 0; color: #b45309; animation: '
            f'nbl-stale-note 0s {STALE_AFTER_S}s forwards">⚠ not updated since {time.strftime("%H:%M:%S")}: '
            "the kernel stopped, restarted or lost its connection, and the ranks went with it</div>"
        )
    return (
        f'<div class="nbl-header" data-state="{view.state.value}" style="{FONT}">'
        f'<div><b style="font-size: 14px">{escape(plan.function_name)}</b> &nbsp;{claim}</div>{stale}'
        f'<div style="{MUTED}">{" · ".join(facts)}</div>{step_view.finding_html(view.steps())}{logs}</div>'
    )


# -- ranks ---------------------------------------------------------------------------------

QUIET_NOTE_S = 10.0  # a running rank silent this long says so in its row
STALE_AFTER_S = 6  # the live view redraws every second; this long without a redraw, it says so


def ranks_html(view: LaunchView, now: float) -> str:
    """One row per rank: state, elapsed, progress bars (when any rank has one), last line.

    The last line takes the width that is left and is cut with an ellipsis (the whole line is
    its tooltip), so the table fits the cell; a box that scrolls sideways is the backstop for
    very narrow cells.
    """
    ranks = list(view.ranks.values())
    with_bars = any(rank.shown_bars() for rank in ranks)
    with_devices = any(rank.device or rank.gpu for rank in ranks)
    steps = view.steps()
    full = step_view.widest(steps)
    split = {r.rank: step_view.split_cell(steps.ranks.get(r.rank), full) for r in ranks} if steps.ranks else None
    rows = "".join(_rank_row(rank, now, with_bars, with_devices, view.finished is None, split) for rank in ranks)
    names = (("rank", "state", "elapsed") + (("device",) if with_devices else ()) + (("progress",) if with_bars else ())
             + (("step",) if split and not with_bars else ()) + ("last line",))
    head = "".join(f'<th style="{_CELL} font-weight: 600; white-space: nowrap">{name}</th>' for name in names)
    return (
        f'<div class="nbl-ranks-box" style="overflow-x: auto; max-width: 100%">'
        # table-layout: JupyterLab's stylesheet for HTML outputs fixes it, which shares the width
        # out evenly and lets long text overlap the next column.
        f'<table class="nbl-ranks" style="{FONT} border-collapse: collapse; width: 100%; table-layout: auto">'
        f'<thead><tr style="border-bottom: 1px solid rgba(127,127,127,.4)">{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table></div>"
    )


_CELL = "padding: 3px 8px; text-align: left; vertical-align: top;"


def _rank_row(rank: RankView, now: float, with_bars: bool, with_devices: bool, live: bool,
              split: dict[int, str] | None) -> str:
    running = rank.state is RankState.RUNNING and live
    if rank.started_t is None:
        elapsed = ""
    else:
        elapsed = format_duration((rank.finished_t if rank.finished_t is not None else now) - rank.started_t)
    if running and rank.compiling_since is not None:  # a long compile is work, not a hang
        elapsed += (f'<div class="nbl-compiling" style="color: #7c3aed">compiling '
                    f"{format_duration(now - rank.compiling_since)}</div>")
    elif rank.compiled_s >= 1:
        elapsed += f'<div class="nbl-compiled" style="{MUTED}">compiled in {format_duration(rank.compiled_s)}</div>'
    if running and rank.compiling_since is None and rank.last_heard_t is not None and now - rank.last_heard_t >= QUIET_NOTE_S:
        elapsed += (f'<div class="nbl-quiet" style="color: #b45309">no output for '
                    f"{format_duration(now - rank.last_heard_t)}</div>")
    if rank.state in (RankState.FAILED, RankState.STOPPED) and rank.detail:
        last = rank.detail.strip().splitlines()[-1]
        last_html = f'<span style="color: {STATE_COLOURS[rank.state]}">{plain_text(last)}</span>'
    else:
        last, last_html = rank.last_line, plain_text(rank.last_line)
    state = badge(rank.state)
    if running:
        state = _stale_mark(state)
    # The step split is one more line under the rank's progress bars (a column of its own beside
    # them made the table wider than a notebook's cell), its own column where there are none.
    step = split[rank.rank] if split is not None else ""
    progress = ""
    if with_bars:
        bars = "".join(_bar(bar, rank_colour(rank.rank), running) for bar in rank.shown_bars())
        progress = f'<td style="{_CELL} width: 1%">{bars}{step}</td>'
    elif split is not None:
        progress = f'<td class="nbl-step" style="{_CELL} width: 1%">{step}</td>'
    device = f'<td class="nbl-device" style="{_CELL} width: 1%; white-space: nowrap">{_device(rank)}</td>' if with_devices else ""

    return (
        f'<tr class="nbl-rank" data-rank="{rank.rank}" data-state="{rank.state.value}">'
        f'<td style="{_CELL} width: 1%; color: {rank_colour(rank.rank)}; font-weight: 600">{rank.rank}</td>'
        f'<td style="{_CELL} width: 1%">{state}</td>'
        f'<td style="{_CELL} width: 1%; white-space: nowrap">{elapsed}</td>{device}{progress}'
        # width 100% with max-width 0: the column gets what the others (1%: as narrow as their
        # content) leave, and its text is cut there instead of widening the table.
        f'<td class="nbl-last" title="{escape(_ANSI.sub("", last))}" style="{_CELL} {MONO} width: 100%; max-width: 0; '
        f'overflow: hidden; text-overflow: ellipsis; white-space: nowrap">{last_html}</td></tr>'
    )


def _device(rank: RankView) -> str:
    """``cuda:0 · bf16`` (what its Accelerator said), over ``GPU 0 · 87% · 12.1/80 GB`` (NVML)."""
    parts = []
    if rank.device is not None:
        parts.append(plain_text(f"{rank.device.device} · {rank.device.precision}"))
    if rank.gpu is not None:
        whose = "this rank's memory" if rank.gpu.own_memory else "the GPU's memory (NVML names no process of the rank)"
        parts.append(f'<div class="nbl-gpu" title="{escape(whose)}" style="{MUTED}">{plain_text(rank.gpu.line)}</div>')
    return "".join(parts)


def _bar(bar: Bar, colour: str, running: bool) -> str:
    if bar.total:
        fraction = min(max(bar.n / bar.total, 0.0), 1.0)
        count = f"{format_number(bar.n)}/{format_number(bar.total)} ({fraction:.0%})"
    else:  # unknown length: a faint full bar and a count
        fraction = None
        count = format_number(bar.n)
    facts = [count]
    rate = bar.rate()
    if rate is not None:
        facts.append(_format_rate(rate))
        if running and fraction is not None and fraction < 1 and not bar.closed:
            facts.append(f"{format_duration((bar.total - bar.n) / rate)} left")
    width = f"{fraction * 100:.1f}%" if fraction is not None else "100%"
    fill_opacity = "1" if fraction is not None else "0.35"
    desc = ""
    if bar.desc:  # long descriptions are cut; the whole one is the tooltip
        desc = (f'<span title="{escape(bar.desc)}" style="display: inline-block; max-width: 16em; '
                f'overflow: hidden; text-overflow: ellipsis; vertical-align: bottom">{escape(bar.desc)}</span> · ')
    # Inline boxes in a line that does not wrap: a table cell sizes itself to them (a flex row
    # inside a table cell was measured too narrow, and its text ran over the next column).
    return (
        f'<div class="nbl-bar" data-bar="{bar.bar_id}" data-n="{bar.n:g}" '
        f'data-total="{"" if bar.total is None else f"{bar.total:g}"}" style="white-space: nowrap; margin: 1px 0">'
        '<span style="display: inline-block; width: 120px; height: 9px; border-radius: 3px; overflow: hidden; '
        'background: rgba(127,127,127,.22); margin-right: 8px; vertical-align: middle">'
        f'<span class="nbl-fill" style="display: block; width: {width}; height: 100%; background: {colour}; '
        f'opacity: {fill_opacity}"></span></span>'
        f'<span style="vertical-align: middle">{desc}{" · ".join(facts)}</span></div>'
    )


# Keyframes need a stylesheet; the names are ours alone, so the page's other styles are safe.
_STALE_STYLE = (
    "<style>@keyframes nbl-stale-claim { to { opacity: 0.45; text-decoration: line-through } }"
    "@keyframes nbl-stale-note { to { font-size: 12px } }</style>"
)


def _stale_mark(html: str) -> str:
    """``html`` struck through once the live view has not been redrawn for STALE_AFTER_S.

    Every redraw makes new elements, which restarts the animation's delay: while the kernel
    updates the view nothing happens; once it stops (killed, restarted, disconnected) the claim
    to be running is crossed out by the browser alone.
    """
    return (f'<span class="nbl-stale-claim" style="animation: nbl-stale-claim 0s {STALE_AFTER_S}s '
            f'forwards">{html}</span>')


def _format_rate(rate: float) -> str:
    """Like tqdm: ``2.5 s/it`` for slow loops, ``12.3 it/s`` / ``56,870 it/s`` for fast ones."""
    if rate < 1:
        return f"{1 / rate:.3g} s/it"
    return f"{rate:.3g} it/s" if rate < 100 else f"{rate:,.0f} it/s"


# -- stacks while running ---------------------------------------------------------------------


def stacks_html(view: LaunchView) -> str:
    """Where each rank was when last asked (by the user, or because the launch went quiet), folded."""
    shown = [r for r in view.ranks.values() if r.stacks and r.stacks_why != "stop"]
    verdict = (f'<div class="nbl-stall" style="color: #b45309"><b>stalled</b>{pre_block(view.stall.verdict)}</div>'
               if view.stall is not None else "")
    if not shown:
        return f'<div class="nbl-stacks" style="{FONT}">{verdict}</div>' if verdict else ""
    why = ("every rank was quiet for a while" if any(r.stacks_why == "quiet" for r in shown)
           else "you asked")
    folds = []
    for rank in shown:
        where = frames.where(rank.stacks or "")
        label = f"rank {rank.rank} at {rank.stacks_at}" + (f" · {escape(where)}" if where else "")
        folds.append(fold(label, pre_block(rank.stacks or ""), False, escaped=True))
    return (f'<div class="nbl-stacks" style="{FONT}">{verdict}<div style="{MUTED}">where each rank is ({why}; '
            f"the launch goes on):</div>{''.join(folds)}</div>")


# -- logs ----------------------------------------------------------------------------------


def log_html(view: LaunchView, rank: int | None, height_em: int = 22) -> str:
    """The tail of one rank's log (or of all ranks, each line marked), newest at the bottom.

    The scroll box is laid out bottom-up (``column-reverse``), so each redraw shows the newest
    lines without any script.
    """
    ring = view.merged if rank is None else view.ranks[rank].log
    if not ring.total and not ring.view():
        return f'<div class="nbl-log" data-rank="{"all" if rank is None else rank}" style="{FONT} {MUTED}">no output yet</div>'
    body = log_lines(ring, merged=rank is None)
    return (
        f'<div class="nbl-log" data-rank="{"all" if rank is None else rank}" style="{FONT}">'
        f'<div style="max-height: {height_em}em; overflow: auto; display: flex; '
        'flex-direction: column-reverse; border: 1px solid rgba(127,127,127,.3); border-radius: 3px">'
        # flex: none, overflow: visible: some frontends give <pre> its own scrolling, which
        # would shrink it into the box and scroll it from the top.
        f'<pre style="{MONO} flex: none; overflow: visible; margin: 0; padding: 4px 6px; '
        f'white-space: pre-wrap; word-break: break-all; background: transparent">{body}</pre></div>'
        f'<div style="{MUTED} font-size: 11px">{_log_note(view, ring, rank)}</div></div>'
    )


def log_lines(ring: LogRing, merged: bool, last: int | None = None) -> str:
    lines = ring.view()
    if last is not None:
        lines = lines[-last:]
    out = []
    for line in lines:
        text = plain_text(line.text)
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
            f'{escape(name)}</td>{"".join(values)}<td style="{cell} {MUTED}">{format_number(step)}</td></tr>'
        )
    table = (
        f'<table class="nbl-metrics" style="{FONT} border-collapse: collapse; align-self: flex-start">'
        f'<thead><tr><th style="{cell} text-align: left">metric</th>{head}'
        f'<th style="{cell} {MUTED}">step</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )
    return (
        f'<div class="nbl-metrics-panel" style="display: flex; flex-wrap: wrap; gap: 8px 16px; '
        f'align-items: flex-start">{"".join(charts)}{table}</div>'
    )


def fold(label: str, body: str, open_: bool, escaped: bool = False) -> str:
    return (
        f'<details{" open" if open_ else ""} style="margin: 3px 0"><summary style="cursor: pointer">'
        f"{label if escaped else escape(label)}</summary>{body}</details>"
    )


def pre_block(text: str) -> str:
    return (
        f'<pre style="{MONO} white-space: pre-wrap; margin: 2px 0; padding: 4px 6px; '
        f'background: rgba(127,127,127,.08)">{plain_text(text)}</pre>'
    )


def plain_text(text: str) -> str:
    return escape(_ANSI.sub("", text))
