"""Nothing in a rank's start-up fails silently: what goes wrong outside the user's function
reaches the launcher as a RankFailedError with its traceback and what to do."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest

from nblaunch import RankFailedError, notebook_launcher
from nblaunch.launch.processes.processes import Pipes, fork_process
from nblaunch.launch.supervising.supervisor import Supervisor
from nblaunch.worker.bootstrap import WorkerSettings, run_forked


def test_a_launch_works_with_dill_installed_and_torch_imported_first():
    # dill (datasets and evaluate need it) puts a logging._StderrHandler on its logger as torch
    # imports it; that handler's stream cannot be set, and every rank used to exit with code 70.
    import dill  # noqa: F401  (the test environment must carry it, as Colab's and Kaggle's do)

    code = (
        "import torch, logging\n"
        "assert any(type(h).__name__ == '_StderrHandler' for h in logging.getLogger('dill').handlers)\n"
        "from nblaunch import notebook_launcher\n"
        "print(notebook_launcher(lambda: 1, num_processes=2, display='none'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1, 1]"


OPENMP_AFTER_FORK = """
import torch
from nblaunch import notebook_launcher
torch.set_num_threads(2)
data = torch.ones(1 << 24)
print(float(data.sum()))  # the notebook's own op: OpenMP starts a pool for this thread

def train(data):
    torch.set_num_threads(2)  # what a rank gets on a machine with more cores than ranks
    return float(data.sum())

