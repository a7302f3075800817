"""The step split in the cell: each rank's bar in its row and the straggler in the header while the
ranks train, the summary at the end (the widget, fed by events and by a real launch); the same as
lines in text, whose end summary a stopped launch leaves out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nblaunch import RankFailedError, notebook_launcher
from nblaunch.display import text as text_display
from nblaunch.display.widget import WidgetDisplay
from nblaunch.events import RankStarted, StepTimes
from test_widget_display import started, wait_until

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from test_step_split import _train  # noqa: E402  (the step split's own tests' loop)



# Rank 1 waits 24 ms a step for data; rank 0 waits for it in the sync.
RANK_0 = [(i, 0.030, 0.0005, 0.004, 0.024, 0.001, 0.024, 8) for i in range(1, 41)]
RANK_1 = [(i, 0.030, 0.024, 0.004, 0.0005, 0.001, 0.0005, 8) for i in range(1, 41)]


def test_while_the_ranks_train_each_row_has_its_split_and_the_header_names_the_straggler():
    display = WidgetDisplay(show=False)
    try:
        display.on_event(started())
        display.on_event(RankStarted(0, pid=101))
        display.on_event(RankStarted(1, pid=102))
        display.on_event(StepTimes(0, tuple(RANK_0)))
        display.on_event(StepTimes(1, tuple(RANK_1)))
        wait_until(lambda: display.ranks.value.count('class="nbl-split"') == 2)  # the timer redraws
        rows = display.ranks.value
        assert rows.count('data-part="data"') == 2 and ">step<" in rows
        assert "step 30 ms" in rows and "data 24 ms" in rows  # rank 1's bar: its step, its biggest part
        wait_until(lambda: "nbl-finding" in display.header.value)
        assert "rank 1 holds the others up: it waits 24 ms a step for data" in display.header.value
    finally:
        display.close()


def _starved(fail: bool = False):
    result = _train(0.003)
    if fail and result == 1:
        raise ValueError("rank 1 failed after training")
    return result


def test_a_real_launch_ends_with_the_split_in_its_summary():
    display = WidgetDisplay(show=False)
    try:
        assert notebook_launcher(_starved, num_processes=2, display=display) == [0, 1]
        assert 'class="nbl-steps" data-straggler="1" data-cause="data"' in display.summary_html
        assert "samples/s in all" in display.summary_html and "num_workers" in display.summary_html
        assert display.summary_html.count('class="nbl-split"') == 2  # the summary's rows keep their bars
    finally:
        display.close()


def test_text_prints_the_split_every_so_often_and_the_summary_once_done(monkeypatch, capsys):
    monkeypatch.setattr(text_display, "_STEPS_EVERY_S", 0.0)
    assert notebook_launcher(_starved, num_processes=2, display="text") == [0, 1]
    shown = capsys.readouterr().out
    assert "[rank 1] steps: " in shown and "nblaunch: rank 1 holds the others up" in shown, shown
    assert shown.count("steps split: 40 steps per rank") == 1, shown


def test_a_stopped_launch_prints_why_and_keeps_its_split_in_the_handle(capsys):
    launch = notebook_launcher(_starved, args=(True,), num_processes=2, display="text", block=False)
    with pytest.raises(RankFailedError):
        launch.result()
    assert "steps split" not in capsys.readouterr().out
    assert launch.steps[1].count == 40 and launch.steps.straggler == 1
