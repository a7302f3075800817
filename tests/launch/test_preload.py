"""Issue 60: a launch's ranks begin with what they will import already loaded, imported once in
the process they are forked from (this one, or the launch server) before the fork: what the
function's code imports from its first launch on, what its ranks imported from the next; never
what would make a rank differ from a fresh one (the user's own code, a library installed anew,
variables changed since), whatever a library does where it is imported first; and nothing runs
after a launch (a script's launch returns, and the script exits, as soon as the ranks are done)."""

from __future__ import annotations

import pytest

from preload_helpers import Installed, run, run_script

METHODS = [None, pytest.param("spawn", marks=pytest.mark.slow)]  # fork from this process; the launch server


@pytest.fixture
def installed():
    made = Installed()
    yield made
    made.clean()


STATIC = """
    import mine  # the user's own module, in the notebook's folder

    def train():
        found = {"package": PACKAGE in sys.modules, "mine": "mine" in sys.modules}
        import {package}
        import mine
        return found, os.getppid()

    first = launch(train, n=2, method=METHOD)
    #%%
    second = launch(train, n=2, method=METHOD)
    ready = nblaunch.preloaded()
    say(first=[f for f, _ in first], parents=[p for _, p in first + second], me=os.getpid(),
        kernel=PACKAGE in sys.modules, here=list(ready.here), server=list(ready.server))
"""


