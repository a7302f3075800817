"""The launch server (issue 37): a launch that cannot fork from this process has its ranks forked
by one server per process, which imported torch and never touched CUDA; it is reused, follows this
process's environment and folder, is replaced when it dies, and dies with its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nblaunch import RankFailedError, notebook_launcher
from processes import gone


def where_am_i(tag: str) -> tuple:
    # Before anything imports it here: a rank the server forked has torch already.
    torch_was_there = "torch._C" in sys.modules
    return os.getpid(), os.getppid(), torch_was_there, os.environ.get("NBLAUNCH_TEST_TAG"), os.getcwd(), tag


def spawn(function, *args, **options):
    return notebook_launcher(function, args=args, num_processes=2, start_method="spawn", display="none", **options)


@pytest.mark.slow
def test_later_launches_reuse_the_server_and_see_this_processes_environment_and_folder_as_they_are_now(
        tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_TEST_TAG", "first")
    here = os.getcwd()
    first = spawn(where_am_i, "a")
    monkeypatch.setenv("NBLAUNCH_TEST_TAG", "second")
    monkeypatch.chdir(tmp_path)
    second = spawn(where_am_i, "b")
    servers = {ppid for _, ppid, *_ in first + second}
    assert len(servers) == 1 and os.getpid() not in servers  # one server, not this process
    (server,) = servers
    assert psutil.Process(server).name() == "nblaunch-server"
    assert len({pid for pid, *_ in first + second}) == 4  # a fresh process for every rank
    assert all(torch_there for _, _, torch_there, *_ in first + second)
    assert [(tag, cwd) for *_, tag, cwd, _ in first] == [("first", here)] * 2
    assert [(tag, cwd) for *_, tag, cwd, _ in second] == [("second", str(tmp_path))] * 2


@pytest.mark.slow
@pytest.mark.parametrize("launched", ["once it is gone", "at once"])
def test_a_dead_server_is_replaced_by_the_next_launch(launched):
    """At once: the launch asks the dead process before the kernel has heard it died, and asks
    again elsewhere (the server's base, or a new server)."""
    for _ in range(2):  # the second time, the server that replaced the first
        (_, server, *_), _ = spawn(where_am_i, "before")
        os.kill(server, signal.SIGKILL)
        if launched == "once it is gone":
            assert gone([server], within=10)
        after = spawn(where_am_i, "after")
        assert {ppid for _, ppid, *_ in after} != {server}
        assert [tag for *_, tag in after] == ["after", "after"]


def wait_then_return(folder: str) -> int:
    with open(os.path.join(folder, f"{os.getpid()}.rank.tmp"), "w") as mine:
        mine.write(str(os.getppid()))
    os.replace(mine.name, mine.name[:-len(".tmp")])  # whole, or not there
    time.sleep(600)
    return 0


def test_a_server_killed_during_a_launch_fails_it_at_once_and_leaves_nothing(tmp_path):
    spawn(where_am_i, "the server has imported what this launch's ranks import")
    launch = notebook_launcher(wait_then_return, args=(str(tmp_path),), num_processes=2, start_method="spawn",
                               display="none", block=False)
    deadline = time.monotonic() + 60  # a backstop: the ranks are up in a fraction of a second
    while len(said := list(tmp_path.glob("*.rank"))) < 2 and time.monotonic() < deadline:
        assert not launch.done(), launch.result()
        time.sleep(0.05)
    ranks = [int(path.name.split(".")[0]) for path in said]
    (server,) = {int(path.read_text()) for path in said}  # the process that forked them
    assert psutil.Process(server).name() == "nblaunch-server"
    os.kill(server, signal.SIGKILL)
    with pytest.raises(RankFailedError, match="killed by SIGKILL: its launch server .* died") as failed:
        launch.result(timeout=60)  # the ranks die with their server
    assert "out-of-memory" not in str(failed.value)  # the blame is known: not a guess
    assert gone(ranks + [server], within=10)


KERNEL = textwrap.dedent("""
    import os, sys, time
    from nblaunch import notebook_launcher

    def wait():
        time.sleep(600)

    launch = notebook_launcher(wait, num_processes=2, start_method="spawn", display="none", block=False)
    deadline = time.monotonic() + 60
    while len(launch.ranks) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    import psutil
    server = [p for p in psutil.Process().children() if p.name() == "nblaunch-server"][0]
    print("PIDS", server.pid, *[c.pid for c in server.children()], flush=True)
    if sys.argv[1] == "killed":
        os.kill(os.getpid(), 9)
    launch.cancel()
    try:
        launch.result()
    except BaseException:
        pass
""")


@pytest.mark.parametrize("how", ["killed", "exits"])
def test_the_server_and_its_ranks_end_with_their_process(how, tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in done.stdout.split("PIDS", 1)[1].split()]
    assert len(pids) == 3, done.stdout + done.stderr
    assert gone(pids, within=10), [psutil.Process(p).name() for p in pids if psutil.pid_exists(p)]


EARLY = [
    "import ctypes, json, os, sys, psutil\n"
    "ctypes.CDLL('libcuda.so.1').cuInit(0)  # what torch.cuda.is_available() does\n"
    "import nblaunch\nprint('CHILDREN ' + json.dumps([' '.join(p.cmdline()) for p in psutil.Process().children()]))",
    "def found():\n    return 'torch._dynamo' in sys.modules, os.getppid() != KERNEL\nKERNEL = os.getpid()\n"
    "print('FIRST ' + json.dumps(nblaunch.notebook_launcher(found, num_processes=1, display='none')))",
]


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["initialised", "absent"])
def test_a_notebook_that_started_cuda_has_its_launch_server_up_before_its_first_launch(driver, tmp_path, monkeypatch):
    """Where CUDA is started when nblaunch is imported (the driver a stand-in here), every launch
    comes from the launch server: it starts at the import, with what a first training step needs."""
    import json
    import re

    import nbformat
    from nbclient import NotebookClient

    from nbcells import everything_shown
    from stand_ins import stand_in_library
    from test_cuda_initialised_detection import FAKE_DRIVER

    cells = list(EARLY)
    if driver == "initialised":
        for name, value in stand_in_library(tmp_path, "libcuda.so.1", FAKE_DRIVER).items():
            monkeypatch.setenv(name, value)
    else:
        cells[0] = cells[0].replace("ctypes.CDLL('libcuda.so.1').cuInit(0)", "pass")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    def tagged(cell, tag):
        return json.loads(re.search(rf"^{tag} (.*)$", everything_shown(cell), re.M).group(1))

    children = tagged(notebook.cells[0], "CHILDREN")
    started = any("nblaunch.launch.starting.server_process" in command for command in children)
    if driver == "absent":
        assert not started and tagged(notebook.cells[1], "FIRST") == [[False, False]]  # forked, nothing early
    else:
        assert started, children
        assert tagged(notebook.cells[1], "FIRST") == [[True, True]]  # from the server, torch._dynamo there
