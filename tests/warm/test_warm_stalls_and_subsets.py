"""A stall named while it lasts (warm calls and launches alike), and calls on some ranks only,
with real processes and a real gloo group."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from nblaunch import RankFailedError, notebook_launcher
from nblaunch.events import Stacks, StallCleared, Stalled
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.warm.ranks import WarmRanks

STALL_AFTER = 2.0


def rank_1_sleeps_while_rank_0_reduces() -> float:
    if dist.get_rank() == 1:
        time.sleep(STALL_AFTER + 6)  # rank 1 dawdles
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def in_a_group(function):
    def run():
        dist.init_process_group("gloo")
        return function()

    return run


@pytest.fixture
def ranks():
    pool = WarmRanks(num_processes=2, display="none", stall_after=STALL_AFTER)
    yield pool
    pool.close()


def assert_the_stall_names_rank_1_and_its_line(recorder, began: float) -> None:
    stalls = recorder.of(Stalled)
    assert stalls, [type(e).__name__ for e in recorder.events]
    verdict = stalls[0].verdict
    assert "rank 0 waits in all_reduce" in verdict and "dist.all_reduce(total)" in verdict, verdict
    assert "rank 1 is elsewhere" in verdict and "time.sleep(STALL_AFTER + 6)" in verdict, verdict
    assert "the collective waits for rank 1" in verdict, verdict
    assert {e.rank for e in recorder.of(Stacks) if e.why == "quiet"} == {0, 1}
    assert recorder.of(StallCleared), "the stall was not cleared when rank 1 came back"


@pytest.mark.slow
def test_a_stall_in_a_warm_call_names_the_rank_that_holds_the_others_up_and_stops_nothing(ranks, recorder):
    ranks.run(time.time)  # the pool is up
    began = time.monotonic()
    assert ranks.run(rank_1_sleeps_while_rank_0_reduces, display=recorder) == [2.0, 2.0]  # nothing was stopped
    when = next(i for i, e in enumerate(recorder.events) if isinstance(e, Stalled))
    assert when >= 0 and time.monotonic() - began < STALL_AFTER + 6 + 5
    assert_the_stall_names_rank_1_and_its_line(recorder, began)


@pytest.mark.slow
def test_a_stall_in_a_launch_is_named_too(recorder):
    began = time.monotonic()
    results = notebook_launcher(in_a_group(rank_1_sleeps_while_rank_0_reduces), num_processes=2, cpu=True,
                                display=recorder, stall_after=STALL_AFTER)
    assert results == [2.0, 2.0]
    assert_the_stall_names_rank_1_and_its_line(recorder, began)


def test_stall_after_is_checked_before_anything_starts():
    for bad in (-1, 0, "soon", float("inf"), True):
        with pytest.raises(LaunchConfigError, match="stall_after must be a positive"):
            WarmRanks(num_processes=2, stall_after=bad)
        with pytest.raises(LaunchConfigError, match="stall_after must be a positive"):
            notebook_launcher(time.time, num_processes=2, stall_after=bad)


def rank_and_value() -> tuple:
    return dist.get_rank(), int(torch.ones(1).item())


def reduces() -> float:
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def test_a_call_on_some_ranks_runs_there_only_and_refuses_collectives(ranks):
    assert ranks.run(rank_and_value, ranks=[1]) == [(1, 1)]
    assert ranks.run(rank_and_value, ranks=(0, 1)) == [(0, 1), (1, 1)]
    begin = time.monotonic()
    with pytest.raises(RankFailedError, match=r"all_reduce\(\) needs every rank of the pool"):
        ranks.run(reduces, ranks=[0])
    assert time.monotonic() - begin < 5  # refused, never a hang
    assert ranks.run(reduces) == [2.0, 2.0]  # the group is whole for the next call
    for bad in ([2], [-1], [], "0", [0.5]):
        with pytest.raises(LaunchConfigError, match="0 to 1"):
            ranks.run(rank_and_value, ranks=bad)


def make_ddp() -> None:
    from nblaunch.training import Accelerator
    from nblaunch.worker import calls

    accelerator = Accelerator()
    calls.namespace["ddp"] = accelerator.prepare(torch.nn.Linear(4, 1))


def ddp_backward() -> float:
    from nblaunch.worker import calls

    loss = calls.namespace["ddp"](torch.ones(2, 4)).sum()
    loss.backward()
    return loss.item()


def ddp_evaluates() -> float:
    from nblaunch.worker import calls

    with torch.no_grad():
        return calls.namespace["ddp"](torch.ones(2, 4)).sum().item()


def test_a_ddp_backward_on_one_rank_is_refused_and_evaluation_is_not(ranks):
    ranks.run(make_ddp)
    begin = time.monotonic()
    with pytest.raises(RankFailedError, match=r"DistributedDataParallel model's backward .* needs every rank"):
        ranks.run(ddp_backward, ranks=[0])
    assert time.monotonic() - begin < 5
    assert len(ranks.run(ddp_evaluates, ranks=[1])) == 1
    first, second = ranks.run(ddp_backward)  # every rank: trains as before
    assert first == second
