"""Interrupts, a killed launcher, and ranks left behind by an earlier kernel."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from nblaunch import LaunchInterrupted, notebook_launcher, proctree
from nblaunch.events import LaunchFinished, RankFinished, RankStarted, RankState, Stacks
from nblaunch.launch import registry

from processes import gone

SCRIPTS = Path(__file__).parent / "scripts"


def start_blocked_ranks() -> tuple[subprocess.Popen, list[int]]:
    """Run the script in a session of its own, like a kernel, and wait for both ranks' pids."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "blocked_ranks.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    pids, seen = [], []
    for line in proc.stdout:
        seen.append(line)
        if match := re.search(r"ready pid=(\d+)", line):
            pids.append(int(match.group(1)))
        if len(pids) == 2:
            return proc, pids
    raise AssertionError("the ranks never got ready:\n" + "".join(seen))


def test_an_interrupt_of_the_whole_process_group_shows_stacks_then_stops_every_rank():
    proc, pids = start_blocked_ranks()
    os.killpg(proc.pid, signal.SIGINT)  # what a kernel interrupt may do
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    # One line per rank: where its own code was (the whole stack is in the rank's log).
    assert "[rank 0] stopped at " in out and "[rank 1] stopped at " in out
    assert ": dist.recv(torch.zeros(1), src=1) (whole stack: " in out and ": time.sleep(600) (whole stack: " in out
    assert "interrupted after" in out
    assert "launcher raised KeyboardInterrupt" in out
    assert "next launch: [0, 1]" in out  # the same process launches again
    assert gone(pids, within=5)


def block_until_stopped():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("ready", flush=True)
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    time.sleep(600)


class InterruptTwice:
    """A display that interrupts this process once every rank is ready, and again as the first
    stack comes in: while the launch is stopping on the first interrupt (Ctrl-C twice)."""

    def __init__(self, recorder):
        self.recorder, self.ready, self.again = recorder, set(), False

    def on_event(self, event):
        self.recorder.on_event(event)
        if getattr(event, "lines", None) and "ready" in event.lines:
            self.ready.add(event.rank)
            if len(self.ready) == 2:
                os.kill(os.getpid(), signal.SIGINT)
        if isinstance(event, Stacks) and not self.again:
            self.again = True
            os.kill(os.getpid(), signal.SIGINT)

    def close(self):
        pass


def test_an_interrupt_while_stopping_on_one_does_not_cut_the_report_short(recorder):
    raised = None
    try:
        notebook_launcher(block_until_stopped, num_processes=2, display=InterruptTwice(recorder), timeout=120)
    except KeyboardInterrupt as error:  # caught here: a bare one would end the whole test session
        raised = error
    assert isinstance(raised, LaunchInterrupted), f"{raised!r} escaped: the second interrupt cut the stop short"
    assert sorted(e.rank for e in recorder.of(Stacks)) == [0, 1]  # every rank's stack, not the first alone
    assert sorted(e.rank for e in recorder.of(RankFinished)) == [0, 1]
    assert {e.state for e in recorder.of(RankFinished)} == {RankState.STOPPED}


class InterruptAsTheRanksAreShown:
    """A display that is interrupted while it draws the ranks (a first widget takes a while)."""

    def __init__(self, recorder):
        self.recorder = recorder

    def on_event(self, event):
        self.recorder.on_event(event)
        if isinstance(event, RankStarted) and event.rank == 1:
            os.kill(os.getpid(), signal.SIGINT)

    def close(self):
        pass


def test_an_interrupt_while_the_display_draws_the_ranks_is_answered_like_any_other(recorder):
    raised = None
    try:
        notebook_launcher(block_until_stopped, num_processes=2, display=InterruptAsTheRanksAreShown(recorder))
    except KeyboardInterrupt as error:
        raised = error
    assert isinstance(raised, LaunchInterrupted), f"{raised!r} escaped the launch's own stop"
    assert {e.state for e in recorder.of(RankFinished)} == {RankState.STOPPED}
    assert sorted(e.rank for e in recorder.of(RankFinished)) == [0, 1]
    assert gone([e.pid for e in recorder.of(RankStarted)], within=5)


