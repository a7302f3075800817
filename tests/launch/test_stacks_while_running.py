"""A hang is visible before any timeout: stacks on demand and after a quiet while, launch untouched."""

from __future__ import annotations

import os
import time

import pytest

from nblaunch import notebook_launcher
from nblaunch.events import RankState, Stacks, StallCleared, Stalled
from nblaunch.launch.errors import LaunchCancelledError
from nblaunch.launch.supervising.stall import StallWatch, collective_of, verdict


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


def test_a_stalled_launch_shows_every_ranks_stack_by_itself_and_clears_it(recorder):
    assert notebook_launcher(sleeps_quietly, args=(2.0,), num_processes=2, display=recorder, stall_after=0.3) == [0, 1]
    quiet = [e for e in recorder.of(Stacks) if e.why == "quiet"]
    assert {e.rank for e in quiet} == {0, 1}
    assert all("in sleeps_quietly" in e.text and "time.sleep(seconds)" in e.text for e in quiet)
    # Backing off: at about 0.3 s, 0.6 s and 1.2 s of silence, not every 0.3 s.
    assert len(quiet) <= 2 * 4, len(quiet)
    stalls = recorder.of(Stalled)
    assert stalls and "no rank is in a collective" in stalls[0].verdict
    assert "rank 0 is elsewhere" in stalls[0].verdict and "time.sleep(seconds)" in stalls[0].verdict
    assert recorder.of(StallCleared)  # the ranks came back


@pytest.mark.slow
def test_a_busy_loop_is_progress_not_a_stall(recorder):
    notebook_launcher(spins, args=(5.0,), num_processes=2, display=recorder, stall_after=2.0)
    assert not recorder.of(Stalled), [e.verdict for e in recorder.of(Stalled)]


def spins(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(100))


def test_stall_after_none_never_looks(recorder):
    notebook_launcher(sleeps_quietly, args=(1.0,), num_processes=2, display=recorder, stall_after=None)
    assert not recorder.of(Stalled) and not [e for e in recorder.of(Stacks) if e.why == "quiet"]


def test_the_stall_watch_backs_off_and_any_sign_of_life_resets_it():
    watch = StallWatch(after=30.0, now=0.0)
    assert watch.wait(0.0) == 30.0 and not watch.due(29.9)
    assert watch.due(30.0) and not watch.due(45.0)
    assert watch.due(60.0) and not watch.due(100.0) and watch.due(120.0)
    assert watch.heard(130.0) is None  # no stall was shown
    assert watch.wait(130.0) == 30.0 and not watch.due(159.0) and watch.due(160.0)
    watch.shown = True
    assert watch.heard(170.0) == 40.0  # how long it had stalled
    never = StallWatch(after=None, now=0.0)
    assert never.wait(0.0) is None and not never.due(1e9)


def _stack(*frames: tuple) -> str:
    listed = "".join(f'  File "{path}", line {line}, in {function}\n    {code}\n' for path, line, function, code in frames)
    return "Thread MainThread (most recent call last):\n" + listed


TORCH = os.path.dirname(__import__("torch").__file__)


def test_the_verdict_says_who_waits_in_what_and_who_holds_them_up():
    reducing = _stack(("/home/me/train.py", 9, "train", "dist.all_reduce(t)"),
                      (f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper", "return func(*args, **kwargs)"),
                      (f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce", "work.wait()"))
    backward = _stack(("/home/me/train.py", 12, "train", "loss.backward()"),
                      (f"{TORCH}/_tensor.py", 600, "backward", "torch.autograd.backward("),
                      (f"{TORCH}/autograd/__init__.py", 300, "backward", "_engine_run_backward("))
    sleeping = _stack(("/home/me/train.py", 5, "train", "time.sleep(100)"))
    assert collective_of(reducing) == "all_reduce" and collective_of(backward) == "backward"
    assert collective_of(sleeping) == ""
    said = verdict({0: reducing, 1: sleeping}, 61.0)
    assert said.splitlines() == [
        "no rank made progress for 61 s; nothing was stopped",
        "rank 0 waits in all_reduce (train.py, line 9, in train: dist.all_reduce(t))",
        "rank 1 is elsewhere, at train.py, line 5, in train: time.sleep(100)",
        "-> the collective waits for rank 1, which is not in it",
    ]
    assert "different collectives" in verdict({0: reducing, 1: backward}, 61.0)
    assert "every rank waits in the same collective" in verdict({0: reducing, 1: reducing}, 61.0)


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


def test_a_nodes_stall_names_its_ranks_as_the_cell_does():
    from nblaunch.launch.supervising.stall import StallReports

    shown = []
    reports = StallReports(0.01, shown.append, first_rank=2)  # node 1 of 2-rank nodes: ranks 2 and 3
    time.sleep(0.02)
    assert reports.due()
    reports.asked([0, 1])
    reports.report_when_answered({0: _stack(("/home/me/train.py", 5, "train", "time.sleep(100)")),
                                  1: _stack(("/home/me/train.py", 6, "train", "time.sleep(100)"))})
    (stalled,) = shown
    assert "rank 2 is elsewhere" in stalled.verdict and "rank 3 is elsewhere" in stalled.verdict
    reports.heard()
    assert isinstance(shown[-1], StallCleared)
