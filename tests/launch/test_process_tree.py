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


def helpers_then(ending: str):
    pids = start_helpers()
    print(*pids, flush=True)
    if ending == "raise":
        raise RuntimeError("rank failed after starting helpers")
    if ending == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    return pids


def assert_all_gone(pids: list[int]) -> None:
    processes = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(processes, timeout=10)  # a backstop: SIGKILL is asynchronous
    assert not alive, f"processes of the launch outlived it: {alive}"


def test_helpers_in_their_own_session_end_with_a_rank_that_returns():
    results = notebook_launcher(helpers_then, args=("return",), num_processes=2, display="none")
    assert all(len(pids) == 2 for pids in results)
    assert_all_gone([pid for pids in results for pid in pids])


@pytest.mark.parametrize("ending", ["raise", "killed"])
def test_helpers_in_their_own_session_end_with_a_rank_that_fails(recorder, ending):
    with pytest.raises(RankFailedError):
        notebook_launcher(helpers_then, args=(ending,), num_processes=2, display=recorder)
    pids = [int(p) for rank in (0, 1) for line in recorder.lines(rank) for p in line.split()]
    assert len(pids) >= 2
    assert_all_gone(pids)


def spams_through_a_helper():
    # The helper keeps writing to the stdout it inherited; the rank is then killed, so nothing
    # of nblaunch's own code in the rank can stop it.
    subprocess.Popen([sys.executable, "-c", "import sys\nwhile True: sys.stdout.write('x' * 4096 + '\\n')"],
                     start_new_session=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_helper_that_never_stops_writing_does_not_hold_the_launch():
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(spams_through_a_helper, num_processes=1, timeout=120, display="none")
    assert info.value.root_cause.signal_name == "SIGKILL"
    assert time.monotonic() - started < 60
    spammers = [p for p in psutil.process_iter(["cmdline"]) if "while True: sys.stdout.write" in " ".join(p.info["cmdline"] or [])]
    _, alive = psutil.wait_procs(spammers, timeout=10)
    assert not alive
