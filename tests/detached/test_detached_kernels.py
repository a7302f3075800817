"""Detached launches outlive their kernel: started in a real kernel A, A killed hard (SIGKILL),
then listed, attached, collected and cancelled from a real kernel B; nothing left afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

pytest.importorskip("jupyter_client")

from jupyter_client.manager import KernelManager  # noqa: E402

from nblaunch import attach  # noqa: E402
from nblaunch.detached.journal import JournalReader  # noqa: E402
from nblaunch.events import Output, RankStarted  # noqa: E402
from processes import stop_every_launch_in  # noqa: E402,F401  (the detached tests' cleanup)

TRAIN = '''
from nblaunch import notebook_launcher

def train(go, fail_rank=None):
    import os, time
    rank = int(os.environ["RANK"])
    print(f"ready {rank}", flush=True)
    while go and not os.path.exists(go):  # the test lets the ranks go on after the kernel died
        time.sleep(0.05)
    if rank == fail_rank:
        raise ValueError(f"bad data on rank {rank}")
    print(f"went {rank}", flush=True)
    return rank * 10
'''


class Kernel:
    """A real IPython kernel, its outputs as text."""

    def __init__(self, state_dir: str) -> None:
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=dict(os.environ, NBLAUNCH_STATE_DIR=state_dir))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 120) -> str:
        shown: list[str] = []

        def keep(message: dict) -> None:
            content = message["content"]
            if message["msg_type"] == "stream":
                shown.append(content["text"])
            elif message["msg_type"] in ("execute_result", "display_data"):
                shown.append(content["data"].get("text/plain", "") + "\n")
            elif message["msg_type"] == "error":
                shown.append("\n".join(content["traceback"]))

        self.client.execute_interactive(code, output_hook=keep, timeout=timeout)
        return "".join(shown)

    def kill(self) -> None:
        """SIGKILL, as an out-of-memory kill or a crash would end it."""
        pid = self.manager.provisioner.process.pid
        os.kill(pid, signal.SIGKILL)
        psutil.Process(pid).wait(timeout=30) if psutil.pid_exists(pid) else None
        self.client.stop_channels()
        self.manager.cleanup_resources()

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture
def state_dir(tmp_path):
    """A state folder of the test's own; whatever launch a failed test left running is stopped."""
    folder = str(tmp_path / "state")
    yield folder
    stop_every_launch_in(folder)


def _folder(state_dir: str, launch_id: str) -> str:
    return os.path.join(state_dir, "detached", launch_id)


def _state(state_dir: str, launch_id: str) -> dict:
    with open(os.path.join(_folder(state_dir, launch_id), "state.json")) as file:
        return json.load(file)


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # a backstop: each condition is met in a second or two
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def _start_in_a_kernel_then_kill_it(state_dir: str, call: str) -> str:
    """Kernel A starts the detached launch ``call``; once both ranks printed, A is SIGKILLed."""
    kernel = Kernel(state_dir)
    try:
        # One write: the cell's watcher thread prints the launch's lines into the same stream, and a
        # print() of several pieces could have one of them land inside this line.
        shown = kernel.run(TRAIN + f"launch = {call}\nimport sys; sys.stdout.write(f'id {{launch.launch_id}}\\n')")
        found = re.search(r"^id (\w+)$", shown, re.M)
        assert found, f"the cell did not print the launch's id; it showed:\n{shown}"
        launch_id = found[1]

        def both_ranks_printed() -> bool:
            log_dir = _state(state_dir, launch_id).get("log_dir")
            return bool(log_dir) and all(
                os.path.exists(p) and "ready" in open(p).read()
                for p in (os.path.join(log_dir, f"rank{r}.log") for r in (0, 1)))

        _wait_for(both_ranks_printed, "both ranks to print")
    finally:
        kernel.kill()
    return launch_id


def _processes_of(state_dir: str, launch_id: str) -> list[int]:
    reader = JournalReader(os.path.join(_folder(state_dir, launch_id), "journal"))
    ranks = [event.pid for event in reader.read_available() if isinstance(event, RankStarted)]
    supervisor = _state(state_dir, launch_id).get("supervisor_pid")  # written once it runs
    return ranks + [supervisor] if supervisor else ranks


