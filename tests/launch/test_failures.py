"""A failing rank: the others stop at once, and the error blames the right rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import nblaunch
from nblaunch import LaunchTimeoutError, RankFailedError, RemoteError, notebook_launcher
from nblaunch.events import Output, RankFinished, RankState, Stacks
from nblaunch.contract.failure import RemoteTraceback


def rank_one_raises_while_rank_zero_waits():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # never answered: rank 1 is gone
    return "unreachable"


def test_an_exception_in_rank_1_stops_rank_0_blocked_in_a_barrier(recorder):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(rank_one_raises_while_rank_zero_waits, num_processes=2, display=recorder)
    assert time.monotonic() - started < 5

    error = info.value
    assert error.root_cause.rank == 1
    assert str(error).startswith("rank 1 failed: ValueError: rank one is broken")
    original = error.__cause__
    assert type(original) is ValueError and str(original) == "rank one is broken"
    assert isinstance(original.__cause__, RemoteTraceback)
    assert "in rank_one_raises_while_rank_zero_waits" in original.__cause__.text
    assert 'raise ValueError("rank one is broken")' in original.__cause__.text
    states = {e.rank: e.state for e in recorder.of(RankFinished)}
    assert states[1] == RankState.FAILED
    assert states[0] in (RankState.STOPPED, RankState.FAILED)  # it may see the peer vanish first
    assert 0 not in error.ranks or error.failures[-1].rank == 0


def collective_then_rank_one_raises(round_):
    dist.init_process_group("gloo")
    for step in range(3):
        dist.all_reduce(torch.ones(1000))
    if dist.get_rank() == 1:
        raise RuntimeError(f"round {round_}: rank 1 fails")
    dist.all_reduce(torch.ones(1000))  # rank 0 gets a gloo error once rank 1 is gone
    return "unreachable"


def test_the_root_cause_is_blamed_every_time():
    for round_ in range(5):
        with pytest.raises(RankFailedError) as info:
            notebook_launcher(collective_then_rank_one_raises, args=(round_,), num_processes=2, display="none")
        assert info.value.root_cause.rank == 1, str(info.value)
        assert f"round {round_}: rank 1 fails" in info.value.root_cause.reason


def rank_one_is_killed():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_sigkill_is_not_blamed_on_the_out_of_memory_killer_the_machine_did_not_count():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(rank_one_is_killed, num_processes=2, display="none")
    root = info.value.root_cause
    assert root.rank == 1 and root.signal_name == "SIGKILL"
    assert root.reason.startswith("killed by SIGKILL (not by the out-of-memory killer: this machine's count"), root.reason


OUT_OF_MEMORY = """
import os
open(os.path.join({cgroup!r}, "cgroup.procs"), "w").write(str(os.getpid()))
open("/proc/self/oom_score_adj", "w").write("-1000")  # the ranks, not this process, are chosen
from nblaunch import RankFailedError, notebook_launcher

def hog():
    import time, torch
    if os.environ["RANK"] == "1":
        open("/proc/self/oom_score_adj", "w").write("1000")
        chunks = []
        while True:
            chunks.append(torch.ones(16 * 2**20))  # 64 MiB, written
    time.sleep(120)

try:
    notebook_launcher(hog, num_processes=2, display="none")
except RankFailedError as error:
    print("BLAMED", error.root_cause.rank, error.root_cause.reason)
