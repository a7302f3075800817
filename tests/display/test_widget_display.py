"""WidgetDisplay fed with event sequences, synthetic and from real launches; asserts on widget state."""

from __future__ import annotations

import os
import threading
import time

import pytest
from htmlq import bars, chart_points, rank_states, text

from nblaunch import RankFailedError, notebook_launcher
from nblaunch.display.widget import WidgetDisplay, widgets_available
from nblaunch.events import (
    LaunchFinished,
    LaunchRestarting,
    LaunchStarted,
    Metrics,
    Output,
    Progress,
    RankFinished,
    RankStarted,
    RankState,
    Stacks,
)
from nblaunch.worker.channel import log_metrics
from nblaunch.worker.progress import progress


def started(num_processes: int = 2, log_dir: str | None = "/tmp/nbl-logs") -> LaunchStarted:
    return LaunchStarted(
        function_name="train", num_processes=num_processes, world_size=num_processes, node_rank=0,
        start_method="fork", start_reason="fork is safe here", master_addr="127.0.0.1",
        master_port=29511, devices="cpu", log_dir=log_dir,
    )


def wait_until(condition, timeout: float = 10.0) -> None:
    """Wait for ``condition()``; the timeout is only a backstop against hanging forever."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def display():
    shown = WidgetDisplay(show=False)
    yield shown
    shown.close()


def test_header_rows_and_log_tabs_follow_the_launch(display):
    display.on_event(started())
    assert "train" in display.header.value and "127.0.0.1:29511" in display.header.value
    assert "/tmp/nbl-logs" in display.header.value
    assert rank_states(display.ranks.value) == {0: "starting", 1: "starting"}
    assert [display.logs.get_title(i) for i in range(3)] == ["all ranks", "rank 0", "rank 1"]

    display.on_event(RankStarted(0, pid=101))
    display.on_event(RankStarted(1, pid=102))
    display.on_event(Output(1, "stderr", ("warming up", "<ready>")))
    display.on_event(Progress(0, bar_id=0, n=3, total=10, desc="epoch"))
    # No more events: the timer thread redraws on its own.
    wait_until(lambda: rank_states(display.ranks.value) == {0: "running", 1: "running"})
    wait_until(lambda: "&lt;ready&gt;" in display.log_panes["1"].value)
    assert bars(display.ranks.value) == [(3.0, 10.0)]
    assert "&lt;ready&gt;" in display.log_panes["all"].value and display.log_panes["0"].value.count("[") == 0
    assert "/tmp/nbl-logs/rank1.log" in display.log_panes["1"].value
    assert "data-state=\"running\"" in display.header.value


def test_a_flood_of_output_keeps_only_the_tail_and_stays_fast(display):
    display.on_event(started())
    display.on_event(RankStarted(0, pid=101))
    begin = time.perf_counter()
    for batch in range(1000):  # 100k lines per rank, in batches as the supervisor sends them
        for rank in (0, 1):
            display.on_event(Output(rank, "stdout", tuple(f"r{rank} line {batch * 100 + i}" for i in range(100))))
    spent = time.perf_counter() - begin
    display.on_event(LaunchFinished(RankState.DONE, elapsed_s=1.0, results=[None, None]))

    assert spent < 5, f"200k lines took {spent:.1f} s to take in"
    pane = display.log_panes["0"].value
    assert "r0 line 99999" in pane and "r0 line 99000" not in pane
    assert text(pane).count("\n") < 300  # the ring (max_lines=300), not the whole log
    assert "100000 lines, last 300 shown" in pane
    assert len(display.log_panes["all"].value) < 100_000


def test_progress_bars_nest_and_the_last_closed_one_stays(display):
    display.on_event(started(num_processes=1))
    display.on_event(Progress(0, bar_id=0, n=1, total=3, desc="epochs"))
    display.on_event(Progress(0, bar_id=1, n=50, total=100, desc="batches"))
    display._redraw(None, time.monotonic())
    assert bars(display.ranks.value) == [(1.0, 3.0), (50.0, 100.0)]
    display.on_event(Progress(0, bar_id=1, n=100, total=100, desc="batches", closed=True))
    display.on_event(Progress(0, bar_id=0, n=3, total=3, desc="epochs", closed=True))
    display._redraw(None, time.monotonic())
    assert bars(display.ranks.value) == [(3.0, 3.0)]
    display.on_event(Progress(0, bar_id=2, n=7, total=None, desc="eval"))  # unknown length
    display._redraw(None, time.monotonic())
    assert bars(display.ranks.value) == [(7.0, None)]


def test_metrics_become_charts_and_a_table(display):
    display.on_event(started())
    for step in range(50):
        display.on_event(Metrics(0, {"loss": 1 / (step + 1), "lr": 0.1}, step))
        if step % 10 == 0:
            display.on_event(Metrics(1, {"loss": 2 / (step + 1)}, step))
    display.on_event(Metrics(0, {"accuracy": 0.5}, None))
    display.on_event(Metrics(0, {"accuracy": 0.7}, None))
    display._redraw(None, time.monotonic())

    markup = display.metrics.value
    assert chart_points(markup, "loss") == {"rank 0": 50, "rank 1": 5}
    assert chart_points(markup, "lr") == {"rank 0": 50}
    assert chart_points(markup, "accuracy") == {"rank 0": 2}  # no step given: numbered 0, 1
    assert 'data-metric="loss"><td' in markup and "0.02" in markup  # last value of rank 0's loss
    assert display.metrics.layout.display is None  # shown once there is something to show


def test_a_failure_leaves_the_traceback_and_every_stack_in_the_summary(display):
    display.on_event(started())
    for rank in (0, 1):
        display.on_event(RankStarted(rank, pid=100 + rank))
    display.on_event(Output(1, "stderr", ("Traceback (most recent call last):", "ValueError: bad batch")))
    display.on_event(Stacks(0, 'Thread MainThread (most recent call last):\n  File "train.py", line 9, in all_reduce'))
    display.on_event(RankFinished(1, RankState.FAILED, detail="Traceback ...\nValueError: bad batch", exitcode=1))
    display.on_event(RankFinished(0, RankState.STOPPED, detail="stopped after rank 1 failed", exitcode=-9))
    error = RuntimeError("rank 1 failed: ValueError: bad batch\n\nTraceback ...\nValueError: bad batch")
    display.on_event(LaunchFinished(RankState.FAILED, 2.5, error=error, root_cause_rank=1, summary="rank 1 failed"))

    assert rank_states(display.ranks.value) == {0: "stopped", 1: "failed"}
    assert "ValueError: bad batch" in text(display.ranks.value)  # why, in the failed rank's row
    summary = display.summary_html
    assert 'class="nbl-summary" data-state="failed"' in summary
    assert "root cause: rank 1" in summary and "ValueError: bad batch" in text(summary)
    assert "rank 0: where it was stopped" in summary and "in all_reduce" in summary
    assert rank_states(summary) == {0: "stopped", 1: "failed"}
    assert "<script" not in summary  # static: renders without any frontend code


def test_a_restart_shows_fresh_rank_rows_and_marks_the_logs(display):
    display.on_event(started())
    for rank in (0, 1):
        display.on_event(RankStarted(rank, pid=100 + rank))
    display.on_event(Output(0, "stdout", ("epoch 1",)))
    display.on_event(Progress(0, bar_id=0, n=3, total=10, desc="epoch"))
    display.on_event(RankFinished(1, RankState.FAILED, detail="ValueError: bad batch", exitcode=1))
    display.on_event(RankFinished(0, RankState.STOPPED, detail="stopped after rank 1 failed", exitcode=-9))
    display.on_event(LaunchRestarting(restart=1, max_restarts=2, failed_rank=1, reason="ValueError: bad batch"))
    display.on_event(RankStarted(0, pid=200))
    wait_until(lambda: "restart 1 of 2" in display.header.value)
    wait_until(lambda: rank_states(display.ranks.value) == {0: "running", 1: "starting"})
    assert bars(display.ranks.value) == []  # the old start's bar is gone with it
    assert "(rank 1 failed)" in display.header.value
    for pane in ("0", "1", "all"):
        wait_until(lambda: "every rank starts again: restart 1 of 2" in display.log_panes[pane].value)
    assert "epoch 1" in display.log_panes["0"].value  # what came before stays readable


def test_close_without_a_launch_leaves_no_summary():
    shown = WidgetDisplay(show=False)
    shown.close()
    shown.close()
    assert shown.summary_html == ""


def test_widgets_are_not_available_outside_a_kernel():
    assert widgets_available() is False  # pytest runs no ipykernel


# -- real launches ----------------------------------------------------------------------------


def train_with_progress(steps: int) -> int:
    rank = int(os.environ["RANK"])
    for step in progress(range(steps), desc="train"):
        log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        print(f"rank {rank} step {step}")
    return rank


def test_a_real_launch_fills_every_part(display):
    results = notebook_launcher(train_with_progress, args=(20,), num_processes=2, display=display)

    assert results == [0, 1]
    assert rank_states(display.ranks.value) == {0: "done", 1: "done"}
    assert bars(display.ranks.value) == [(20.0, 20.0), (20.0, 20.0)]
    assert "rank 0 step 19" in display.log_panes["0"].value and "rank 1 step 19" in display.log_panes["1"].value
    assert chart_points(display.metrics.value, "loss") == {"rank 0": 20, "rank 1": 20}
    assert 'data-state="done"' in display.summary_html and "rank 1" in display.summary_html
    assert display._timer is not None and not display._timer.is_alive()


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank 1")
    threading.Event().wait(60)  # rank 0 hangs until the launcher stops it


def test_a_real_failure_shows_the_root_cause(display):
    with pytest.raises(RankFailedError):
        notebook_launcher(fail_on_rank_one, num_processes=2, display=display)

    states = rank_states(display.ranks.value)
    assert states[1] == "failed" and states[0] in ("stopped", "failed")
    assert 'data-state="failed"' in display.header.value
    assert "ValueError: bad batch on rank 1" in text(display.summary_html)
    assert "root cause: rank 1" in display.summary_html


def test_the_stop_button_cancels_a_non_blocking_launch_with_stacks(tmp_path):
    import time as _time

    from nblaunch import notebook_launcher
    from nblaunch.launch.errors import LaunchCancelledError

    dashboard = WidgetDisplay(num_processes=2, show=False)
    assert dashboard.stop_button.layout.display == "none"  # no button until a launch can hear it
    launch = notebook_launcher(_sleep_forever, num_processes=2, display=dashboard, block=False)
    assert dashboard.stop_button.layout.display is None
    deadline = _time.monotonic() + 30
    while not all("sleeping" in launch.logs(r) for r in (0, 1)) and _time.monotonic() < deadline:
        _time.sleep(0.01)
    dashboard.stop_button.click()
    with pytest.raises(LaunchCancelledError):
        launch.result(timeout=30)
    assert dashboard.stop_button.layout.display == "none"
    assert "time.sleep(600)" in dashboard.summary_html  # every rank's stack, in the summary


def _sleep_forever():
    import time as _time

    print("sleeping", flush=True)
    _time.sleep(600)