def test_an_interrupt_after_the_fork_before_the_watching_stops_every_rank(recorder, monkeypatch):
    # The moment between forking the ranks and watching them is short; an interrupt landing in
    # it (as a busy machine makes likely) is forced here, just after the launch is recorded.
    forked: list[int] = []
    save = registry.LaunchRecord.save

    def save_then_interrupted(record):
        save(record)
        forked.extend(pid for pid, _ in record.ranks)
        raise KeyboardInterrupt

    monkeypatch.setattr(registry.LaunchRecord, "save", save_then_interrupted)
    raised = None
    try:
        notebook_launcher(block_until_stopped, num_processes=2, display=recorder)
    except KeyboardInterrupt as error:
        raised = error
    assert isinstance(raised, LaunchInterrupted) and "while the ranks were starting" in str(raised), repr(raised)
    assert len(forked) == 2 and gone(forked, within=5)
    (finished,) = recorder.of(LaunchFinished)
    assert finished.state is RankState.STOPPED and "interrupted after" in finished.summary


def test_ranks_die_with_a_killed_launcher_even_inside_a_cpp_collective():
    proc, pids = start_blocked_ranks()
    killed_at = time.monotonic()
    proc.kill()
    proc.wait()
    assert gone(pids, within=5)
    print(f"ranks gone {time.monotonic() - killed_at:.3f} s after the launcher was killed")


def quick():
    return int(os.environ["RANK"])


def test_a_launch_stops_ranks_an_earlier_kernel_left_behind(capfd):
    stale = subprocess.Popen(["sleep", "600"], start_new_session=True)
    dead_launcher = subprocess.Popen(["true"])
    dead_launcher.wait()
    record = registry.LaunchRecord("stale-test", dead_launcher.pid, 29999, [(stale.pid, proctree.start_ticks(stale.pid))])
    record.save()
    try:
        assert notebook_launcher(quick, num_processes=2, display="none") == [0, 1]
        assert stale.wait(timeout=5) == -signal.SIGKILL
        assert f"stopped 1 stale process(es) (pids {stale.pid})" in capfd.readouterr().err
        assert not os.path.exists(record.path)
    finally:
        stale.kill()
        record.remove()


STARTS_A_SERVER = """
import os, subprocess, sys
import torch.distributed as dist
from nblaunch import LaunchInterrupted, notebook_launcher, proctree
from nblaunch.events import LaunchFinished, RankFinished, RankStarted, RankState, Stacks

def train(folder):
    server = subprocess.Popen(["sleep", "600"])  # e.g. a TensorBoard the training started
    with open(os.path.join(folder, os.environ["RANK"]), "w") as out:
        out.write(str(server.pid))
    dist.init_process_group("gloo")
    dist.barrier()  # both servers exist
    if dist.get_rank() == 0:
        os.kill(os.getppid(), 9)  # the kernel dies (a crash, or "restart kernel")
    server.wait()

notebook_launcher(train, args=(sys.argv[1],), num_processes=2, display="none")
"""


def test_what_a_rank_started_is_stopped_after_its_kernel_died(tmp_path, capfd):
    kernel = subprocess.run([sys.executable, "-c", STARTS_A_SERVER, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert kernel.returncode == -signal.SIGKILL, kernel.stdout + kernel.stderr
    servers = [int((tmp_path / rank).read_text()) for rank in ("0", "1")]
    assert all(psutil.pid_exists(pid) for pid in servers)  # the ranks died with the kernel; these did not
    notebook_launcher(quick, num_processes=2, display="none")
    assert gone(servers, within=5)
    assert "stale process(es)" in capfd.readouterr().err


def test_a_live_launch_of_another_process_is_left_alone():
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    record = registry.LaunchRecord("live-test", os.getppid(), 29998, [(other.pid, proctree.start_ticks(other.pid))])
    record.save()
    try:
        notebook_launcher(quick, num_processes=2, display="none")
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        record.remove()


MAIN_ON_STDIN = """
import os
from nblaunch import LaunchInterrupted, notebook_launcher, proctree
from nblaunch.events import LaunchFinished, RankFinished, RankStarted, RankState, Stacks

offset = 1000

def make(scale):
    def train(x):
        return offset + scale * x + int(os.environ["RANK"])
    return train

print("results", notebook_launcher(make(10), args=(2,), num_processes=2, start_method="spawn", display="none"))
"""


def test_spawn_runs_a_closure_defined_in_main_fed_on_stdin():
    done = subprocess.run([sys.executable, "-"], input=MAIN_ON_STDIN, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "results [1020, 1021]" in done.stdout
