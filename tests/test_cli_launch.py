"""``nblaunch launch``, ``nblaunch test`` and ``nblaunch env`` as a terminal user meets them:
real scripts, run through ``python -m nblaunch`` as real processes, on 2 CPU ranks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

HELLO = """
    import os
    import sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"hello from rank {dist.get_rank()} of {dist.get_world_size()}, argv={sys.argv[1:]}, as {__name__}")
"""

RAISES_ON_RANK_1 = """
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.barrier()
"""

WAITS_FOREVER = """
    import time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("ready", flush=True)
    while True:
        dist.barrier()
        time.sleep(0.05)
"""


@pytest.fixture(autouse=True)
def _no_accelerate_config(tmp_path_factory, monkeypatch):
    # nblaunch launch reads Accelerate's default config file when there is one: never the user's here.
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def script(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def nblaunch(*args, cwd, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nblaunch", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def test_every_rank_runs_the_script_as_main_with_its_own_arguments(tmp_path):
    script(tmp_path, "hello.py", HELLO)
    done = nblaunch("launch", "--num_processes", "2", "hello.py", "--lr", "3e-4", "data", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("nblaunch: hello.py on 2 processes (CPU")
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank} of 2, argv=['--lr', '3e-4', 'data'], as __main__" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith("nblaunch: all 2 ranks done in")
    assert "Traceback" not in done.stderr


def test_a_module_runs_like_python_dash_m(tmp_path):
    script(tmp_path, "project/__init__.py", "")
    script(tmp_path, "project/train.py", HELLO)
    done = nblaunch("launch", "--nproc-per-node", "2", "-m", "project.train", "--epochs", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[rank 1] hello from rank 1 of 2, argv=['--epochs', '1'], as __main__" in done.stdout


@pytest.mark.parametrize("rank_0_failed, said", [
    (None, "rank 1 failed;"),
    ("collateral", "rank 1 failed;"),  # whether a peer's lost connection arrives is a race: not a rival
    ("of its own", "rank 1 failed first;"),
])
def test_the_terminal_says_first_only_where_another_rank_failed_on_its_own(capsys, rank_0_failed, said):
    from nblaunch import RankFailedError
    from nblaunch.cli.outcome import outcome_in_terminal
    from nblaunch.contract.failure import RankFailure

    failures = [RankFailure(1, "ValueError: rank 1 cannot go on", traceback="Traceback: ...")]
    if rank_0_failed:
        failures.append(RankFailure(0, "DistBackendError: connection closed by peer",
                                    collateral=rank_0_failed == "collateral"))

    def results():
        raise RankFailedError.blaming(failures, {}, [1, 0], [])

    assert outcome_in_terminal("launch", results) == (None, 1)
    assert f"nblaunch launch: {said} its traceback:" in capsys.readouterr().err


def test_a_script_raising_on_rank_1_exits_1_naming_rank_1_and_the_scripts_line(tmp_path):
    script(tmp_path, "train.py", RAISES_ON_RANK_1)
    done = nblaunch("launch", "--num-processes", "2", "train.py", cwd=tmp_path)
    assert done.returncode == 1
    assert "nblaunch: rank 1 failed after" in done.stderr and "[rank 1] failed: ValueError: rank 1 cannot go on" in done.stderr
    # The root cause once, at the end: the rank, and a traceback that starts in the script.
    assert done.stderr.count("Traceback") == 1
    assert done.stderr.strip().splitlines()[-5:] == [
        "nblaunch launch: rank 1 failed; its traceback:",
        "Traceback (most recent call last):",
        '  File "train.py", line 6, in <module>',
        '    raise ValueError("rank 1 cannot go on")',
        "ValueError: rank 1 cannot go on",
    ]


def test_an_exit_code_is_a_failure_and_exit_0_is_not(tmp_path):
    script(tmp_path, "exits.py", "import os, sys\nsys.exit(int(os.environ['RANK']) * 3)\n")
    done = nblaunch("launch", "--num-processes", "2", "exits.py", cwd=tmp_path)
    assert done.returncode == 1
    assert "[rank 1] failed: called sys.exit(3)" in done.stderr, done.stderr
    script(tmp_path, "fine.py", "import sys\nsys.exit(0)\n")
    assert nblaunch("launch", "--num-processes", "2", "fine.py", cwd=tmp_path).returncode == 0


def test_sigint_stops_every_rank_with_exit_130_and_leaves_no_process(tmp_path):
    script(tmp_path, "forever.py", WAITS_FOREVER)
    process = subprocess.Popen([sys.executable, "-m", "nblaunch", "launch", "--num-processes", "2", "forever.py"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ready = 0
    for line in process.stdout:
        ready += line.endswith("] ready\n")
        if ready == 2:
            break
    ranks = psutil.Process(process.pid).children(recursive=True)
    assert len(ranks) >= 2
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 130, rest
    assert "Traceback" not in rest
    assert re.search(r"\[rank 0\] stopped at forever\.py, line \d+, in <module>", rest), rest
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


@pytest.mark.slow
def test_the_timeout_stops_every_rank_with_exit_124(tmp_path):
    script(tmp_path, "forever.py", WAITS_FOREVER)
    done = nblaunch("launch", "--num-processes", "2", "--timeout", "5", "forever.py", cwd=tmp_path)
    assert done.returncode == 124
    assert re.search(r"\[rank 1\] stopped at forever\.py, line \d+", done.stderr), done.stderr


def test_what_cannot_run_is_refused_before_anything_starts(tmp_path):
    script(tmp_path, "hello.py", HELLO)
    cases = {
        ("launch", "--num-processes", "2", "missing.py"): "no such script: 'missing.py'",
        ("launch", "--num-processes", "2", "-m", "no_such.module"): "cannot find module 'no_such.module'",
        ("launch", "--use_deepspeed", "hello.py"): "--use_deepspeed is not supported: DeepSpeed",
        ("launch", "--fsdp_sharding_strategy", "1", "hello.py"): "only applies to FSDP: add --use_fsdp",
        ("launch", "--num-processes", "2", "--use_fsdp", "--fsdp_activation_checkpointing_offload", "1", "hello.py"):
            "--fsdp_activation_checkpointing_offload false",
        ("launch", "--num-processes", "0", "hello.py"): "must be at least 1, got 0",
        ("launch", "--frobnicate", "hello.py"): "unrecognized option '--frobnicate'",
    }
    for args, says in cases.items():
        done = nblaunch(*args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert says in done.stderr, (args, done.stderr)
        assert done.stdout == "" and "Traceback" not in done.stderr


def test_help_reads_like_a_tools_help():
    done = nblaunch("launch", "--help", cwd=".")
    assert done.returncode == 0
    for part in ("usage: python -m nblaunch launch", "--nproc-per-node", "exit status: 0 every rank succeeded",
                 "nblaunch launch --num-processes 2 train.py --lr 3e-4"):
        assert part in done.stdout
    assert "``" not in done.stdout and ":class:" not in done.stdout
    assert re.fullmatch(r"nblaunch \d+\.\d+\.\d+\n", nblaunch("--version", cwd=".").stdout)


def test_nblaunch_test_passes_here():
    done = nblaunch("test", cwd=".")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   a gloo process group formed on cpu" in done.stdout
    assert "ok   one DDP step left every rank with the same weights" in done.stdout
    assert "nblaunch test: this machine is ready" in done.stdout


def test_nblaunch_env_lists_versions_devices_and_the_start_method():
    import torch

    done = nblaunch("env", cwd=".")
    assert done.returncode == 0
    assert f"- torch: {torch.__version__}" in done.stdout
    assert "- GPUs: none visible" in done.stdout
    assert "- start method: fork: the quickest start" in done.stdout
    assert re.search(r"- ipywidgets: \d", done.stdout)


def test_one_process_is_a_launch_and_fails_like_the_others(tmp_path):
    script(tmp_path, "boom.py", "import sys\nprint('argv', sys.argv[1:])\nraise KeyError('no such column')\n")
    done = nblaunch("launch", "--num-processes", "1", "boom.py", "x", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout.startswith("nblaunch: boom.py on 1 process (CPU") and "[rank 0] argv ['x']\n" in done.stdout
    assert done.stderr.strip().splitlines()[-5:] == [
        "nblaunch launch: rank 0 failed; its traceback:",
        "Traceback (most recent call last):",
        '  File "boom.py", line 3, in <module>',
        "    raise KeyError('no such column')",
        "KeyError: 'no such column'",
    ]


def test_the_scripts_own_arguments_never_meet_the_launchers_parser(tmp_path):
    # Abbreviations of the launcher's options, its own option names, and "--": all the script's.
    script(tmp_path, "args.py", "import sys\nprint(sys.argv[1:])\n")
    mine = ["--n", "64", "--timeout", "3", "-m", "x", "--help", "--", "--num-processes", "7"]
    done = nblaunch("launch", "--num-processes", "1", "args.py", *mine, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"[rank 0] {mine}\n" in done.stdout
    for spelling, says in (("--nproc-per-node=cpu", "one process per CPU core is not supported"),
                           ("--tee", "--tee is not supported: every rank's output is shown"),
                           ("--num-proc", "unrecognized option '--num-proc'")):
        done = nblaunch("launch", spelling, "args.py", cwd=tmp_path)
        assert done.returncode == 2 and says in done.stderr, (spelling, done.stderr)
