"""Shared fixtures: every test must leave no rank process behind."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import psutil
import pytest

from nblaunch.worker.lifeline import PROCESS_NAME_PREFIX

pytest_plugins = ["lanes"]  # the default run and the lanes; -n spreads the suite by file


def _step_an_optimizer_once() -> None:
    """torch's first optimizer step (its lazy import of torch._dynamo) sets
    TORCHINDUCTOR_CACHE_DIR in os.environ. Do it at collection, so environ_unchanged below sees
    only what a launch changes, not what torch does to any process that trains."""
    import torch

    weight = torch.nn.Parameter(torch.zeros(1))
    weight.grad = torch.zeros(1)
    torch.optim.SGD([weight], lr=0.1).step()


_step_an_optimizer_once()


# A shell that starts a command in the background without job control (`cmd &`, nohup) starts it
# with SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the tests that
# interrupt a launch, as a kernel's interrupt button does, would wait for an interrupt that never
# comes. A kernel always handles SIGINT; so does the test process.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def a_temporary_folder_of_its_own(tmp_path_factory):
    """nblaunch records its launches under the temporary folder, where any launch on the machine
    stops the ranks a dead launcher left and says so. Each test process (each -n worker) gets a
    folder of its own for the session: another worker's or another run's launch never stops what a
    test left on purpose, nor says so in that test's output. pytest's own folders stay where they
    were (asked for first), and so does Ray's (RAY_TMPDIR: the clusters are pinned by address, and
    the Ray lane's other cluster must be found where a user's would be). Compiled code goes there
    too (NBLAUNCH_COMPILE_CACHE), never into the user's ~/.cache."""
    tmp_path_factory.getbasetemp()
    system = tempfile.gettempdir()
    folder = tempfile.mkdtemp(prefix="nbl-", dir=system)  # short: sockets are made under it
    os.chmod(folder, 0o755)  # munged wants every folder above its socket searchable by all
    saved = {name: os.environ.get(name) for name in ("TMPDIR", "RAY_TMPDIR", "NBLAUNCH_COMPILE_CACHE")}
    os.environ["TMPDIR"] = folder
    os.environ.setdefault("NBLAUNCH_COMPILE_CACHE", os.path.join(folder, "compile"))
    os.environ.setdefault("RAY_TMPDIR", system)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None
    shutil.rmtree(folder, ignore_errors=True)


def leftover_ranks(since: float) -> list[psutil.Process]:
    """Live rank processes that are ours: our descendants, or orphans born since ``since`` of a
    process this test process started (another run's orphans on the machine are not ours)."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    found = []
    for proc in psutil.process_iter(["name", "ppid", "create_time", "status"]):
        info = proc.info
        if not (info["name"] or "").startswith(PROCESS_NAME_PREFIX) or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        orphan = info["ppid"] in (0, 1) and info["create_time"] >= since - 1 and _started_here(proc)
        if proc.pid in mine or orphan:
            found.append(proc)
    return found


def _started_here(proc: psutil.Process) -> bool:
    """Whether ``proc`` descends from a program this test process started: what a program was
    started with is in /proc/PID/environ, and TMPDIR is this test process's own folder."""
    try:
        return proc.environ().get("TMPDIR") == os.environ.get("TMPDIR")
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # cannot tell: counted, as before


@pytest.fixture(autouse=True)
def no_rank_left_behind():
    since = time.time()
    yield
    # Killed ranks vanish asynchronously: wait for the condition, with a generous backstop.
    deadline = time.monotonic() + 5
    while (left := leftover_ranks(since)) and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.5)
    assert not leftover_ranks(since), f"rank processes left behind: {leftover_ranks(since)}"


class Recorder:
    """A display that keeps every event, for assertions."""

    def __init__(self):
        self.events = []

    def on_event(self, event):
        self.events.append(event)

    def close(self):
        pass

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]

    def lines(self, rank, stream="stdout"):
        from nblaunch.events import Output

        return [line for e in self.of(Output) if e.rank == rank and e.stream == stream and not e.transient for line in e.lines]


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture(autouse=True)
def environ_unchanged():
    def snapshot():
        return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}

    before = snapshot()
    yield
    assert snapshot() == before, "the launch changed the parent's os.environ"
