"""WarmRanks with real processes and a real gloo group: state kept, calls fast, failures end the pool."""

from __future__ import annotations

import _thread
import os
import re
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from nblaunch import RankFailedError
from nblaunch.events import LaunchFinished, RankState, Stacks
from nblaunch.launch.errors import LaunchConfigError, LaunchInterrupted, LaunchTimeoutError
from nblaunch.warm.ranks import WarmRanks

KEPT: dict = {}  # in each rank: what earlier calls stored


def join_group() -> int:
    dist.init_process_group("gloo")
    KEPT["weights"] = torch.full((3,), float(dist.get_rank() + 1))
    return os.getpid()


def reduce_kept() -> list:
    total = KEPT["weights"].clone()
    dist.all_reduce(total)
    return total.tolist()


def pid() -> int:
    return os.getpid()


def say(word: str) -> None:
    print(f"{word} from rank {dist.get_rank()}", flush=True)


@pytest.fixture
def ranks():
    pool = WarmRanks(num_processes=2, display="none")
    yield pool
    pool.close()


def test_state_and_the_process_group_live_on_between_calls(ranks, recorder):
    pids = ranks.run(join_group)
    assert ranks.alive and len(set(pids)) == 2
    assert ranks.run(reduce_kept) == [[3.0, 3.0, 3.0]] * 2  # the group and the tensors of the first call
    assert ranks.run(pid) == pids  # the same processes
    ranks.run(say, "hello", display=recorder)
    assert recorder.lines(0) == ["hello from rank 0"] and recorder.lines(1) == ["hello from rank 1"]


def test_each_call_shows_only_its_own_output(ranks, recorder):
    ranks.run(join_group)
    first, second = recorder, type(recorder)()
    ranks.run(say, "one", display=first)
    ranks.run(say, "two", display=second)
    assert first.lines(1) == ["one from rank 1"] and second.lines(1) == ["two from rank 1"]


RANK_0_SLEEPS = 3.0  # past the 1 s after which a failed call releases the collectives of the others


def fails_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad shape on rank 1")
    time.sleep(RANK_0_SLEEPS)


def test_a_failure_is_the_calls_and_the_pool_keeps_its_state(ranks):
    old = ranks.run(join_group)
    begin = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        ranks.run(fails_on_rank_1)  # rank 0 sleeps on, outside any collective: it finishes by itself
    assert caught.value.root_cause.rank == 1 and "bad shape on rank 1" in str(caught.value)
    assert RANK_0_SLEEPS <= time.monotonic() - begin < RANK_0_SLEEPS + 10  # the call waited for rank 0's answer
    assert ranks.alive and ranks.run(pid) == old
    assert ranks.run(reduce_kept) == [[3.0, 3.0, 3.0]] * 2  # the group and the tensors of the first call


def raises_on_rank_1_while_rank_0_reduces() -> float:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 never joins")
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def test_a_collective_left_waiting_by_a_failed_rank_is_released_and_the_group_reformed(ranks):
    old = ranks.run(join_group)
    for _ in range(2):  # twice: a re-formed group can be released and re-formed again
        begin = time.monotonic()
        with pytest.raises(RankFailedError) as caught:
            ranks.run(raises_on_rank_1_while_rank_0_reduces)
        assert time.monotonic() - begin < 5
        assert caught.value.root_cause.rank == 1 and "rank 1 never joins" in str(caught.value)
        assert [f.rank for f in caught.value.failures] == [1, 0] and caught.value.failures[1].collateral
        assert ranks.run(pid) == old and ranks.run(reduce_kept) == [[3.0, 3.0, 3.0]] * 2
    log = ranks._launch.logs(1)  # the call's error is in the rank's log too, with its traceback
    assert "raised ---\nValueError: rank 1 never joins" in log and "raise ValueError" in log


def sleeps_in_a_call(flag: str) -> None:
    open(f"{flag}.{dist.get_rank()}", "w").close()
    time.sleep(60)


def test_a_timeout_shows_every_stack_and_ends_the_pool(ranks, recorder, tmp_path):
    ranks.run(join_group)
    begin = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as caught:
        ranks.run(sleeps_in_a_call, str(tmp_path / "f"), timeout=1.0, display=recorder)
    assert time.monotonic() - begin < 15
    assert sorted(caught.value.stacks) == [0, 1]
    assert all("in sleeps_in_a_call" in s for s in caught.value.stacks.values())
    assert {e.rank for e in recorder.of(Stacks) if e.why == "stop"} == {0, 1}
    assert not ranks.alive
    assert ranks.run(pid)  # a fresh pool


def interrupt_once_both_started(flag) -> None:
    def interrupt():
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{flag}.{r}") for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()