@pytest.mark.parametrize("method", METHODS)
def test_what_the_function_imports_is_imported_once_where_its_ranks_come_from_before_its_first_launch(
        method, installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    (tmp_path / "mine.py").write_text("VALUE = 2\n")
    [said], _ = run(STATIC.replace("{package}", package), setup=f"PACKAGE, METHOD = {package!r}, {method!r}",
                    cwd=str(tmp_path))
    if method is None:  # forked from this process, which imported it first: the user's module is the kernel's
        assert said["first"] == [{"package": True, "mine": True}] * 2
        assert said["kernel"] and package in said["here"] and set(said["parents"]) == {said["me"]}
    else:  # the launch server imported it; this process never did, and never the user's own module
        assert said["first"] == [{"package": True, "mine": False}] * 2
        assert not said["kernel"] and package in said["server"] and said["me"] not in said["parents"]


LEARNS = """
    def train(package):
        found = package in sys.modules
        __import__(package)  # a name the code computes: no import statement says it
        return found

    found = [launch(train, PACKAGE, n=2, method=METHOD) for _ in range(3)]
    say(found=found)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", ["one cell", "a script"])
def test_what_the_ranks_imported_is_imported_before_the_next_launch_in_one_cell_and_in_a_script(
        where, method, installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    setup = f"PACKAGE, METHOD = {package!r}, {method!r}"
    [said], _ = (run if where == "one cell" else run_script)(LEARNS, setup=setup, cwd=str(tmp_path))
    assert said["found"] == [[False, False], [True, True], [True, True]]


ANEW = """
    def version(package):
        return __import__(package).VERSION

    first = launch(version, PACKAGE, method=METHOD)
    second = launch(version, PACKAGE, method=METHOD)
    #%%
    install_anew()
    print("---", file=sys.stderr, flush=True)
    #%%
    third = launch(version, PACKAGE, method=METHOD)
    fourth = launch(version, PACKAGE, method=METHOD)
    say(versions=first + second + third + fourth, kernel=sys.modules[PACKAGE].VERSION if PACKAGE in sys.modules else None)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.slow
def test_a_library_installed_anew_between_launches_is_the_new_one_in_the_ranks(method, installed, tmp_path):
    package = installed.package("VERSION = 1\n")
    reinstall = (f"import sys; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
                 f"from preload_helpers import Installed\n"
                 f"def install_anew(): Installed().rewrite({package!r}, 'VERSION = 2')\n")
    [said], stderr = run(ANEW, setup=f"PACKAGE, METHOD = {package!r}, {method!r}\n" + reinstall, cwd=str(tmp_path))
    assert said["versions"] == [1, 1, 2, 2]
    if method is None:  # this process holds the old one; forked ranks import the new one afresh, and it is said once
        assert said["kernel"] == 1
        after = stderr.split("---")[1]
        assert after.count(f"nblaunch: {package} was installed anew since this process imported it") == 1, stderr


ENVIRONMENT = """
    def value(package):
        return __import__(package).VALUE

    os.environ["NBL_PRELOAD_VALUE"] = "before"
    first = launch(value, PACKAGE, method=METHOD)
    second = launch(value, PACKAGE, method=METHOD)
    os.environ["NBL_PRELOAD_UNRELATED"] = "changed"  # no library read it: what was imported stays
    kept = launch(value, PACKAGE, method=METHOD)
    os.environ["NBL_PRELOAD_VALUE"] = "after"
    changed = launch(value, PACKAGE, method=METHOD)
    say(values=first + second + kept + changed, replaced=nblaunch.preloaded().server_replaced)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.slow
def test_a_library_that_reads_a_variable_at_import_sees_it_as_it_is_when_the_launch_starts(
        method, installed, tmp_path):
    package = installed.package("import os\nVALUE = os.environ.get('NBL_PRELOAD_VALUE')\n")
    [said], _ = run(ENVIRONMENT, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    assert said["values"] == ["before", "before", "before", "after"]
    if method == "spawn":
        assert "NBL_PRELOAD_VALUE, which its imports read, has changed" in said["replaced"]


BAD_DAY = """
    def use(package):
        return __import__(package).VALUE

    first = launch(use, PACKAGE, method=METHOD)
    second = launch(use, PACKAGE, method=METHOD)
    print("---", file=sys.stderr, flush=True)
    third = launch(use, PACKAGE, method=METHOD)
    say(values=first + second + third, refused=nblaunch.preloaded().refused, kernel=PACKAGE in sys.modules)
"""
# Each imports fine in a rank (RANK is set there) and misbehaves anywhere else.
MISBEHAVING = {
    "raises": "import os\nif 'RANK' not in os.environ: raise RuntimeError('only in a rank')\nVALUE = 1\n",
    "starts a thread": ("import os, threading\nif 'RANK' not in os.environ:\n"
                        "    threading.Thread(target=threading.Event().wait, daemon=True).start()\nVALUE = 1\n"),
    "calls sys.exit": "import os, sys\nif 'RANK' not in os.environ: sys.exit(3)\nVALUE = 1\n",
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("how", sorted(MISBEHAVING))
@pytest.mark.slow
def test_a_library_that_cannot_be_imported_first_is_left_to_the_ranks_with_one_line(how, method, installed, tmp_path):
    package = installed.package(MISBEHAVING[how])
    [said], stderr = run(BAD_DAY, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    assert said["values"] == [1, 1, 1]
    if how == "starts a thread" and method is None:  # this process has threads anyway: imported
        assert said["kernel"] and not said["refused"]
        return
    assert package in said["refused"], said
    before, after = stderr.split("---")
    where = "here" if method is None else "in the launch server"
    line = f"nblaunch: could not import {package} {where} for the ranks"
    assert before.count(line) == 1 and line not in after, stderr  # said once, at the launch that tried
    why = {"raises": "raised RuntimeError: only in a rank", "starts a thread": "starts threads",
           "calls sys.exit": "raised SystemExit: 3"}[how]
    assert why in before


HANGS = """
    from nblaunch.launch.starting import preload, server
    preload.WAIT_FOR_A_PACKAGE_S = server.PACKAGE_HANGS_S = 3.0

    def use(package):
        return __import__(package).VALUE

    first = launch(use, PACKAGE, method=METHOD)
    began = time.monotonic()
    second = launch(use, PACKAGE, method=METHOD)  # waited 3 s for the import, then went on without it
    took = time.monotonic() - began
    third = launch(use, PACKAGE, method=METHOD)
    say(values=first + second + third, refused=nblaunch.preloaded().refused, took=took)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.slow
def test_a_library_whose_import_hangs_where_the_ranks_come_from_is_given_up(method, installed, tmp_path):
    package = installed.package("import os, time\nif 'RANK' not in os.environ: time.sleep(3600)\nVALUE = 1\n")
    [said], _ = run(HANGS, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    assert said["values"] == [1, 1, 1]
    assert "not finish" in said["refused"].get(package, ""), said
    assert 3 <= said["took"] < 60


GONE = """
    def use(package):
        try:
            return __import__(package).VALUE
        except ImportError:
            return "gone"

    first = launch(use, PACKAGE, method=METHOD)
    remove()
    second = launch(use, PACKAGE, method=METHOD)
    third = launch(use, PACKAGE, method=METHOD)
    say(values=first + second + third, refused=nblaunch.preloaded().refused)
"""


@pytest.mark.slow
def test_a_library_removed_from_disk_between_launches_is_gone_from_the_next_ranks(installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    remove = f"import shutil\ndef remove(): shutil.rmtree({installed.site!r} + '/' + {package!r})\n"
    [said], _ = run(GONE, setup=f"PACKAGE, METHOD = {package!r}, 'spawn'\n" + remove, cwd=str(tmp_path))
    assert said["values"] == [1, "gone", "gone"]  # no longer installed: not wanted, nothing to refuse


LOUD = """
    def use():
        import {package}
        return {package}.VALUE

    first = launch(use)
    #%%
    second = launch(use)
    say(first=first, second=second)
"""


@pytest.mark.slow
def test_what_a_library_prints_as_it_is_imported_for_the_ranks_shows_once_under_the_launch_that_did_it(
        installed, tmp_path):
    # As tqdm.autonotebook does: a warning at import (here, only where no rank's RANK is set).
    package = installed.package("import os, warnings\nif 'RANK' not in os.environ:\n"
                                "    print('BANNER of the library')\n"
                                "    warnings.warn('LOUD at import', UserWarning)\nVALUE = 3\n")
    notebook = run(LOUD.replace("{package}", package), cwd=str(tmp_path), cells=True)
    launching, later = (notebook[1], notebook[2])
    assert "BANNER of the library" in launching and "LOUD at import" in launching
    assert "BANNER" not in later and "LOUD" not in later


FRESH = """
    import torch.distributed as dist

    def leave_state_behind(package, precision):
        module = __import__(package)
        seen = {"counter": module.counter, "group": dist.is_initialized(), "precision": None}
        module.counter += 1
        from nblaunch import Accelerator, AcceleratorState
        seen["state"] = bool(AcceleratorState._shared_state)
        accelerator = Accelerator(mixed_precision=precision, cpu=True)
        dist.barrier()
        seen["precision"] = accelerator.mixed_precision
        globals()["left_over"] = "from an earlier launch"
        return seen, os.getpid()

    runs = [launch(leave_state_behind, PACKAGE, precision, n=2, method=METHOD) for precision in ("bf16", "no", "bf16")]
    say(runs=runs)
"""


@pytest.mark.parametrize("method", METHODS)
def test_a_launch_never_sees_another_launchs_python_state(method, installed, tmp_path):
    package = installed.package("counter = 0\n")
    [said], _ = run(FRESH, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    seen = [s for run_ in said["runs"] for s, _ in run_]
    assert [s["counter"] for s in seen] == [0] * 6  # fresh module globals
    assert not any(s["group"] or s["state"] for s in seen)  # no process group, no Accelerator state
    assert [s["precision"] for s in seen] == ["bf16"] * 2 + ["no"] * 2 + ["bf16"] * 2
    assert len({pid for run_ in said["runs"] for _, pid in run_}) == 6  # a fresh process each time


AT_EXIT = """
    import gc

    class Flushes:
        def __init__(self, path):
            self.path, self.me = path, self  # a cycle: only the garbage collector frees it
        def __del__(self):
            open(self.path, "w").write("finalised")

    def use():
        import {package}
        return 1

    launch(use)
    Flushes(FINALISED)  # garbage at the script's end
    gc.disable()
"""


@pytest.mark.slow
def test_a_script_that_imported_for_its_ranks_still_finalises_its_garbage_at_exit(installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    finalised = tmp_path / "finalised"
    run_script(AT_EXIT.replace("{package}", package), setup=f"FINALISED = {str(finalised)!r}", cwd=str(tmp_path))
    assert finalised.read_text() == "finalised"


GPU_VISIBLE = """
import json, sys
from nblaunch import notebook_launcher

def train():
    import torch, {package}
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return {package}.VALUE

values = notebook_launcher(train, num_processes=1, cpu=True, display="none")
print("RESULT " + json.dumps({{"values": values, "package": "{package}" in sys.modules,
                              "dynamo": "torch._dynamo" in sys.modules}}))
"""


def test_where_a_gpu_is_visible_this_process_imports_only_torchs_and_nblaunchs_modules_for_its_ranks(
        installed, tmp_path):
    """Any other library could start CUDA at import, and this process could then no longer fork
    ranks that use it (the GPU is NVML's stand-in)."""
    from stand_ins import FAKE_NVML, run_child, stand_in_library

    package = installed.package("VALUE = 5\n")
    env = {**stand_in_library(tmp_path, "libnvidia-ml.so.1", FAKE_NVML), "FAKE_NVML_GPUS": "1"}
    found, _ = run_child(GPU_VISIBLE.format(package=package), tmp_path, env)
    assert found == {"values": [5], "package": False, "dynamo": True}


@pytest.mark.slow
def test_a_library_whose_import_ends_the_launch_server_is_left_to_the_ranks(installed, tmp_path):
    """A crash in a library's C code where it is imported first (here: it ends its process) costs
    that launch a new server, and the library is never imported there again."""
    package = installed.package("import os\nif 'RANK' not in os.environ: os._exit(1)\nVALUE = 1\n")
    [said], stderr = run(BAD_DAY, setup=f"PACKAGE, METHOD = {package!r}, 'spawn'", cwd=str(tmp_path))
    assert said["values"] == [1, 1, 1]
    assert "ended the launch server" in said["refused"].get(package, ""), said


def test_code_that_cannot_be_read_is_launched_as_it_is(tmp_path):
    """A global that answers every attribute (a mock) is skipped by the reading, never the launch's failure."""
    from unittest import mock

    from nblaunch import notebook_launcher
    from nblaunch.launch.starting.rank_imports import wanted

    anything = mock.MagicMock()

    def uses_a_mock():
        return anything.__class__.__name__

    assert wanted(uses_a_mock) == [] or isinstance(wanted(uses_a_mock), list)
    assert notebook_launcher(uses_a_mock, num_processes=1, display="none") == ["MagicMock"]


AFTER = """
    import threading, psutil

    def use():
        import {package}
        return {package}.VALUE

    values = launch(use, n=2)
    say(values=values, threads=sorted(t.name for t in threading.enumerate() if t.name.startswith("nblaunch")),
        children=[p.name() for p in psutil.Process().children()])
"""


def test_nothing_of_a_launch_runs_after_it_returns(installed, tmp_path):
    """What readies a launch is done before its fork: once the call returns, no thread of
    nblaunch's works for a next launch, and no process waits for one."""
    package = installed.package("VALUE = 4\n")
    [said], _ = run_script(AFTER.replace("{package}", package), cwd=str(tmp_path))
    assert said == {"values": [4, 4], "threads": ["nblaunch-forks"], "children": []}