print(notebook_launcher(train, args=(data,), num_processes=1, timeout=60, display="none"))
"""


def test_ranks_forked_after_the_notebook_used_openmp_can_use_it_too():
    # libgomp's pool belongs to the thread that ran a parallel region; a rank forked from that
    # thread waited forever for the pool's threads in its first op with two threads.
    done = subprocess.run([sys.executable, "-c", OPENMP_AFTER_FORK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["16777216.0", "[16777216.0]"]


class FixedStreamHandler(logging.StreamHandler):
    """A hostile handler: its stream cannot be changed, and reading it may even raise."""

    def setStream(self, stream):
        raise RuntimeError("this handler's stream is fixed")


class UnreadableStreamHandler(logging.StreamHandler):
    @property
    def stream(self):
        raise RuntimeError("no stream for you")

    @stream.setter
    def stream(self, value):
        pass


def logs_and_prints():
    logging.getLogger("nblaunch-test-hostile").warning("logged from a rank")
    print("printed from a rank")
    return os.environ["RANK"]


def test_hostile_logging_handlers_do_not_stop_a_rank_and_are_named(recorder):
    logger = logging.getLogger("nblaunch-test-hostile")
    handlers = [FixedStreamHandler(sys.stderr), UnreadableStreamHandler()]
    for handler in handlers:
        logger.addHandler(handler)
    try:
        assert notebook_launcher(logs_and_prints, num_processes=2, display=recorder) == ["0", "1"]
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
    for rank in (0, 1):
        assert "printed from a rank" in recorder.lines(rank)
        warning = [line for line in recorder.lines(rank, "stderr") if "FixedStreamHandler" in line]
        assert warning == [
            "nblaunch: the logging handler FixedStreamHandler of logger 'nblaunch-test-hostile' could not be "
            "pointed at this rank's output; what it logs here is lost"
        ]


@pytest.fixture
def phantom_module():
    """A module that exists in this process only: a spawned rank cannot import it by name."""
    module = types.ModuleType("nblaunch_phantom_module")
    exec("def train():\n    return 1\n", module.__dict__)
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


@pytest.mark.slow
def test_a_spawned_rank_that_cannot_import_the_functions_module_says_so(phantom_module):
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(phantom_module.train, num_processes=2, start_method="spawn", display="none")
    root = info.value.root_cause
    assert root.reason == (
        "could not start (loading the function and its arguments): "
        "ModuleNotFoundError: No module named 'nblaunch_phantom_module'"
    )
    assert root.traceback.startswith("Traceback (most recent call last):")
    assert "ModuleNotFoundError" in root.traceback
    assert "importable in a fresh interpreter" in root.hint
    assert root.hint in str(info.value)
    assert root.traceback.strip() in str(info.value.__cause__.__cause__)  # chained once, not in the message


class RebuildsOnlyInTheNotebook:
    """Pickles fine; rebuilding it in a rank raises (as a handle on a local resource would)."""

    def __init__(self):
        self.handle = 42

    def __setstate__(self, state):
        if "RANK" in os.environ:
            raise RuntimeError("this object cannot be rebuilt in another process")


def returns_its_argument(value):
    return value


@pytest.mark.slow
def test_a_spawned_rank_whose_argument_cannot_be_rebuilt_says_so():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(returns_its_argument, args=(RebuildsOnlyInTheNotebook(),), num_processes=2,
                          start_method="spawn", display="none")
    root = info.value.root_cause
    assert root.reason.startswith("could not start (loading the function and its arguments): RuntimeError")
    assert "in __setstate__" in root.traceback


def inner_rank():
    return int(os.environ["RANK"])


def launches_inside_rank_one():
    if os.environ["RANK"] == "1":
        return notebook_launcher(inner_rank, num_processes=2, display="none")
    return "outer"


def test_a_launch_inside_rank_one_works():
    # The forked rank kept the launcher's list of pipe ends; its own launch used to close them
    # again, now reused by its own pipes, and the inner ranks died with code 70 and no word.
    assert notebook_launcher(launches_inside_rank_one, num_processes=2, display="none") == ["outer", [0, 1]]


def never_runs():
    raise AssertionError("the function must not run when the rank cannot start")


def start_rank_with_closed(closed: list[str], recorder) -> RankFailedError:
    """Fork one rank the way a launch does, but with some of its pipe ends closed first (what
    a nested launch used to do to its ranks), and supervise it."""
    pipes = Pipes.open()
    settings = WorkerSettings(rank=0, environ={}, threads=None, parent_pid=os.getpid(), sys_path=list(sys.path))

    def child():
        for name in closed:
            os.close(getattr(pipes, name)[1])
        run_forked(settings, never_runs, (), stdout_fd=pipes.stdout[1], stderr_fd=pipes.stderr[1],
                   event_fd=pipes.events[1], control_fd=pipes.control[0])

    worker = fork_process({0: pipes}, child)
    with pytest.raises(RankFailedError) as info:
        Supervisor([worker], recorder.on_event, timeout=60).run()
    return info.value


def test_a_rank_that_cannot_attach_its_output_reports_it_on_the_event_pipe(recorder):
    error = start_rank_with_closed(["stdout"], recorder)
    root = error.root_cause
    assert root.exitcode == 70
    assert root.reason == "could not start (attaching its output to the launcher): OSError: [Errno 9] Bad file descriptor"
    assert "in attach_streams" in root.traceback and "please report it" in root.hint


def test_without_an_event_pipe_the_report_reaches_the_log(recorder):
    error = start_rank_with_closed(["stdout", "events"], recorder)
    root = error.root_cause
    assert root.exitcode == 70 and root.reason == "exited with code 70"
    tail = "\n".join(root.log_tail)
    assert "nblaunch: this rank could not start (attaching its output to the launcher)" in tail
    assert "Traceback (most recent call last):" in tail


class _Finalised:
    """Garbage with a finalizer that must run in the process that made it, never in a rank."""

    def __init__(self, record):
        self.record = record
        self.cycle = self  # only the cyclic collector frees it

    def __del__(self):
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


def collects_garbage():
    import gc

    gc.collect()  # as transformers' Trainer does after training
    return os.getpid()


def test_garbage_the_kernel_left_uncollected_is_never_finalised_in_a_rank(tmp_path):
    import gc

    record = tmp_path / "finalised"
    gc.disable()  # keep the garbage uncollected until the launch has forked
    try:
        _Finalised(str(record))
        pids = notebook_launcher(collects_garbage, num_processes=2, display="none")
    finally:
        gc.enable()
    gc.collect()
    assert record.read_text().split() == [str(os.getpid())], f"finalised in ranks {pids}"


def waits_for_its_end():
    import time

    time.sleep(600)  # stopped by the launcher long before


def test_a_fork_that_fails_midway_stops_the_ranks_already_forked(monkeypatch):
    import errno

    import psutil

    real_fork = os.fork
    forks = []

    def third_fork_fails():  # the system's process limit, reached at the third rank
        forks.append(1)
        if len(forks) == 3:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return real_fork()

    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    fds_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fork", third_fork_fails)
    with pytest.raises(BlockingIOError):
        notebook_launcher(waits_for_its_end, num_processes=4, display="none")
    monkeypatch.undo()
    assert len(forks) == 3
    left = [p for p in me.children(recursive=True) if p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # every rank's pipes closed, made or not
