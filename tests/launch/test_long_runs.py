"""Long runs that stop and pick up again: an interrupt saves every rank's work at one common step,
``resume=`` continues it to the weights an uninterrupted run ends with, a half-written checkpoint
is refused, and ``find_executable_batch_size`` picks one size for every rank. Real ranks, a real
gloo group, real scripts sent SIGINT."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import nblaunch
from nblaunch.launch.errors import LaunchConfigError, LaunchTimeoutError, RankFailedError

SCRIPT = Path(__file__).parent / "scripts" / "long_run.py"
EPOCHS_SCRIPT = Path(__file__).parent / "scripts" / "epoch_run.py"


def run(command: list[str], state: Path) -> subprocess.CompletedProcess:
    """``command`` to its end, with nblaunch's state (the launch's own checkpoints) under ``state``."""
    return subprocess.run(command, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, NBLAUNCH_STATE_DIR=str(state)))


def run_script(project: Path, *options: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    project.mkdir(exist_ok=True)
    return run([sys.executable, str(script), str(project), *options], project.parent / "state")


def same_weights(a: Path, b: Path) -> bool:
    first, second = torch.load(a / "weights.pt"), torch.load(b / "weights.pt")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def interrupt_then_resume(tmp_path: Path, *options: str, stop_at: int = 15) -> tuple[str, str]:
    stopped = run_script(tmp_path / "stopped", "--stop-at", str(stop_at), *options)
    assert stopped.returncode == 130, stopped.stdout + stopped.stderr
    said = stopped.stdout + stopped.stderr
    found = re.search(r"every rank stopped after (\d+) training steps and saved its state in (\S+);", said)
    assert found, said
    steps, folder = int(found[1]), found[2]
    # The step the interrupt found, or one soon after (steps after it take 50 ms: a quarter second
    # for a loaded machine to schedule the launcher), and the same one on every rank.
    assert stop_at <= steps <= stop_at + 5
    assert folder == str(tmp_path / "stopped" / "checkpoints" / "checkpoint_0")
    for rank in (0, 1):  # every rank says the same step and folder
        assert f"[rank {rank}] stopped: stopped after {steps} training steps; its state is saved in {folder}" in said
    resumed = run_script(tmp_path / "stopped", "--resume", *options)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"STEPS [{40 - steps}, {40 - steps}]" in resumed.stdout  # only the steps left
    whole = run_script(tmp_path / "whole", *options)
    assert "STEPS [40, 40]" in whole.stdout, whole.stderr
    assert same_weights(tmp_path / "stopped", tmp_path / "whole")  # bitwise, on the CPU
    return folder, said


def test_sigint_to_a_script_saves_at_one_step_and_a_new_process_resumes_to_the_uninterrupted_weights(tmp_path):
    interrupt_then_resume(tmp_path)


@pytest.mark.slow
def test_the_same_through_fsdp(tmp_path):
    folder, _ = interrupt_then_resume(tmp_path, "--fsdp")
    assert os.path.isdir(os.path.join(folder, "pytorch_model_fsdp_0"))  # FSDP's own sharded layout


def test_with_gradient_accumulation_the_stop_finishes_the_window_and_resumes_to_the_same_weights(tmp_path):
    # A stop inside a window would lose the gradients it accumulated, and the weights would differ.
    _, said = interrupt_then_resume(tmp_path, "--accumulate", "4", stop_at=13)  # the step agreed is inside one
    steps = int(re.search(r"every rank stopped after (\d+) training steps", said)[1])
    assert steps % 4 == 0, said  # at a window's end


def test_a_second_interrupt_while_saving_stops_at_once_and_the_unfinished_checkpoint_is_refused(tmp_path):
    script = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "--stop-at", "15", "--endless-save"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, NBLAUNCH_STATE_DIR=str(tmp_path / "state")))
    said = []
    for line in script.stdout:  # until the launcher says the ranks save: then press again
        said.append(line)
        if "saving their state in" in line:
            script.send_signal(signal.SIGINT)
            break
    began = time.monotonic()
    rest, _ = script.communicate(timeout=60)
    said = "".join(said) + rest
    assert script.returncode == 130, said
    assert time.monotonic() - began < 20, said  # at once: not after the save
    assert "interrupted again: the checkpoint under way was not finished (it is incomplete, and resume= refuses it)" \
        in said
    resumed = run_script(tmp_path, "--resume")
    assert resumed.returncode != 0 and "its save did not finish" in resumed.stderr, resumed.stderr


def evaluations(said: str) -> list[tuple[int, str]]:
    return [(int(epoch), loss) for epoch, loss in re.findall(r"\[rank 0\] EVAL (\d+) (\S+)", said)]


def test_a_stop_at_an_epochs_last_step_lets_the_end_of_epoch_code_run_first(tmp_path):
    """Every step is an epoch's last, with an evaluation over another prepared loader after it:
    each epoch is evaluated once, by the stopped run or the resumed one, as the uninterrupted run does."""
    stopped = run_script(tmp_path / "stopped", "--stop-at", "12", script=EPOCHS_SCRIPT)
    assert stopped.returncode == 130, stopped.stdout + stopped.stderr
    assert "saved its state in" in stopped.stderr, stopped.stderr
    resumed = run_script(tmp_path / "stopped", "--resume", script=EPOCHS_SCRIPT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    whole = run_script(tmp_path / "whole", script=EPOCHS_SCRIPT)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert [epoch for epoch, _ in evaluations(whole.stdout)] == list(range(30))
    assert evaluations(stopped.stdout) + evaluations(resumed.stdout) == evaluations(whole.stdout)
    assert same_weights(tmp_path / "stopped", tmp_path / "whole")


TERMINAL_SCRIPT = """
import os, signal, sys, time
import torch
from nblaunch import Accelerator
from nblaunch.utils import ProjectConfiguration

accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.arange(160.0).reshape(40, 4), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
steps = 0
for batch in loader:
    accelerator.backward(model(batch).mean())
    optimizer.step()
    optimizer.zero_grad()
    steps += 1
    if steps == 4 and "--stop" in sys.argv and accelerator.is_main_process:
        os.kill(os.getppid(), signal.SIGINT)  # Ctrl-C to nblaunch launch
    if "--stop" in sys.argv and steps >= 4:
        time.sleep(0.05)  # a slower step's stand-in: the interrupt finds the ranks training
print(f"STEPS {steps}")
"""


def test_nblaunch_launch_keeps_the_work_on_ctrl_c_and_resume_goes_on(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TERMINAL_SCRIPT)
    project = str(tmp_path / "project")
    command = [sys.executable, "-m", "nblaunch", "launch", "--num-processes", "2", "--cpu"]
    state = tmp_path / "state"
    stopped = run(command + [str(script), project, "--stop"], state)
    assert stopped.returncode == 130, stopped.stdout + stopped.stderr
    found = re.search(r"every rank stopped after (\d+) training steps and saved its state in (\S+);.*--resume",
                      stopped.stderr)
    assert found, stopped.stderr
    resumed = run(command + ["--resume", str(script), project], state)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {found[2]}" in resumed.stderr
    left = 10 - int(found[1])  # 40 rows, 2 a batch, 2 ranks: 10 steps in all
    assert re.findall(r"\[rank \d\] STEPS (\d+)", resumed.stdout) == [str(left)] * 2, resumed.stdout
    again = run(command + ["--resume-from", found[2], str(script), project], state)  # the same folder, named
    assert re.findall(r"\[rank \d\] STEPS (\d+)", again.stdout) == [str(left)] * 2, again.stdout + again.stderr
    refused = run(command + ["--resume-from", str(tmp_path / "nowhere"), str(script), project], state)
    assert refused.returncode == 2 and "no such folder" in refused.stderr, refused.stderr


def save_at_step_5(project_dir):
    from nblaunch import Accelerator
    from nblaunch.utils import ProjectConfiguration

    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project_dir,
                                                                  automatic_checkpoint_naming=True))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(40, 4), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    for batch in loader:
        steps += 1
        accelerator.backward(model(batch).sum())
        optimizer.step()
        if steps == 5 and os.environ.get("NBLAUNCH_RESUME") is None:
            accelerator.save_state()
            return steps
    return steps


def test_a_checkpoint_with_a_file_missing_is_refused_before_any_step(tmp_path):
    assert nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=2, display="none") == [5, 5]
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    os.remove(folder / "optimizer.bin")
    with pytest.raises(LaunchConfigError, match="missing optimizer.bin"):  # a named folder: before any process
        nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=2, resume=str(folder))
    with pytest.raises(RankFailedError, match=r"incomplete \(missing optimizer.bin\)") as failed:
        nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=2, display="none",
                                   resume=True)
    # Refused at the loop, before step 1 (every rank raises there; under load the launcher may stop one
    # before its traceback is sent, so any rank's traceback will do).
    assert any("for batch in loader" in (f.traceback or "") for f in failed.value.failures), failed.value
    shutil.rmtree(tmp_path / "checkpoints")  # next: a folder the kernel died in the middle of writing (no record)
    assert nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=2, display="none") == [5, 5]
    os.remove(folder / "nblaunch_complete.json")
    with pytest.raises(RankFailedError, match="its save did not finish"):
        nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=2, display="none",
                                   resume=True)


def test_another_number_of_processes_is_refused_before_any_process_starts(tmp_path):
    nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=2, display="none")
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    with pytest.raises(LaunchConfigError, match="saved by 2 processes and this launch starts 1"):
        nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=1, resume=str(folder))
    with pytest.raises(LaunchConfigError, match="resume must be True"):
        nblaunch.notebook_launcher(save_at_step_5, args=(str(tmp_path),), num_processes=2, resume=3)


def steps_slowly(project_dir, steps=100_000):
    from nblaunch import Accelerator

    accelerator = Accelerator(project_dir=project_dir)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.resume():  # a resumed run says where it came from, then takes a few steps
        return "resumed", accelerator.unwrap_model(model).weight.detach().clone()
    for step in range(steps):
        accelerator.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        if step == 20:
            print("20 steps taken", flush=True)
        time.sleep(0.01)  # a long step's stand-in, not a synchronisation


@pytest.mark.slow
def test_a_timeout_while_the_ranks_take_steps_keeps_their_work(tmp_path):
    with pytest.raises(LaunchTimeoutError) as timed_out:
        nblaunch.notebook_launcher(steps_slowly, args=(str(tmp_path),), num_processes=2, display="none", timeout=4)
    kept = timed_out.value.kept
    assert kept is not None and kept.steps > 10 and kept.checkpoint == str(tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "nblaunch_complete.json").exists()


@pytest.mark.slow
def test_cancel_keeps_the_work_and_without_a_project_dir_the_launchs_own_folder_takes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_STATE_DIR", str(tmp_path / "state"))
    launch = nblaunch.notebook_launcher(steps_slowly, args=(None,), num_processes=2, display="none", block=False)
    deadline = time.monotonic() + 60
    while launch.status in ("starting", "running") and "20 steps taken" not in (launch.logs(0) if launch.ranks else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)  # polling the log
    launch.cancel()
    with pytest.raises(nblaunch.LaunchCancelledError) as cancelled:
        launch.result(timeout=60)
    folder = cancelled.value.kept.checkpoint
    assert folder == str(tmp_path / "state" / "runs" / "steps_slowly" / "checkpoints" / "checkpoint_0")


def log_of(launch, rank: int) -> str:
    try:
        return launch.logs(rank)
    except FileNotFoundError:  # not written yet
        return ""


@pytest.mark.slow
def test_a_detached_launch_keeps_the_work_for_whoever_attaches_and_resumes_detached(tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_STATE_DIR", str(tmp_path / "state"))
    project = str(tmp_path / "project")
    launch = nblaunch.notebook_launcher(steps_slowly, args=(project,), num_processes=2, display="none", detach=True)
    deadline = time.monotonic() + 60
    while "20 steps taken" not in log_of(launch, 0):
        assert time.monotonic() < deadline, launch.status
        time.sleep(0.05)  # polling the log
    launch.cancel()
    with pytest.raises(nblaunch.LaunchCancelledError) as cancelled:
        launch.result(timeout=60)
    with pytest.raises(nblaunch.LaunchCancelledError) as seen_by_another:
        nblaunch.attach().result(timeout=10)  # as a kernel after a restart sees it
    for error in (cancelled.value, seen_by_another.value):
        assert error.kept is not None and error.kept.steps > 20, error
        assert error.kept.checkpoint == os.path.join(project, "checkpoint")
    from safetensors.torch import load_file

    saved = load_file(os.path.join(project, "checkpoint", "model.safetensors"))["weight"]
    resumed = nblaunch.notebook_launcher(steps_slowly, args=(project,), num_processes=2, display="none",
                                         detach=True, resume=True).result(timeout=120)
    assert [word for word, _ in resumed] == ["resumed", "resumed"]
    assert all(torch.equal(weights, saved) for _, weights in resumed)  # what the stop saved, on every rank


class SlowToDescribe(RuntimeError):
    """An error whose report takes a while to write (its message is read from a slow disk, say)."""

    def __str__(self) -> str:
        time.sleep(0.2)
        return super().__str__()


def search_batch_size(error: str = "CUDA out of memory. Tried to allocate 2.00 GiB", fits: int = 64,
                      slow_to_describe: bool = False):
    from nblaunch import Accelerator
    from nblaunch.utils import find_executable_batch_size

    accelerator = Accelerator()
    tried = []

    @find_executable_batch_size(starting_batch_size=256)
    def inner(batch_size):
        tried.append(batch_size)
        accelerator.free_memory()
        data = torch.randn(1024, 8)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for i, batch in enumerate(loader):
            out = model(batch)
            if accelerator.process_index == 1 and batch_size > fits and i == 1:  # after one all-reduce
                raise (SlowToDescribe if slow_to_describe else RuntimeError)(error)
            accelerator.backward(out.sum())
            optimizer.step()
        return batch_size

    return inner(), tried


def test_find_executable_batch_size_makes_every_rank_retry_the_same_size_together(capfd):
    began = time.monotonic()
    results = nblaunch.notebook_launcher(search_batch_size, num_processes=2, display="text")
    assert results == [(64, [256, 128, 64]), (64, [256, 128, 64])]  # no rank on another size
    assert time.monotonic() - began < 30  # rank 0 waited in the all-reduce of 256: it was let go, no hang
    said = capfd.readouterr()
    said = said.out + said.err
    assert "out of memory at batch size 256 on rank 1: every rank retries with 128" in said
    assert "every rank trained with batch size 64 (tried 256, 128, 64)" in said


@pytest.mark.parametrize("slow_to_describe", [False, True], ids=["plain", "slow_to_describe"])
def test_another_error_during_the_search_ends_the_launch_at_once_naming_its_rank(slow_to_describe):
    # Slow to describe: rank 1's report comes late, and rank 0, which loses its peer in the
    # all-reduce, must not be blamed first (CI saw it named when rank 1 let go of the group first).
    began = time.monotonic()
    with pytest.raises(RankFailedError, match="a bug of the user's") as failed:
        nblaunch.notebook_launcher(search_batch_size, args=("a bug of the user's", 64, slow_to_describe),
                                   num_processes=2, display="none")
    assert time.monotonic() - began < 30  # rank 0 waited in the all-reduce of 256: let go, no hang
    assert failed.value.root_cause.rank == 1, failed.value


def test_a_search_that_needs_more_sizes_than_a_launch_can_try_says_where_to_start():
    with pytest.raises(RankFailedError, match=r"every size it tried \(256, 128, 64, 32, 16\).*starting_batch_size=8"):
        nblaunch.notebook_launcher(search_batch_size, args=("CUDA out of memory.", 4), num_processes=2, display="none")
