"""cluster="slurm" on a real Slurm of two nodes (``conftest.slurm``): a program in an allocation
(``salloc ... python``, as a kernel started inside a job is) and one outside it (a login node)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("nothing_left_in_slurm")]


def run_program(slurm, tmp_path: Path, body: str, salloc: list[str] | None = None, timeout: float = 240):
    """Run ``body`` (it sets ``result``) as a program: in an allocation of ``salloc``'s options,
    or outside one. Returns (result, everything it printed)."""
    script = tmp_path / "program.py"
    script.write_text("import json\nfrom nblaunch import notebook_launcher\n" + textwrap.dedent(body)
                      + "\nprint('RESULT ' + json.dumps(result), flush=True)\n")
    command = [sys.executable, str(script)]
    if salloc is not None:
        command = ["salloc", *salloc, *command]
    environ = slurm.environ()
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    shown = done.stdout + done.stderr
    results = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"the program printed no result (exit {done.returncode}):\n{shown}"
    return json.loads(results[-1]), shown


WHO_AM_I = """
def who_am_i():
    import os
    import torch.distributed as dist
    import torch
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    slurm = sorted(k for k in os.environ if k.startswith("SLURM_"))
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": int(t), "node": os.environ["NODE_RANK"],
           "slurmd_node": os.environ.get("SLURMD_NODENAME"), "slurm_vars": slurm}
    dist.destroy_process_group()
    return out
"""


def test_inside_an_allocation_one_call_with_no_arguments_uses_every_node(slurm, tmp_path):
    result, shown = run_program(slurm, tmp_path, WHO_AM_I + """
result = notebook_launcher(who_am_i, cluster="slurm", display="text")
""", salloc=["-N2", "--ntasks-per-node=2"])
    assert [r["rank"] for r in result] == [0, 1, 2, 3], shown
    assert {r["world"] for r in result} == {4} and {r["sum"] for r in result} == {6}
    assert [r["node"] for r in result] == ["0", "0", "1", "1"]
    # Only the job's own variables reach a rank: none of the agent's task (SLURM_PROCID, SLURM_NTASKS).
    for r in result:
        assert "SLURM_PROCID" not in r["slurm_vars"] and "SLURM_NTASKS" not in r["slurm_vars"], r["slurm_vars"]
        assert "SLURM_JOB_ID" in r["slurm_vars"]
    assert "placed ranks 0-1 on" in shown and "ranks 2-3 on" in shown, shown
    assert "2 Slurm nodes" in shown or "2 nodes of Slurm job" in shown, shown


def test_num_nodes_and_num_processes_narrow_the_allocation(slurm, tmp_path):
    result, shown = run_program(slurm, tmp_path, WHO_AM_I + """
result = notebook_launcher(who_am_i, cluster="slurm", num_nodes=1, num_processes=1, display="none")
""", salloc=["-N2", "--ntasks-per-node=2"])
    assert [(r["rank"], r["world"]) for r in result] == [(0, 1)], shown


def test_asking_for_more_nodes_than_the_allocation_holds_is_refused_before_anything_starts(slurm, tmp_path):
    result, shown = run_program(slurm, tmp_path, """
from nblaunch import LaunchConfigError
try:
    notebook_launcher(print, cluster="slurm", num_nodes=3, display="none")
    result = "launched"
except LaunchConfigError as error:
    result = str(error)
""", salloc=["-N2", "--ntasks-per-node=1"])
    assert "num_nodes=3" in result and "holds 2 nodes (nbl1, nbl2)" in result, result
    assert not slurm.steps()


def test_outside_an_allocation_the_launch_asks_for_one_and_gives_it_back(slurm, tmp_path):
    result, shown = run_program(slurm, tmp_path, WHO_AM_I + """
result = notebook_launcher(who_am_i, cluster="slurm", num_nodes=2, num_processes=2,
                           resources={"time": "10"}, display="text")
