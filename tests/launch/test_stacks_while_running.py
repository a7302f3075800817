"""A hang is visible before any timeout: stacks on demand and after a quiet while, launch untouched."""

from __future__ import annotations

import os
import time

import pytest

from nblaunch import notebook_launcher
from nblaunch.events import RankState, Stacks
from nblaunch.launch.errors import LaunchCancelledError
from nblaunch.launch.supervising.quiet import QuietWatch


def waits_here(go: str) -> int:
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    return int(os.environ["RANK"])


def test_stacks_on_demand_say_where_each_rank_is_and_the_launch_goes_on(tmp_path, recorder):
    go = tmp_path / "go"
    launch = notebook_launcher(waits_here, args=(str(go),), num_processes=2, display=recorder, block=False)
    deadline = time.monotonic() + 60
    while not all("ready" in launch.logs(r) for r in (0, 1)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.01)

    first = launch.stacks()
    assert sorted(first) == [0, 1]
    for rank, stack in first.items():
        # Caught anywhere in its loop: on the sleep, or on the check between two sleeps.
        assert "in waits_here" in stack and ("time.sleep(0.01)" in stack or "os.path.exists(go)" in stack), stack
        assert "nblaunch/launch" not in stack  # the rank's own frames, not the launcher's
    assert launch.status == "running" and launch.ranks == {0: RankState.RUNNING, 1: RankState.RUNNING}
    assert sorted(launch.stacks()) == [0, 1]  # asking again works: nothing was used up
    asked = [e for e in recorder.of(Stacks) if e.why == "asked"]
    assert sorted({e.rank for e in asked}) == [0, 1]
    assert "stack when asked" in launch.logs(1)

    go.touch()
    assert launch.result(timeout=60) == [0, 1]  # asking stopped nothing
    assert launch.stacks() == {}


def test_stacks_on_demand_then_a_cancel_still_shows_the_stacks_where_it_stopped(tmp_path, recorder):
    launch = notebook_launcher(waits_here, args=(str(tmp_path / "never"),), num_processes=2, display=recorder,
                               block=False)
    deadline = time.monotonic() + 60
    while not all("ready" in launch.logs(r) for r in (0, 1)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.01)
    assert sorted(launch.stacks()) == [0, 1]
    launch.cancel()
    with pytest.raises(LaunchCancelledError):
        launch.result(timeout=60)
    # The earlier snapshot did not stand in for the stop's: each rank answered again.
    assert sorted(e.rank for e in recorder.of(Stacks) if e.why == "stop") == [0, 1]


def sleeps_quietly(seconds: float) -> int:
    print("about to go quiet", flush=True)
    time.sleep(seconds)
    return int(os.environ["RANK"])


def test_a_launch_gone_quiet_shows_every_ranks_stack_by_itself(monkeypatch, recorder):
    monkeypatch.setattr("nblaunch.launch.supervising.supervisor.QUIET_STACKS_S", 0.3)
    assert notebook_launcher(sleeps_quietly, args=(2.0,), num_processes=2, display=recorder) == [0, 1]
    quiet = [e for e in recorder.of(Stacks) if e.why == "quiet"]
    assert {e.rank for e in quiet} == {0, 1}
    assert all("in sleeps_quietly" in e.text and "time.sleep(seconds)" in e.text for e in quiet)
    # Backing off: at about 0.3 s, 0.6 s and 1.2 s of silence, not every 0.3 s.
    assert len(quiet) <= 2 * 4, len(quiet)


def test_the_quiet_watch_backs_off_and_any_sign_of_life_resets_it():
    watch = QuietWatch(after=30.0, now=0.0)
    assert watch.wait(0.0) == 30.0 and not watch.due(29.9)
    assert watch.due(30.0) and not watch.due(45.0)
    assert watch.due(60.0) and not watch.due(100.0) and watch.due(120.0)
    watch.heard(130.0)
    assert watch.wait(130.0) == 30.0 and not watch.due(159.0) and watch.due(160.0)
    never = QuietWatch(after=None, now=0.0)
    assert never.wait(0.0) is None and not never.due(1e9)


def test_a_stack_keeps_the_users_frames_when_it_ends_in_nblaunch_code():
    # A rank stopped while its code reported a metric: the stack used to begin after the last
    # worker frame (channel.py), showing only nblaunch's wire.py, so "stopped at" named wire.py.
    import traceback

    from nblaunch.worker import bootstrap

    worker = os.path.dirname(bootstrap.__file__)

    def frames(*paths):
        return traceback.StackSummary.from_list([traceback.FrameSummary(p, 1, "f") for p in paths])

    forked = frames("/ipykernel/kernelapp.py", os.path.join(worker, "bootstrap.py"),
                    os.path.join(worker, "bootstrap.py"), "/home/me/train.py",
                    os.path.join(worker, "channel.py"), os.path.join(os.path.dirname(worker), "wire.py"))
    assert bootstrap._users_code_starts(forked) == 3
    warm = frames(os.path.join(worker, "bootstrap.py"), os.path.join(worker, "calls.py"), "<distributed cell>")
    assert bootstrap._users_code_starts(warm) == 2
    users_thread = frames("/usr/lib/python3.11/threading.py", "/home/me/train.py", os.path.join(worker, "channel.py"))
    assert bootstrap._users_code_starts(users_thread) == 0
