"""No process of a launch survives it, whatever session or process group it made for itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from nblaunch import RankFailedError, notebook_launcher


def start_helpers() -> list[int]:
    """A helper in a session of its own, and a daemon that double-forked and called setsid."""
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:  # the daemon: its parent leaves at once
            os.write(write_end, str(os.getpid()).encode())
            time.sleep(600)
        os._exit(0)
    os.waitpid(middle, 0)
    daemon = int(os.read(read_end, 64))
    return [helper.pid, daemon]


def helpers_then(ending: str, folder: str):
    pids = start_helpers()
    with open(os.path.join(folder, f"rank{os.environ['RANK']}"), "w") as out:  # before anything can stop us
        out.write(" ".join(map(str, pids)))
    if ending == "raise":
        raise RuntimeError("rank failed after starting helpers")
    if ending == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    return pids


def helper_pids(folder) -> list[int]:
    return [int(pid) for path in folder.iterdir() for pid in path.read_text().split()]


def assert_all_gone(pids: list[int]) -> None:
    processes = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(processes, timeout=10)  # a backstop: SIGKILL is asynchronous
    assert not alive, f"processes of the launch outlived it: {alive}"


def test_helpers_in_their_own_session_end_with_a_rank_that_returns(tmp_path):
    results = notebook_launcher(helpers_then, args=("return", str(tmp_path)), num_processes=2, display="none")
    assert all(len(pids) == 2 for pids in results)
    assert_all_gone([pid for pids in results for pid in pids])


@pytest.mark.parametrize("ending", ["raise", "killed"])
def test_helpers_in_their_own_session_end_with_a_rank_that_fails(tmp_path, ending):
    with pytest.raises(RankFailedError):
        notebook_launcher(helpers_then, args=(ending, str(tmp_path)), num_processes=2, display="none")
    pids = helper_pids(tmp_path)
    assert len(pids) >= 2  # at least the failing rank's (the other may be stopped before it wrote)
    assert_all_gone(pids)


SPAMMER = """
import os, sys, time
open(sys.argv[1], "w").close()         # started: the rank may die now
try:
    while True:
        sys.stdout.write("x" * 4096 + "\\n")
except BrokenPipeError:                 # nobody reads: stay alive, holding the pipe
    time.sleep(600)
"""


def spams_through_a_helper(flag):
    # The helper keeps writing to the stdout it inherited; the rank is then killed, so nothing
    # of nblaunch's own code in the rank can stop it: only the launcher can.
    subprocess.Popen([sys.executable, "-c", SPAMMER, flag], start_new_session=True)
    while not os.path.exists(flag):
        time.sleep(0.01)
    print("helper started", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_helper_that_never_stops_writing_does_not_hold_the_launch(tmp_path):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(spams_through_a_helper, args=(str(tmp_path / "started"),), num_processes=1,
                          timeout=120, display="none")
    assert info.value.root_cause.signal_name == "SIGKILL"
    assert time.monotonic() - started < 60
    flag = str(tmp_path / "started")  # this test's helper (another run's has a folder of its own)
    spammers = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-2:] == [SPAMMER, flag]]
    _, alive = psutil.wait_procs(spammers, timeout=10)
    assert not alive


def waits_for(flag):
    while not os.path.exists(flag):
        time.sleep(0.01)
    return "survived"


def fails_once_told(flag):
    waits_for(flag)
    start_helpers()
    os.kill(os.getpid(), signal.SIGKILL)  # leaves its helpers to the launcher's search


def test_a_failed_launch_stops_its_own_processes_only(tmp_path):
    # Another launch that runs on, and a process the kernel forked itself while the failing
    # launch ran (as a DataLoader worker in the notebook would): neither is the failing launch's.
    other_flag, fail_flag = str(tmp_path / "other may end"), str(tmp_path / "fail now")
    other = notebook_launcher(waits_for, args=(other_flag,), num_processes=2, display="none", block=False)
    failing = notebook_launcher(fails_once_told, args=(fail_flag,), num_processes=2, display="none", block=False)
    deadline = time.monotonic() + 60
    while failing.status != "running":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    users_fork = os.fork()
    if users_fork == 0:
        time.sleep(60)
        os._exit(0)
    try:
        open(fail_flag, "w").close()
        with pytest.raises(RankFailedError):
            failing.result(timeout=60)
        assert psutil.Process(users_fork).status() != psutil.STATUS_ZOMBIE
        assert not other.done()
        open(other_flag, "w").close()
        assert other.result(timeout=60) == ["survived", "survived"]
    finally:
        os.kill(users_fork, signal.SIGKILL)
        os.waitpid(users_fork, 0)