def _nothing_left(pids: list[int]) -> None:
    alive = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, still = psutil.wait_procs(alive, timeout=15)
    assert not [p for p in still if p.status() != psutil.STATUS_ZOMBIE], f"left behind: {still}"


def test_a_launch_outlives_its_kernel_and_another_kernel_attaches_and_collects_it(state_dir, tmp_path):
    go = str(tmp_path / "go")
    launch_id = _start_in_a_kernel_then_kill_it(
        state_dir, f"notebook_launcher(train, args=({go!r},), num_processes=2, detach=True, display='text')")
    pids = _processes_of(state_dir, launch_id)
    assert all(psutil.pid_exists(pid) for pid in pids), "the kernel's death stopped the launch"
    kernel = Kernel(state_dir)
    try:
        listed = kernel.run("from nblaunch import launches, attach\nlaunches()")
        assert re.search(rf"{launch_id}\s+running .* train on 2 ranks", listed), listed
        open(go, "w").close()
        shown = kernel.run("launch = attach(display='text')\nprint('result', launch.result(), launch.status)")
    finally:
        kernel.close()
    # Printed before the kill, then live after the attach, then the end, then the result.
    for line in ("[rank 0] ready 0", "[rank 1] ready 1", "[rank 0] went 0", "[rank 1] went 1",
                 "all 2 ranks done", "result [0, 10] done"):
        assert line in shown, shown
    _nothing_left(pids)


@pytest.mark.slow
def test_a_launch_that_ends_while_no_kernel_watches_is_shown_and_collected_later(state_dir):
    launch_id = _start_in_a_kernel_then_kill_it(
        state_dir, "notebook_launcher(train, args=(None,), num_processes=2, detach=True, display='text')")
    folder = _folder(state_dir, launch_id)
    _wait_for(lambda: os.path.exists(os.path.join(folder, "outcome.pkl")), "the launch to end")
    kernel = Kernel(state_dir)
    try:
        shown = kernel.run(f"from nblaunch import attach\nprint('result', attach({launch_id[:6]!r}, display='text').result())")
    finally:
        kernel.close()
    assert "ready 1" in shown and "went 0" in shown and "result [0, 10]" in shown, shown
    assert os.path.exists(os.path.join(folder, "collected"))
    _nothing_left(_processes_of(state_dir, launch_id))


@pytest.mark.slow
def test_a_failure_while_detached_is_raised_on_attach_with_the_right_rank(state_dir):
    launch_id = _start_in_a_kernel_then_kill_it(
        state_dir, "notebook_launcher(train, args=(None, 1), num_processes=2, detach=True, display='text')")
    kernel = Kernel(state_dir)
    try:
        shown = kernel.run("from nblaunch import attach\nlaunch = attach(display='none')\n"
                           "try:\n    launch.result()\nexcept Exception as error:\n"
                           "    print('raised', type(error).__name__, error)\nprint(launch.status)")
    finally:
        kernel.close()
    assert "raised RankFailedError rank 1 failed: ValueError: bad data on rank 1" in shown, shown
    assert shown.rstrip().endswith("failed"), shown
    _nothing_left(_processes_of(state_dir, launch_id))