def test_an_interrupt_stops_the_call_where_it_is_and_keeps_the_pool(ranks, tmp_path):
    old = ranks.run(join_group)
    flag = tmp_path / "started"
    interrupt_once_both_started(flag)
    begin = time.monotonic()
    with pytest.raises(LaunchInterrupted, match="each rank stopped where it was"):
        ranks.run(sleeps_in_a_call, str(flag))  # no training steps: SIGINT where each rank is
    assert time.monotonic() - begin < 20 and ranks.alive
    assert ranks.run(pid) == old and ranks.run(reduce_kept) == [[3.0, 3.0, 3.0]] * 2


def make_ddp() -> None:
    from nblaunch.training import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    KEPT["ddp"] = (accelerator, *accelerator.prepare(model, optimizer))
    KEPT["steps"] = 0


def trains_for_ever(flag: str) -> None:
    accelerator, model, optimizer = KEPT["ddp"]
    open(f"{flag}.{dist.get_rank()}", "w").close()
    while True:
        loss = model(torch.randn(16, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        KEPT["steps"] += 1


def steps_and_weights() -> tuple:
    _, model, _ = KEPT["ddp"]
    return KEPT["steps"], [p.detach().clone() for p in model.parameters()]


def test_an_interrupt_in_a_ddp_loop_stops_every_rank_at_the_same_step_ten_times_out_of_ten(ranks, tmp_path):
    ranks.run(make_ddp)
    steps = 0
    for attempt in range(10):
        flag = tmp_path / f"started{attempt}"
        interrupt_once_both_started(flag)
        with pytest.raises(LaunchInterrupted, match="every rank stopped after") as stopped:
            ranks.run(trains_for_ever, str(flag))
        (steps_0, weights_0), (steps_1, weights_1) = ranks.run(steps_and_weights)
        assert steps_0 == steps_1 > steps, attempt  # the same step on both, and training went on
        said = int(re.search(r"stopped after (\d+) training steps", str(stopped.value))[1])
        assert said == steps_0 - steps, (attempt, str(stopped.value))  # the loop's own counter agrees
        assert all(torch.equal(a, b) for a, b in zip(weights_0, weights_1)), attempt
        steps = steps_0


def accumulates_one_micro_step() -> tuple:
    from nblaunch.training import Accelerator

    accelerator = KEPT.setdefault("accelerator", Accelerator(gradient_accumulation_steps=4))
    model = KEPT.setdefault("model", accelerator.prepare(torch.nn.Linear(2, 1)))
    before = (accelerator.gradient_state.step, accelerator.sync_gradients)
    with accelerator.accumulate(model):
        model(torch.ones(1, 2)).sum().backward()
    return before


def test_each_call_starts_with_a_clean_training_state(ranks):
    ranks.run(join_group)
    assert ranks.run(accumulates_one_micro_step) == [(0, True)] * 2
    # The accelerator and model stay, but the second call does not inherit a half-done window.
    assert ranks.run(accumulates_one_micro_step) == [(0, True)] * 2


def test_two_hundred_calls_leave_no_growth_of_fds_threads_or_memory(ranks):
    ranks.run(join_group)
    for _ in range(20):
        ranks.run(reduce_kept)
    workers = [psutil.Process(p) for p in ranks.run(pid)]
    here = psutil.Process()
    before = (here.num_fds(), threading.active_count(), [w.memory_info().rss for w in workers])
    begin = time.perf_counter()
    for _ in range(200):
        ranks.run(reduce_kept)
    per_call = (time.perf_counter() - begin) / 200
    after = (here.num_fds(), threading.active_count(), [w.memory_info().rss for w in workers])
    assert after[0] == before[0] and after[1] == before[1]
    assert all(b - a < 4 * 2**20 for a, b in zip(before[2], after[2])), (before[2], after[2])
    assert per_call < 0.5  # a backstop only; the benchmark measures speed


@pytest.mark.slow
def test_spawned_warm_ranks_keep_state_too():
    with WarmRanks(num_processes=2, start_method="spawn", display="none") as pool:
        pool.run(join_group)
        assert pool.run(reduce_kept) == [[3.0, 3.0, 3.0]] * 2
    assert not pool.alive
    with pytest.raises(LaunchConfigError, match="closed"):
        pool.run(pid)


def test_bad_input_is_refused_before_anything_starts():
    with pytest.raises(LaunchConfigError):
        WarmRanks(num_processes=0)
    pool = WarmRanks(num_processes=2, display="none")
    with pytest.raises(LaunchConfigError, match="timeout"):
        pool.run(pid, timeout=-1)
    with pytest.raises(LaunchConfigError, match="function"):
        pool.run(42)
    assert not pool.alive and repr(pool) == "<WarmRanks: 2 processes, not started>"


def new_accelerator_each_call() -> float:
    from nblaunch.training import Accelerator

    accelerator = Accelerator()
    total = torch.ones(1) * (accelerator.process_index + 1)
    return float(accelerator.reduce(total, "sum").item())


def test_a_new_accelerator_in_every_call_works_on_the_kept_group(ranks):
    assert ranks.run(new_accelerator_each_call) == [3.0, 3.0]
    assert ranks.run(new_accelerator_each_call) == [3.0, 3.0]


def test_notebook_launcher_runs_on_warm_ranks_when_given_them(ranks):
    from nblaunch import notebook_launcher

    pids = notebook_launcher(join_group, ranks=ranks)
    assert notebook_launcher(pid, ranks=ranks, display="none") == pids
    with pytest.raises(LaunchConfigError, match="num_processes=3"):
        notebook_launcher(pid, num_processes=3, ranks=ranks)
    with pytest.raises(LaunchConfigError, match="block=False"):
        notebook_launcher(pid, ranks=ranks, block=False)
    with pytest.raises(LaunchConfigError, match="WarmRanks"):
        notebook_launcher(pid, ranks="warm")


def test_a_one_rank_pool_works_and_reads_right():
    with WarmRanks(num_processes=1, display="none") as pool:
        first = pool.run(pid)
        assert pool.run(pid) == first and repr(pool) == "<WarmRanks: 1 process, up>"
    assert repr(pool) == "<WarmRanks: 1 process, closed>"


def test_a_rank_killed_between_calls_is_reported_by_the_next_call(ranks, capfd):
    import signal

    pids = ranks.run(pid)
    os.kill(pids[1], signal.SIGKILL)  # the out-of-memory killer, say, while no call runs
    with pytest.raises(RankFailedError, match="SIGKILL"):
        ranks._launch.result(timeout=60)  # wait for the pool to be over
    with pytest.raises(RankFailedError, match="rank 1 failed: killed by SIGKILL"):
        ranks.run(pid)
    assert "ended while no call ran" in capfd.readouterr().err
    assert set(ranks.run(pid)).isdisjoint(pids)
    assert "starting 2 fresh ones" in capfd.readouterr().err


def group_as_seen() -> tuple:
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def accelerator_as_seen() -> tuple:
    from nblaunch import Accelerator

    accelerator = Accelerator()
    return accelerator.num_processes, accelerator.process_index, accelerator.state.adopted_process_group


def asks_for(backend: str) -> None:
    dist.init_process_group(backend)


def test_the_ranks_are_a_process_group_from_the_first_call(ranks):
    assert ranks.run(group_as_seen) == [(0, 2, "gloo"), (1, 2, "gloo")]  # nobody called init_process_group
    ranks.run(asks_for, "gloo")  # code written for a launch: the pool's group answers it
    assert ranks.run(accelerator_as_seen) == [(2, 0, True), (2, 1, True)]  # adopted, not made again
    with pytest.raises(RankFailedError, match="already form a process group"):
        ranks.run(asks_for, "nccl")


def dies_in_the_call() -> None:
    import signal

    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_rank_that_dies_in_a_call_ends_the_pool_saying_so_and_the_next_call_starts_fresh(ranks, capfd):
    pids = ranks.run(pid)
    with pytest.raises(RankFailedError, match="rank 1 failed: killed by SIGKILL"):
        ranks.run(dies_in_the_call)
    assert "the warm ranks ended with this failure: what they held is gone" in capfd.readouterr().err
    fresh = ranks.run(pid)  # no options restated
    assert set(fresh).isdisjoint(pids) and "starting 2 fresh ones" in capfd.readouterr().err
    assert ranks.run(pid) == fresh and "fresh" not in capfd.readouterr().err  # said once


def loses_its_device() -> None:
    # What CUDA answers after a device-side assert: the check itself needs a GPU (the GPU lane
    # runs the real assert); here rank 1's check answers as it would there.
    from nblaunch.worker.warm import device_check

    if os.environ["RANK"] == "1":
        device_check.lost_device = lambda: "AcceleratorError: CUDA error: device-side assert triggered"
        raise RuntimeError("CUDA error: device-side assert triggered")


def test_a_rank_whose_gpu_no_longer_works_ends_the_pool_saying_why_and_the_next_call_starts_fresh(recorder, capfd):
    with WarmRanks(num_processes=2, display=recorder) as pool:
        pids = pool.run(pid)
        with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: CUDA error: device-side assert"):
            pool.run(loses_its_device)
        [summary] = [e.summary for e in recorder.of(LaunchFinished) if e.state == RankState.FAILED]
        assert ("rank 1's GPU no longer works in its process (AcceleratorError: CUDA error: device-side assert "
                "triggered), so the warm ranks were ended") in summary and "what they held is gone" in summary
        fresh = pool.run(pid)
        assert set(fresh).isdisjoint(pids)
        assert "the warm ranks had ended (rank 1's GPU no longer worked" in capfd.readouterr().err
        assert pool.run(pid) == fresh
