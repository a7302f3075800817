"""The command line as a terminal user meets it: ``python -m nblaunch`` and the ``nblaunch``
script, run as real processes (the demo trains for real on 2 CPU ranks)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")


def run(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nblaunch", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("option", ["--epochs", "--num-processes"])
@pytest.mark.parametrize("value, says", [("0", "must be at least 1, got 0"), ("-3", "must be at least 1"),
                                         ("two", "expected a whole number, got 'two'")])
def test_a_bad_number_is_a_usage_error_before_anything_starts(option, value, says):
    done = run("demo", option, value)
    assert done.returncode == 2
    assert f"argument {option}: {says}" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_one_epoch_trains_and_says_so():
    done = run("demo", "--epochs", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("nblaunch: train_digits on 2 processes (CPU, ")
    assert "started by fork (the quickest start: each process begins as a copy of this one)" in lines[0]
    assert re.match(r"test accuracy 0\.\d{3} after 1 epoch; training loss ", lines[-2])
    assert lines[-1] == "all 2 processes agree on the result"


@pytest.mark.slow
def test_one_process_is_a_launch_with_its_line_and_no_agreement_claim():
    done = run("demo", "--epochs", "1", "--num-processes", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("nblaunch: train_digits on 1 process (CPU")
    assert "nblaunch: rank 0 done in " in done.stdout and "agree" not in done.stdout


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_at_one_step_with_its_state_saved_and_resume_goes_on(tmp_path):
    env = {**os.environ, "NBLAUNCH_STATE_DIR": str(tmp_path)}  # the demo's checkpoints: under its runs/
    # A terminal's Ctrl-C reaches the whole foreground process group.
    process = subprocess.Popen([sys.executable, "-m", "nblaunch", "demo", "--epochs", "200"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in process.stdout:
        if "epoch 1/200" in line:
            break
    os.killpg(process.pid, signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 130, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
    stopped = re.findall(r"^\[rank (\d)\] stopped: stopped after (\d+) training steps; its state is saved in (\S+)$",
                         rest, re.M)
    assert sorted(rank for rank, _, _ in stopped) == ["0", "1"], rest
    assert len({(steps, folder) for _, steps, folder in stopped}) == 1, rest  # one step, one folder
    folder = stopped[0][2]
    assert folder.startswith(str(tmp_path / "runs" / "train_digits" / "checkpoints")), folder
    last = rest.rstrip().splitlines()[-1]
    assert last.startswith("nblaunch: interrupted after") and "the same command with --resume" in last, rest
    assert len(rest.splitlines()) <= 12, rest
    resumed = run("demo", "--epochs", "2", "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {folder}" in resumed.stderr
    assert "epoch 2/2" in resumed.stdout and "epoch 1/2" not in resumed.stdout, resumed.stdout  # epoch 1 was done


def test_without_scikit_learn_it_says_what_to_install(tmp_path):
    fake = tmp_path / "sklearn"  # a scikit-learn that is not there
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'sklearn'\")\n")
    done = run("demo", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr.strip() == ("nblaunch demo: the demo needs scikit-learn, which is not installed. "
                                   "Install it with: pip install 'nblaunch[examples]'")
    assert done.stdout == ""


def test_help_is_plain_text_with_every_option_explained():
    top = run("--help")
    demo = run("demo", "--help")
    assert top.returncode == demo.returncode == 0
    for text in (top.stdout, demo.stdout):
        assert "``" not in text and ":func:" not in text
    assert top.stdout.startswith("usage: python -m nblaunch ")
    # Every option says what it does and its default.
    options = re.findall(r"^  (--[a-z-]+)", demo.stdout, re.M)
    assert options == ["--num-processes", "--cpu", "--epochs", "--mixed-precision", "--resume", "--start-method"]
    assert " ".join(demo.stdout.split()).count("(default: ") == len(options)


def test_version_and_the_installed_script_name():
    from nblaunch import __version__

    done = run("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"nblaunch {__version__}")
    script = shutil.which("nblaunch", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the nblaunch script is not installed next to this Python")
    usage = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60).stdout
    assert usage.startswith("usage: nblaunch ")
