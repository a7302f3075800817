"""What the dashboard's parts say about the cell's layout and liveness, from synthetic events.

The browser test (test_browser_scenarios.py) checks how the same markup lays out in a page.
"""

from __future__ import annotations

import re
import time

from htmlq import bars, text

from nblaunch.display import render
from nblaunch.display.view_state import LaunchView
from nblaunch.display.summary import summary_html
from nblaunch.events import (LaunchFinished, Output, Progress, RankCompiling, RankFinished, RankStarted, RankState,
                             Stacks, StallCleared, Stalled)
from test_widget_display import started


def running_view(now: float, num_processes: int = 2) -> LaunchView:
    view = LaunchView()
    view.apply(started(num_processes), now)
    for rank in range(num_processes):
        view.apply(RankStarted(rank, pid=100 + rank), now)
    return view


def test_without_any_bar_there_is_no_progress_column_and_an_empty_log_says_so():
    now = time.monotonic()
    view = running_view(now)
    assert "progress" not in render.ranks_html(view, now)
    assert text(render.log_html(view, 0)).strip() == "no output yet"
    view.apply(Progress(1, bar_id=0, n=1, total=4, desc="epoch"), now)
    assert "<th" in render.ranks_html(view, now) and ">progress</th>" in render.ranks_html(view, now)


def test_a_long_last_line_is_cut_in_its_cell_and_whole_in_the_tooltip():
    now = time.monotonic()
    view = running_view(now)
    long = "step 3 " + "x" * 400
    view.apply(Output(0, "stdout", (long,)), now)
    markup = render.ranks_html(view, now)
    assert "overflow-x: auto" in markup  # the table scrolls sideways rather than being clipped
    assert f'title="{long}"' in markup and "max-width: 0" in markup and "text-overflow: ellipsis" in markup
    # elapsed comes before the last line, so a long line can never push it out of view
    header = re.findall(r"<th[^>]*>([^<]*)</th>", markup)
    assert header.index("elapsed") < header.index("last line")


def test_a_stopped_rank_has_no_time_left_and_a_running_one_does():
    start = time.monotonic()
    view = running_view(start)
    for rank in (0, 1):
        view.apply(Progress(rank, bar_id=0, n=0, total=100), start)
        view.apply(Progress(rank, bar_id=0, n=10, total=100), start + 1)
    view.apply(RankFinished(1, RankState.STOPPED, detail="stopped by the launcher", exitcode=-9), start + 1)
    rows = render.ranks_html(view, start + 1).split('<tr class="nbl-rank"')[1:]
    assert "left" in text(rows[0]) and "left" not in text(rows[1])
    view.apply(LaunchFinished(RankState.STOPPED, elapsed_s=1.0), start + 1)
    assert " left" not in text(render.ranks_html(view, start + 1))


def test_a_quiet_rank_says_for_how_long():
    start = time.monotonic()
    view = running_view(start)
    view.apply(Output(0, "stdout", ("still here",)), start + 14)
    rows = render.ranks_html(view, start + 15).split('<tr class="nbl-rank"')[1:]
    assert "no output for" not in rows[0] and "no output for 15 s" in text(rows[1])
    view.apply(RankFinished(1, RankState.DONE, exitcode=0), start + 15)
    assert "no output for" not in render.ranks_html(view, start + 30).split('data-rank="1"')[1]


def test_a_compiling_rank_says_so_for_how_long_not_quiet_then_how_long_it_took():
    start = time.monotonic()
    view = running_view(start)
    view.apply(RankCompiling(1, compiling=True), start + 1)
    rows = render.ranks_html(view, start + 31).split('<tr class="nbl-rank"')[1:]
    assert "compiling 30 s" in text(rows[1]) and "no output for" not in rows[1]
    assert "no output for 31 s" in text(rows[0])  # the rank that is not compiling is quiet
    view.apply(RankCompiling(1, compiling=False, seconds=32.0), start + 33)
    row = render.ranks_html(view, start + 34).split('<tr class="nbl-rank"')[2]
    assert "compiling" not in text(row) and "compiled in 32 s" in text(row)