""")
    assert [r["rank"] for r in result] == [0, 1, 2, 3], shown
    assert sorted({r["slurmd_node"] for r in result}) == ["nbl1", "nbl2"], result
    assert "a new Slurm allocation (--time=10)" in shown, shown
    # The job it asked for ended with the launch (squeue: nothing_left_in_slurm), and Slurm's
    # accounting says it completed, not that it was cancelled or ran out of time.
    wait_until(lambda: _accounted(slurm), 30)
    latest = max(_accounted(slurm).items(), key=lambda job: int(job[0]))
    assert latest[1] == "COMPLETED", _accounted(slurm)


def test_a_job_in_the_queue_is_shown_waiting_until_it_starts(slurm, tmp_path):
    blocker = slurm.run(["sbatch", "--parsable", "-N2", "--exclusive", "--job-name=blocker", "--output=/dev/null", "--wrap",
                         "sleep 300"]).stdout.strip()
    program = tmp_path / "waits.py"
    program.write_text(textwrap.dedent("""
        from nblaunch import notebook_launcher
        print("RESULT", notebook_launcher(lambda: 7, cluster="slurm", num_processes=1, display="text"), flush=True)
    """))
    environ = slurm.environ()
    environ["PYTHONPATH"] = str(ROOT)
    waiting = subprocess.Popen([sys.executable, str(program)], env=environ, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines = []
    try:
        for line in waiting.stdout:  # the program says the job waits before anything runs
            lines.append(line)
            if "waiting in the queue" in line:
                break
        assert any("waiting in the queue (" in line for line in lines), "".join(lines)
        slurm.run(["scancel", blocker])
        rest, _ = waiting.communicate(timeout=180)
    finally:
        waiting.kill()
    assert "RESULT [7]" in rest, "".join(lines) + rest


def test_a_failing_rank_on_the_second_node_is_named_and_nothing_is_left(slurm, tmp_path):
    result, shown = run_program(slurm, tmp_path, """
import time
from nblaunch import RankFailedError

def fails_on_rank_3():
    import os
    if os.environ["RANK"] == "3":
        raise ValueError("rank 3 cannot go on")
    time.sleep(600)

try:
    notebook_launcher(fails_on_rank_3, cluster="slurm", display="none")
    result = "no failure"
except RankFailedError as error:
    result = {"rank": error.root_cause.rank, "text": str(error).splitlines()[0], "cause": type(error.__cause__).__name__}
""", salloc=["-N2", "--ntasks-per-node=2"])
    assert result["rank"] == 3 and "rank 3 cannot go on" in json.dumps(result), (result, shown)
    assert not _agents_alive(slurm), "an agent or a rank outlived the launch"


def test_a_timeout_shows_every_ranks_stack_then_stops_all(slurm, tmp_path):
    result, shown = run_program(slurm, tmp_path, """
import time
from nblaunch import LaunchTimeoutError

def sleeps_in_a_named_place():
    time.sleep(600)

try:
    notebook_launcher(sleeps_in_a_named_place, cluster="slurm", timeout=20, display="none")
    result = "finished"
except LaunchTimeoutError as error:
    result = {rank: "sleeps_in_a_named_place" in text for rank, text in error.stacks.items()}
""", salloc=["-N2", "--ntasks-per-node=2"])
    assert result == {"0": True, "1": True, "2": True, "3": True}, (result, shown)
    assert not _agents_alive(slurm)


def test_a_lightning_trainer_trains_in_the_world_nblaunch_made(slurm, tmp_path):
    if importlib.util.find_spec("lightning") is None:  # not imported here: it sets variables at import
        pytest.skip("the Lightning check needs lightning (pip install -e '.[test]')")
    result, shown = run_program(slurm, tmp_path, """
def fit():
    import os
    import torch
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", max_steps=4,
                        enable_progress_bar=False, enable_model_summary=False, logger=False,
                        enable_checkpointing=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    env = trainer.strategy.cluster_environment
    return {"environment": type(env).__name__, "global_rank": trainer.global_rank, "world": trainer.world_size,
            "node_rank": trainer.node_rank, "steps": trainer.global_step}

result = notebook_launcher(fit, cluster="slurm", display="none")
""", salloc=["-N2", "--ntasks-per-node=2"], timeout=400)
    assert [r["global_rank"] for r in result] == [0, 1, 2, 3], shown
    assert {r["world"] for r in result} == {4} and [r["node_rank"] for r in result] == [0, 0, 1, 1]
    assert {r["environment"] for r in result} == {"TorchElasticEnvironment"}, result
    assert {r["steps"] for r in result} == {4}


def _agents_alive(slurm) -> list[str]:
    """nblaunch agents (and the srun that starts them) of this test's cluster still running (those
    of another Slurm on the machine carry another SLURM_CONF)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        try:
            ours = process.environ().get("SLURM_CONF") == str(slurm.conf_path)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "nblaunch.cluster.socket_agent" in cmdline and ours:
            found.append(cmdline)
    return found


def test_warm_ranks_stay_up_on_every_node_between_calls(slurm, tmp_path):
    result, shown = run_program(slurm, tmp_path, """
import time
from nblaunch import WarmRanks

def remember():
    import __main__, os
    __main__.mine = int(os.environ["RANK"]) * 10   # kept in the rank for the next call
    return os.environ["SLURMD_NODENAME"]

def recall():
    import __main__, torch, torch.distributed as dist
    total = torch.tensor([__main__.mine])
    dist.all_reduce(total)
    return __main__.mine, int(total)

with WarmRanks(cluster="slurm", display="none") as ranks:
    nodes = notebook_launcher(remember, ranks=ranks)
    started = time.perf_counter()
    kept = notebook_launcher(recall, ranks=ranks)
    result = {"nodes": nodes, "kept": kept, "call_s": time.perf_counter() - started}
""", salloc=["-N2", "--ntasks-per-node=2"])
    assert result["nodes"] == ["nbl1", "nbl1", "nbl2", "nbl2"], (result, shown)
    assert result["kept"] == [[0, 60], [10, 60], [20, 60], [30, 60]]
    assert result["call_s"] < 5, result  # a call, not a launch (a generous bound: the cores are shared)
    assert not _agents_alive(slurm)