"""


def test_a_rank_the_out_of_memory_killer_stopped_is_said_to_be(tmp_path):
    cgroup = _memory_limited_cgroup(1 << 30)
    try:
        done = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY.format(cgroup=cgroup)], capture_output=True,
                              text=True, timeout=180, cwd=tmp_path)
    finally:
        os.rmdir(cgroup)
    assert "BLAMED 1 killed by SIGKILL: the out-of-memory killer stopped it" in done.stdout, (done.stdout, done.stderr)


def _memory_limited_cgroup(limit: int) -> str:
    """A memory cgroup of its own (v1) with ``limit`` bytes, beside this process's; skip where
    this machine gives none (cgroup v2 only, or not root)."""
    with open("/proc/self/cgroup") as lines:
        own = next((line.split(":", 2)[2].strip() for line in lines if "memory" in line.split(":", 2)[1].split(",")),
                   None)
    parent = os.path.join("/sys/fs/cgroup/memory", (own or "").lstrip("/"))
    path = os.path.join(parent, f"nblaunch-oom-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as limit_file:
            limit_file.write(str(limit))
    except OSError as error:
        if os.path.isdir(path):
            os.rmdir(path)
        pytest.skip(f"no memory cgroup of its own can be made here ({error}): the out-of-memory kill needs one")
    return path


def rank_zero_exits():
    if os.environ["RANK"] == "0":
        print("about to leave", flush=True)
        os._exit(3)
    time.sleep(60)


def test_a_non_zero_exit_is_reported_with_the_last_lines_of_output():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(rank_zero_exits, num_processes=2, display="none")
    root = info.value.root_cause
    assert root.rank == 0 and root.exitcode == 3
    assert "exited with code 3" in str(info.value) and "about to leave" in str(info.value)


class Unrebuildable(Exception):
    def __init__(self, a, b):  # pickles as Unrebuildable(message), which then fails to rebuild
        super().__init__(f"{a}/{b}")


def raises_unrebuildable():
    raise Unrebuildable(1, 2)


def test_an_exception_that_cannot_be_rebuilt_keeps_its_name_and_message():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(raises_unrebuildable, num_processes=2, display="none")
    cause = info.value.__cause__
    assert isinstance(cause, RemoteError) and "Unrebuildable: 1/2" in str(cause)


def hangs_in_a_collective():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends
    else:
        time.sleep(600)


def test_timeout_shows_where_every_rank_was_and_stops_them(recorder):
    started = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(hangs_in_a_collective, num_processes=2, timeout=3, display=recorder)
    assert time.monotonic() - started < 3 + 5
    stacks = info.value.stacks
    assert "dist.recv(torch.zeros(1), src=1)" in stacks[0]
    assert "time.sleep(600)" in stacks[1]
    assert {e.rank for e in recorder.of(Stacks)} == {0, 1}
    assert [e.state for e in recorder.of(RankFinished)] == [RankState.STOPPED] * 2


def rank_one_holds_pythons_lock_in_c():
    import re

    if int(os.environ["RANK"]) == 1:
        re.match(r"(a+)+$", "a" * 40 + "b")  # backtracks for hours, never letting another thread run
    time.sleep(600)


@pytest.mark.slow
def test_a_rank_that_cannot_say_where_it_is_is_listed_and_faulthandler_shows_its_frames(recorder):
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(rank_one_holds_pythons_lock_in_c, num_processes=2, timeout=2, display=recorder)
    assert "time.sleep(600)" in info.value.stacks[0]
    assert info.value.stacks[1].startswith("(it did not answer within 2 s")
    assert "rank 1: (no stack)" in str(info.value)
    dumped = [line for e in recorder.of(Output) if e.rank == 1 and e.stream == "stderr" for line in e.lines]
    assert any("most recent call first" in line for line in dumped), dumped
    assert any("in rank_one_holds_pythons_lock_in_c" in line for line in dumped), dumped


def returns_a_generator():
    return (i for i in range(3))


def test_a_result_that_cannot_be_sent_back_is_a_clear_failure():
    with pytest.raises(RankFailedError, match="returned a generator that cannot be sent back"):
        notebook_launcher(returns_a_generator, num_processes=2, display="none")


def exits_cleanly():
    raise SystemExit(0)


def test_sys_exit_zero_is_a_clean_finish():
    assert notebook_launcher(exits_cleanly, num_processes=2, display="none") == [None, None]


def rendezvous_then_fail(fail):
    dist.init_process_group("gloo")
    dist.barrier()
    if fail and dist.get_rank() == 1:
        raise RuntimeError("first launch fails")
    dist.barrier()
    return dist.get_rank()


def test_a_failed_launch_whose_error_is_kept_does_not_poison_the_next_on_the_same_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kept = []  # as Jupyter keeps the last exception (and its traceback's frames) alive
    try:
        notebook_launcher(rendezvous_then_fail, args=(True,), num_processes=2, use_port=port, display="none")
    except RankFailedError as error:
        kept.append(error)
    assert kept and kept[0].root_cause.rank == 1
    for _ in range(3):
        assert notebook_launcher(rendezvous_then_fail, args=(False,), num_processes=2, use_port=port, display="none") == [0, 1]


class StallsWhileFormatted(Exception):
    """Formatting its traceback blocks, as a rank reading source files from a stalled disk did."""

    @property
    def __notes__(self):  # read by traceback.format_exception, not by str()
        time.sleep(600)


def rank_one_stalls_in_its_traceback():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise StallsWhileFormatted("rank one broke")
    dist.barrier()


def test_a_rank_stuck_formatting_its_traceback_still_fails_the_launch_at_once(recorder):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(rank_one_stalls_in_its_traceback, num_processes=2, display=recorder)
    assert time.monotonic() - started < 5  # the first report is enough; the traceback wait is bounded
    root = info.value.root_cause
    assert root.rank == 1
    assert root.reason == "StallsWhileFormatted: rank one broke (stopped before it could send its traceback)"
    assert {e.rank: e.state for e in recorder.of(RankFinished)} == {0: RankState.STOPPED, 1: RankState.FAILED}


def test_stacks_start_at_the_users_function_not_at_the_launchers_frames():
    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(hangs_in_a_collective, num_processes=2, timeout=2, display="none")
    main_thread = info.value.stacks[1].split("\n\n")[0]
    frames = [line for line in main_thread.splitlines() if line.lstrip().startswith("File ")]
    assert "in hangs_in_a_collective" in frames[0]  # nothing of pytest, the launcher or the fork before it
    package = os.path.dirname(os.path.abspath(nblaunch.__file__))  # (a clone may itself be named nblaunch)
    assert not any(package + os.sep in frame for frame in frames)


def every_rank_imports_a_missing_module():
    import nonexistent_module_for_blame  # noqa: F401


def test_when_ranks_fail_alike_the_rank_shown_failing_first_is_the_one_blamed():
    # Both ranks fail on the same line within a millisecond: which is "first" is a coin toss,
    # but the display's first failure, the summary and the error must name the same rank.
    from tests.conftest import Recorder
    from nblaunch.events import LaunchFinished

    for _ in range(25):
        recorder = Recorder()
        with pytest.raises(RankFailedError) as caught:
            notebook_launcher(every_rank_imports_a_missing_module, num_processes=2, display=recorder)
        # Usually both fail; under load one may be stopped before it gets that far.
        shown = [e.rank for e in recorder.of(RankFinished) if e.state == RankState.FAILED]
        assert shown and set(shown) <= {0, 1}
        (finished,) = recorder.of(LaunchFinished)
        assert caught.value.root_cause.rank == finished.root_cause_rank == shown[0]
        assert finished.summary.startswith(f"rank {shown[0]} failed")
        assert caught.value.ranks == shown
