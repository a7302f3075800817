"""Where a launch's step split is read: a blocking launch's (``nblaunch.last_steps()``), warm
ranks' per call (``ranks.steps``), a detached launch's from its folder (``attach().steps`` and
the summary its dashboard replays). Real ranks, gloo."""

from __future__ import annotations

import os

import pytest

import nblaunch
from nblaunch import WarmRanks, attach, notebook_launcher
from test_step_split import _train


def test_a_blocking_launchs_split_is_the_last_steps():
    assert notebook_launcher(_train, args=(0.003,), num_processes=2, display="none") == [0, 1]
    steps = nblaunch.last_steps()
    assert steps.straggler == 1 and steps.cause == "data", str(steps)
    assert steps[0].count == steps[1].count == 40

    assert notebook_launcher(os.getpid, num_processes=2, display="none")  # trains nothing: nothing measured
    assert not nblaunch.last_steps().ranks and str(nblaunch.last_steps()) == "no training step was measured"


def test_warm_ranks_split_each_call_on_its_own(capsys):
    with WarmRanks(num_processes=2, display="none") as ranks:
        assert not ranks.steps.ranks  # no call yet
        ranks.run(_train, 0.0, 0.0, 64, 8, 2)  # accumulating 2 batches a step: 40 batches, 20 steps
        assert ranks.steps[0].count == ranks.steps[1].count == 20
        assert ranks.steps.straggler is None, str(ranks.steps)

        # The next call's steps are its own, numbered afresh: its syncs line up, its straggler is named.
        ranks.run(_train, 0.003, display="text")
        steps = ranks.steps
        assert steps[0].count == steps[1].count == 40
        assert steps.straggler == 1 and steps.cause == "data", str(steps)
        assert steps[1].arrival_lag >= 0.7 * steps[1].data
        assert nblaunch.last_steps() is steps
        shown = capsys.readouterr().out
        assert "steps split: 40 steps per rank" in shown and "rank 1 holds the others up" in shown, shown

        ranks.run(os.getpid)  # a call that trains nothing has no steps of the last one's
        assert not ranks.steps.ranks


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    from processes import stop_every_launch_in

    folder = str(tmp_path / "state")
    monkeypatch.setenv("NBLAUNCH_STATE_DIR", folder)
    yield folder
    stop_every_launch_in(folder)


def test_a_detached_launch_keeps_its_split_in_its_folder(state_dir, capsys):
    launch = notebook_launcher(_train, args=(0.003,), num_processes=2, detach=True, display="none")
    assert launch.result() == [0, 1]

    again = attach(launch.launch_id, display="text")  # as a kernel that attaches later sees it
    assert again.result() == [0, 1]
    shown = capsys.readouterr().out
    assert "steps split: 40 steps per rank" in shown and "rank 1 holds the others up" in shown, shown
    assert again.steps.straggler == 1 and again.steps[0].count == 40, str(again.steps)


def _through_accelerate():
    from accelerate import Accelerator as TheirAccelerator

    TheirAccelerator()
    return 0


def test_warm_ranks_say_once_that_another_librarys_loop_went_unmeasured():
    pytest.importorskip("accelerate")
    with WarmRanks(num_processes=2, display="none") as ranks:
        ranks.run(_through_accelerate)
        assert len(ranks.steps.notes) == 1 and "accelerate's Accelerator" in ranks.steps.notes[0]
        ranks.run(os.getpid)  # the state accelerate left is no news in the next call
        assert not ranks.steps.notes and not ranks.steps.ranks
        ranks.run(_train)
        assert not ranks.steps.notes and ranks.steps[0].count == 40