@pytest.mark.slow
def test_cancel_from_another_kernel_stops_every_rank(state_dir, tmp_path):
    never = str(tmp_path / "never")
    launch_id = _start_in_a_kernel_then_kill_it(
        state_dir, f"notebook_launcher(train, args=({never!r},), num_processes=2, detach=True, display='text')")
    pids = _processes_of(state_dir, launch_id)
    kernel = Kernel(state_dir)
    try:
        shown = kernel.run("from nblaunch import attach\nlaunch = attach(display='none')\nprint(launch.cancel())\n"
                           "try:\n    launch.result()\nexcept BaseException as error:\n"
                           "    print('raised', type(error).__name__)\nprint(launch.status, launch.cancel())")
    finally:
        kernel.close()
    assert "True\nraised LaunchCancelledError\ncancelled False" in shown, shown
    _nothing_left(pids)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_can_neither_read_nor_attach(state_dir, tmp_path, monkeypatch):
    import pwd

    from nblaunch import attach, launches, notebook_launcher

    monkeypatch.setenv("NBLAUNCH_STATE_DIR", state_dir)
    launch = notebook_launcher(_quick, num_processes=2, detach=True, display="none")
    assert launch.result() == [0, 1]
    nobody = pwd.getpwnam("nobody")
    os.chmod(str(tmp_path), 0o755)  # the parents may be entered; the launch folders are 0700
    state = os.path.join(_folder(state_dir, launch.launch_id), "state.json")
    tried = subprocess.run(["cat", state], capture_output=True, text=True, user=nobody.pw_uid, group=nobody.pw_gid)
    assert tried.returncode != 0 and "Permission denied" in tried.stderr, tried
    # nblaunch's own check, seen from the other side: a folder of launches that is not ours.
    detached = os.path.join(state_dir, "detached")
    os.chown(detached, nobody.pw_uid, nobody.pw_gid)
    for look in (launches, lambda: attach(launch.launch_id)):
        with pytest.raises(PermissionError, match="belongs to another user: launches there are not yours"):
            look()
    os.chown(detached, 0, 0)
    os.chmod(detached, 0o750)
    with pytest.raises(PermissionError, match="can be read by other users: run `chmod 700"):
        launches()


def _quick():
    import os

    return int(os.environ["RANK"])


@pytest.mark.slow
def test_a_supervisor_that_dies_takes_its_ranks_and_attach_says_so(state_dir, tmp_path, monkeypatch):
    from nblaunch import LaunchLostError, notebook_launcher

    monkeypatch.setenv("NBLAUNCH_STATE_DIR", state_dir)
    never = str(tmp_path / "never")
    namespace: dict = {}
    exec(TRAIN, namespace)
    launch = notebook_launcher(namespace["train"], args=(never,), num_processes=2, detach=True, display="none")
    _wait_for(lambda: len(_processes_of(state_dir, launch.launch_id)) == 3, "both ranks to start")
    pids = _processes_of(state_dir, launch.launch_id)
    os.kill(pids[-1], signal.SIGKILL)
    with pytest.raises(LaunchLostError, match=r"died before the launch ended; its ranks were stopped with it"):
        launch.result(timeout=60)
    assert launch.status == "lost"
    _nothing_left(pids)


def _hangs(go: str) -> None:
    import os
    import time

    print(f"hanging {os.environ['RANK']}", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)


@pytest.mark.slow
def test_a_detached_launch_keeps_every_promise_timeout_stacks_and_two_watchers(state_dir, tmp_path, monkeypatch,
                                                                              recorder):
    from nblaunch import LaunchTimeoutError, notebook_launcher
    from nblaunch.events import Stacks

    monkeypatch.setenv("NBLAUNCH_STATE_DIR", state_dir)
    launch = notebook_launcher(_hangs, args=(str(tmp_path / "never"),), num_processes=2, detach=True,
                               display="none", timeout=30)
    first, second = recorder, type(recorder)()  # the fixture's class: "import conftest" finds whichever ran last
    attach(launch.launch_id, display=first)
    watcher = attach(launch.launch_id, display=second)  # two kernels (here: two watchers) at once
    _wait_for(lambda: sum("hanging" in " ".join(e.lines) for e in first.of(Output)) == 2, "both ranks to print")
    assert launch.request_stacks()
    _wait_for(lambda: len({e.rank for e in first.of(Stacks)}) == 2, "every rank's stack")
    assert all("_hangs" in e.text for e in first.of(Stacks))
    watcher.detach()  # a viewer leaves: the launch goes on
    assert launch.status == "running"
    launch.cancel()
    with pytest.raises(BaseException) as raised:
        launch.result(timeout=60)
    assert type(raised.value).__name__ == "LaunchCancelledError"
    _wait_for(lambda: first.events and type(first.events[-1]).__name__ == "LaunchFinished", "the watcher's end")

    short = notebook_launcher(_hangs, args=(str(tmp_path / "never"),), num_processes=2, detach=True,
                              display="none", timeout=2)
    with pytest.raises(LaunchTimeoutError, match="timeout=2 s"):
        short.result(timeout=60)
    assert short.status == "timed out"