def test_a_kernel_killed_mid_launch_leaves_no_step_agent_or_rank_in_its_allocation(slurm, tmp_path):
    # A kernel in a long-lived allocation (Open OnDemand's batch job), SIGKILLed by a restart: the
    # allocation stays, and nothing of the launch may stay in it.
    with kernel_in_an_allocation(slurm, tmp_path) as kernel:
        kernel.kill()
        kernel.wait()
    wait_until(lambda: not _steps_of_launches(slurm) and not _agents_alive(slurm), 60)


def test_an_interrupt_shows_every_ranks_stack_then_stops_every_node(slurm, tmp_path):
    with kernel_in_an_allocation(slurm, tmp_path) as kernel:
        kernel.send_signal(signal.SIGINT)  # Jupyter's interrupt
        shown, _ = kernel.communicate(timeout=120)
    assert "LaunchInterrupted" in shown, shown
    for rank in range(4):
        assert f"[rank {rank}] stopped at" in shown and "in sleeps" in shown, shown
    wait_until(lambda: not _steps_of_launches(slurm) and not _agents_alive(slurm), 60)


@contextlib.contextmanager
def kernel_in_an_allocation(slurm, tmp_path):
    """A program standing for a kernel inside a 2-node job (its SLURM_* as Slurm sets them),
    in a launch whose 4 ranks all run; the job is cancelled after."""
    holder = slurm.run(["sbatch", "--parsable", "-N2", "--ntasks-per-node=2", "--job-name=holder",
                        "--output=/dev/null", "--wrap", "sleep 300"]).stdout.strip()
    try:
        wait_until(lambda: ("RUNNING" in [state for job, state, _ in slurm.jobs() if job == holder]), 60)
        program = tmp_path / "kernel.py"
        program.write_text(textwrap.dedent("""
            import time
            from nblaunch import notebook_launcher
            def sleeps():
                print("rank is running", flush=True)
                time.sleep(600)
            notebook_launcher(sleeps, cluster="slurm", display="text")
        """))
        environ = slurm.environ()
        environ.update(PYTHONPATH=str(ROOT), SLURM_JOB_ID=holder, SLURM_JOB_NODELIST="nbl[1-2]",
                       SLURM_JOB_CPUS_PER_NODE="2(x2)")
        kernel = subprocess.Popen([sys.executable, str(program)], env=environ, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        try:
            running = 0
            for line in kernel.stdout:
                running += "rank is running" in line
                if running == 4:
                    break
            assert running == 4, "the ranks never ran"
            yield kernel
        finally:
            kernel.kill()
    finally:
        slurm.run(["scancel", holder])


def _accounted(slurm) -> dict[str, str]:
    """{job id: state} of the finished jobs nblaunch asked for, as sacct reads them."""
    lines = slurm.run(["sacct", "-c", "-n", "-P", "-o", "JobID,JobName,State"]).stdout.splitlines()
    return {job: state for job, name, state in (line.split("|") for line in lines) if name.startswith("nblaunch-")}


def _steps_of_launches(slurm) -> list:
    return [step for step in slurm.steps() if step[1].startswith("nblaunch-")]


def wait_until(condition, backstop: float) -> None:
    deadline = time.monotonic() + backstop
    while not condition():
        assert time.monotonic() < deadline, "not within the backstop"
        time.sleep(0.1)


def test_a_detached_launch_outlives_its_kernel_as_a_job_and_another_kernel_collects_it(slurm, tmp_path):
    state = tmp_path / "state"  # the user's state folder: on a cluster, the shared home directory
    first = tmp_path / "first"
    first.mkdir()
    started, shown = run_program(slurm, first, """
import os
os.environ["NBLAUNCH_STATE_DIR"] = %r

def slow_world(kernel_pid):
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print("rank", os.environ["RANK"], "says so in its log", flush=True)
    while os.path.exists(f"/proc/{kernel_pid}"):  # the test's nodes share this machine
        time.sleep(0.05)  # finished only once the kernel that started it is gone
    total = torch.ones(1)
    dist.all_reduce(total)
    return os.environ["RANK"], int(total), os.environ["SLURMD_NODENAME"]

launch = notebook_launcher(slow_world, args=(os.getpid(),), cluster="slurm", num_nodes=2, num_processes=2,
                           resources={"time": "10"}, detach=True, display="none")
result = launch.launch_id
print("RESULT " + json.dumps(result), flush=True)
os.kill(os.getpid(), 9)  # the kernel is killed: the launch is a job of its own
""" % str(state))
    second = tmp_path / "second"
    second.mkdir()
    collected, shown = run_program(slurm, second, """
import os
os.environ["NBLAUNCH_STATE_DIR"] = %r
import nblaunch
listed = [(info.id, info.function, info.ranks) for info in nblaunch.launches()]
launch = nblaunch.attach(display="text")
result = {"listed": listed, "results": launch.result(timeout=180), "status": launch.status,
          "log": launch.logs(3), "log_dir": launch.log_dir}
""" % str(state))
    assert collected["listed"] == [[started, "slow_world", 4]], collected
    assert collected["results"] == [["0", 4, "nbl1"], ["1", 4, "nbl1"], ["2", 4, "nbl2"], ["3", 4, "nbl2"]], shown
    assert collected["status"] == "done"
    # The ranks' logs are in the user's state folder, which the nodes share, not in a node's /tmp.
    assert collected["log_dir"].startswith(str(state)) and "rank 3 says so in its log" in collected["log"], collected
    assert "[rank 3]" in shown or "all 4 ranks done" in shown, shown


def test_a_detached_launch_is_cancelled_from_another_kernel_and_its_job_ends(slurm, tmp_path):
    state = tmp_path / "state"
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    run_program(slurm, tmp_path / "first", """
import os
os.environ["NBLAUNCH_STATE_DIR"] = %r

def sleeps():
    import time
    print("running", flush=True)
    time.sleep(600)

result = notebook_launcher(sleeps, cluster="slurm", num_processes=1, resources={"time": "10"}, detach=True,
                           display="none").launch_id
""" % str(state))
    cancelled, shown = run_program(slurm, tmp_path / "second", """
import os, time
os.environ["NBLAUNCH_STATE_DIR"] = %r
import nblaunch
launch = nblaunch.attach(display="none")
while launch.status != "running":
    time.sleep(0.1)
while "running" not in launch.logs(0):
    time.sleep(0.1)
asked = launch.cancel()
try:
    launch.result(timeout=120)
    result = "finished"
except Exception as error:
    result = {"asked": asked, "error": type(error).__name__, "status": launch.status}
""" % str(state))
    assert cancelled == {"asked": True, "error": "LaunchCancelledError", "status": "cancelled"}, (cancelled, shown)


def test_nblaunch_launch_runs_a_script_on_every_node_of_the_job(slurm, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('world', os.environ['RANK'], os.environ['WORLD_SIZE'], "
                      "os.environ['SLURMD_NODENAME'], flush=True)\n")
    environ = slurm.environ()
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(["salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "nblaunch", "launch",
                           "--cluster", "slurm", str(script)],
                          env=environ, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown
    for rank, node in ((0, "nbl1"), (1, "nbl1"), (2, "nbl2"), (3, "nbl2")):
        assert f"world {rank} 4 {node}" in shown, shown


def test_a_timeout_or_a_cancel_while_the_job_waits_in_the_queue_ends_the_wait_and_gives_the_job_back(slurm, tmp_path):
    blocker = slurm.run(["sbatch", "--parsable", "-N2", "--exclusive", "--job-name=blocker", "--output=/dev/null",
                         "--wrap", "sleep 300"]).stdout.strip()
    try:
        result, shown = run_program(slurm, tmp_path, """
import subprocess, time
from nblaunch import LaunchCancelledError, LaunchTimeoutError

started = time.monotonic()
try:
    notebook_launcher(print, cluster="slurm", num_processes=1, timeout=4, display="none")
    timed_out = "ran"
except LaunchTimeoutError as error:
    timed_out = round(time.monotonic() - started, 1)

launch = notebook_launcher(print, cluster="slurm", num_processes=1, block=False, display="none")
while "nblaunch-" not in subprocess.run(["squeue", "-h", "-t", "PD", "-o", "%j"], capture_output=True,
                                        text=True).stdout:
    time.sleep(0.05)  # until the job waits in the queue
asked = time.monotonic()
launch.cancel()
try:
    launch.result(timeout=60)
    cancelled = "ran"
except LaunchCancelledError:
    cancelled = round(time.monotonic() - asked, 1)
result = {"timed_out_after": timed_out, "cancelled_after": cancelled}
""")
    finally:
        slurm.run(["scancel", blocker])
    assert isinstance(result["timed_out_after"], float) and result["timed_out_after"] < 15, (result, shown)
    assert isinstance(result["cancelled_after"], float) and result["cancelled_after"] < 15, (result, shown)