def test_the_text_display_says_when_a_long_compile_begins_and_ends(capsys):
    from nblaunch.display.text import TextDisplay

    display = TextDisplay()
    for event in (RankCompiling(0, True), RankCompiling(0, False, 0.2), RankCompiling(0, True),
                  RankCompiling(0, False, 12.5)):
        display.on_event(event)
    assert capsys.readouterr().out.splitlines() == ["[rank 0] compiling (torch.compile)...",
                                                    "[rank 0] compiled in 12.5 s"]


def test_only_a_live_running_view_can_turn_stale_and_the_summary_never_does():
    now = time.monotonic()
    view = LaunchView()
    view.apply(started(), now)
    assert "nbl-stale" not in render.header_html(view, now)  # starting: not redrawn each second yet
    view.apply(RankStarted(0, pid=100), now)
    header = render.header_html(view, now)
    assert "@keyframes nbl-stale-note" in header and "not updated since" in header
    assert "nbl-stale-claim" in render.ranks_html(view, now)
    view.apply(LaunchFinished(RankState.DONE, elapsed_s=1.0, results=[1, 2]), now)
    assert "nbl-stale" not in render.header_html(view, now) + render.ranks_html(view, now)
    assert "nbl-stale" not in summary_html(view, now)


def test_nblaunchs_own_loader_bars_give_way_to_the_users_bars():
    now = time.monotonic()
    view = running_view(now)
    view.apply(Progress(0, bar_id=0, n=3, total=10, desc="batches, epoch 0", auto=True), now)
    view.apply(Progress(1, bar_id=0, n=3, total=10, desc="batches, epoch 0", auto=True), now)
    view.apply(Progress(1, bar_id=1, n=2, total=5, desc="my bar"), now)
    markup = render.ranks_html(view, now)
    rank0, rank1 = markup.split('<tr class="nbl-rank"')[1:]
    assert bars(rank0) == [(3.0, 10.0)]  # no bar of its own: the loader's is shown
    assert bars(rank1) == [(2.0, 5.0)]  # the user's bar only
    view.apply(Progress(1, bar_id=1, n=5, total=5, desc="my bar", closed=True), now)
    view.apply(Progress(1, bar_id=2, n=1, total=10, desc="batches, epoch 1", auto=True), now)
    assert bars(render.ranks_html(view, now).split('data-rank="1"')[1]) == [(5.0, 5.0)]


def test_stacks_asked_for_show_live_and_only_stop_stacks_go_in_the_summary():
    now = time.monotonic()
    view = running_view(now)
    stack = 'Thread MainThread (most recent call last):\n  File "<cell>", line 4, in train\n    time.sleep(60)'
    view.apply(Stacks(0, stack, why="quiet"), now)
    live = render.stacks_html(view)
    assert "every rank was quiet" in live and "the launch goes on" in live and "time.sleep(60)" in live
    view.apply(LaunchFinished(RankState.DONE, elapsed_s=1.0, results=[1, 2]), now)
    assert "where it was stopped" not in summary_html(view, now)
    view.apply(Stacks(1, stack, why="stop"), now)
    assert "rank 1: where it was stopped" in summary_html(view, now)


def test_a_stall_shows_its_verdict_above_the_stacks_and_clears_itself():
    now = time.monotonic()
    view = running_view(now)
    stack = 'Thread MainThread (most recent call last):\n  File "<cell>", line 4, in train\n    time.sleep(60)'
    view.apply(Stacks(1, stack, why="quiet"), now)
    view.apply(Stalled(61.0, "no rank made progress for 61 s; nothing was stopped\nrank 0 waits in all_reduce (x)\n"
                             "rank 1 is elsewhere, at <cell>, line 4"), now)
    live = render.stacks_html(view)
    assert "stalled" in live and "rank 0 waits in all_reduce" in live and "time.sleep(60)" in live
    assert live.index("rank 0 waits in all_reduce") < live.index("where each rank is")
    view.apply(StallCleared(70.0), now)
    assert render.stacks_html(view) == ""  # progress again: nothing of the stall is left on show
