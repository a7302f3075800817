"""``%%distributed`` with a kernel's manners, in a real Jupyter kernel on 2 CPU ranks: an error
keeps the state, an interrupt stops the cell and keeps it (10 times out of 10 in a DDP loop), a
stall names its rank, a cell may run on some ranks, and the hostile cases leave nothing behind."""

from __future__ import annotations

import re

import psutil
import pytest

from kernel_session import KernelSession

pytestmark = pytest.mark.slow

STALL_AFTER = 3


@pytest.fixture
def kernel(tmp_path):
    session = KernelSession(str(tmp_path))
    assert session.run("%load_ext nblaunch").error is None
    first = session.run(f"%%distributed -n 2 --cpu --display text --stall-after {STALL_AFTER}\n"
                        "import os, time, torch, torch.distributed as dist\n"
                        "state = torch.arange(3) * (int(os.environ['RANK']) + 1); pid = os.getpid()\n"
                        "pid")
    assert first.error is None, first.text
    session.pids = first.result
    yield session
    pids = [p for p in session.pids if psutil.pid_exists(p)]
    session.close()
    assert psutil.wait_procs([psutil.Process(p) for p in pids], timeout=30)[1] == []


def cell(code: str) -> str:
    return "%%distributed --display text\n" + code


def assert_state_kept(kernel) -> None:
    kept = kernel.run(cell("(pid, state.tolist())"))
    assert kept.error is None, kept.text
    assert kept.result == [(kernel.pids[0], [0, 1, 2]), (kernel.pids[1], [0, 2, 4])], kept.text
    assert "had ended" not in kept.text


def test_a_name_error_on_every_rank_keeps_the_pool_and_its_variables(kernel):
    failed = kernel.run(cell("print(undefined_name)"))
    assert failed.error[0] == "RankFailedError" and "NameError: name 'undefined_name' is not defined" in failed.error[1]
    assert "also failed" in failed.error[1]  # the other rank, in one line
    assert_state_kept(kernel)


def test_rank_1_raising_while_rank_0_waits_in_all_reduce_keeps_the_pool(kernel):
    failed = kernel.run(cell("if dist.get_rank() == 1:\n    raise ValueError('rank 1 only')\n"
                             "t = torch.ones(1)\ndist.all_reduce(t)"))
    assert failed.error[0] == "RankFailedError" and failed.error[1].startswith("rank 1 failed: ValueError: rank 1 only")
    assert failed.took < 5, failed.took
    assert_state_kept(kernel)
    reduced = kernel.run(cell("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"))
    assert reduced.result == [2.0, 2.0], reduced.text  # the re-formed group


def test_an_interrupt_in_a_ddp_loop_stops_every_rank_at_the_same_step_ten_times_out_of_ten(kernel):
    made = kernel.run(cell("from nblaunch import Accelerator\naccelerator = Accelerator()\ntorch.manual_seed(0)\n"
                           "model = torch.nn.Linear(8, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n"
                           "model, optimizer = accelerator.prepare(model, optimizer)\nsteps = 0"))
    assert made.error is None, made.text
    done = 0
    for attempt in range(10):
        flag = f"training{attempt}"
        interrupted = kernel.run(cell(
            f"open(f'{flag}.{{dist.get_rank()}}', 'w').close()\n"
            "while True:\n"
            "    loss = model(torch.randn(16, 8)).pow(2).mean()\n"
            "    accelerator.backward(loss)\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n"
            "    steps += 1"), interrupt_when=[f"{flag}.0", f"{flag}.1"])
        assert interrupted.error is not None and interrupted.error[0] == "LaunchInterrupted", (attempt, interrupted.text)
        said = re.search(r"every rank stopped after (\d+) training steps of this cell", interrupted.error[1])
        assert said, interrupted.error
        after = kernel.run(cell("(steps, [p.detach().sum().item() for p in model.parameters()])"))
        (steps_0, weights_0), (steps_1, weights_1) = after.result
        assert steps_0 == steps_1 > done and weights_0 == weights_1, (attempt, after.result)
        assert int(said[1]) == steps_0 - done, (attempt, interrupted.error)  # the cell's own counter agrees
        done = steps_0
    went_on = kernel.run(cell("for _ in range(3):\n    accelerator.backward(model(torch.randn(4, 8)).sum())\n"
                              "    optimizer.step()\n    optimizer.zero_grad()\n    steps += 1\nsteps"))
    assert went_on.result == [done + 3, done + 3]


def test_a_stall_is_named_within_stall_after_and_5_s_and_nothing_is_stopped(kernel):
    stalled = kernel.run(cell("if dist.get_rank() == 1:\n    time.sleep(12)\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"))
    assert stalled.error is None and stalled.result == [2.0, 2.0], stalled.text  # nothing was stopped
    said = [(when, text) for when, text in stalled.lines_at if "nblaunch: stalled" in text]
    assert said, stalled.text
    when, text = said[0]
    assert when < STALL_AFTER + 5, (when, text)
    assert "rank 0 waits in all_reduce" in text and "rank 1 is elsewhere" in text and "time.sleep(12)" in text, text
    assert "progress again" in stalled.text


def test_a_cell_on_one_rank_sees_its_state_and_refuses_collectives(kernel):
    one = kernel.run(cell_on("--rank 1", "(pid, state.tolist())"))
    assert one.result == [(kernel.pids[1], [0, 2, 4])], one.text
    refused = kernel.run(cell_on("--rank 0", "dist.all_reduce(state)"))
    assert refused.error[0] == "RankFailedError" and "needs every rank of the pool" in refused.error[1]
    bad = kernel.run(cell_on("--rank 5", "pid"))
    assert bad.error[0] == "LaunchConfigError" and "0 to 1" in bad.error[1]
    assert_state_kept(kernel)


def cell_on(options: str, code: str) -> str:
    return f"%%distributed --display text {options}\n{code}"


def test_hostile_a_thread_that_raises_twice_interrupted_and_a_checkpoint_save_interrupted(kernel):
    threaded = kernel.run(cell("import threading\nworker = threading.Thread(target=lambda: 1 / 0)\n"
                               "worker.start()\nworker.join()\n'after the thread'"))
    assert threaded.result == ["after the thread"] * 2 and "ZeroDivisionError" in threaded.text
    for attempt in range(3):
        twice = kernel.run(cell(f"open(f'twice{attempt}.{{dist.get_rank()}}', 'w').close()\ntime.sleep(60)"),
                           interrupt_when=[f"twice{attempt}.0", f"twice{attempt}.1"], interrupts=2)
        assert twice.error[0] == "LaunchInterrupted" and twice.took < 15, (twice.error, twice.took)
        assert_state_kept(kernel)
    made = kernel.run(cell("from nblaunch import Accelerator\naccelerator = Accelerator()\n"
                           "model, optimizer = accelerator.prepare(torch.nn.Linear(8, 1), torch.optim.SGD("
                           "torch.nn.Linear(8, 1).parameters(), lr=0.1))\nsteps = 0"))
    assert made.error is None, made.text
    saving = kernel.run(cell("open(f'saving.{dist.get_rank()}', 'w').close()\nwhile True:\n"
                             "    accelerator.save_state('checkpoint')\n    accelerator.backward(model(torch.ones(2, 8)).sum())\n"
                             "    optimizer.step()\n    optimizer.zero_grad()\n    steps += 1"),
                        interrupt_when=["saving.0", "saving.1"])
    assert saving.error[0] == "LaunchInterrupted", saving.text
    resumed = kernel.run(cell("accelerator.load_state('checkpoint')\nsteps"))
    assert resumed.error is None and resumed.result[0] == resumed.result[1], resumed.text
    assert_state_kept(kernel)


def test_hostile_a_rank_that_ignores_sigint_ends_the_pool_saying_so_and_leaves_nothing(kernel):
    ignoring = kernel.run(cell("import signal\nif dist.get_rank() == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                               "open(f'ignoring.{dist.get_rank()}', 'w').close()\ntime.sleep(120)"),
                          interrupt_when=["ignoring.0", "ignoring.1"])
    assert ignoring.error[0] == "LaunchInterrupted", ignoring.error
    assert "rank 1 did not come back" in ignoring.error[1], ignoring.error
    assert ignoring.took < 30
    gone = psutil.wait_procs([psutil.Process(p) for p in kernel.pids if psutil.pid_exists(p)], timeout=30)[1]
    assert gone == [], "the ranks of the ended pool were left behind"
    fresh = kernel.run(cell("import os, torch, torch.distributed as dist\nos.getpid()"))
    assert fresh.error is None and "starting 2 fresh ones" in fresh.text, fresh.text
    kernel.pids = fresh.result
    assert kernel.run(cell("state = torch.arange(3) * (dist.get_rank() + 1); pid = os.getpid()")).error is None


def test_after_a_rank_is_killed_a_cell_restating_its_options_gets_one_pool_that_lasts(kernel):
    killed = kernel.run(cell_on("--rank 1", "os.kill(os.getpid(), 9)"))
    assert killed.error is not None and "SIGKILL" in killed.error[1], killed.error
    restated = kernel.run(f"%%distributed -n 2 --cpu --display text --stall-after {STALL_AFTER}\n"
                          "import os, time, torch, torch.distributed as dist\ny = 5\nos.getpid()")
    assert restated.error is None, restated.text
    kept = kernel.run(cell("('y' in dir(), os.getpid())"))
    assert kept.result == [(True, p) for p in restated.result], (restated.text, kept.text)
    kernel.pids = restated.result
    assert kernel.run(cell("state = torch.arange(3) * (dist.get_rank() + 1); pid = os.getpid()")).error is None


def test_an_interrupt_while_the_ranks_start_leaves_nothing_and_the_next_cell_works(kernel, tmp_path):
    stopped = kernel.run("%distributed stop")
    assert stopped.error is None
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    starting = kernel.run("%%distributed -n 2 --cpu --display text\nimport os\nos.getpid()", interrupt_after=0.2)
    assert starting.error is None or "Interrupt" in starting.error[0], starting.error
    started = kernel.run(f"%%distributed -n 2 --cpu --display text --stall-after {STALL_AFTER}\n"
                         "import os, time, torch, torch.distributed as dist\n"
                         "state = torch.arange(3) * (int(os.environ['RANK']) + 1); pid = os.getpid()\npid")
    assert started.error is None, started.text
    kernel.pids = started.result
    assert_state_kept(kernel)
    assert re.search(r"\[\d+, \d+\]", started.value or "")
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.pid not in kernel.pids and p.name().startswith("nblaunch-r")]


def test_a_rank_cell_before_any_pool_says_to_start_one(tmp_path):
    session = KernelSession(str(tmp_path))
    try:
        session.run("%load_ext nblaunch")
        refused = session.run("%%distributed --rank 0\n1")
        assert refused.error[0] == "LaunchConfigError" and "start them first" in refused.error[1]
        bad = session.run("%%distributed --stall-after -1\n1")
        assert bad.error[0] == "LaunchConfigError" and "stall_after must be a positive" in bad.error[1]
        worse = session.run("%%distributed --stall-after soon\n1")
        assert worse.error[0] == "LaunchConfigError" and "--stall-after" in worse.error[1]
        assert "nblaunch-r" not in " ".join(p.name() for p in psutil.Process().children(recursive=True))
    finally:
        session.close()
