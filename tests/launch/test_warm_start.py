"""Issues 44 and 52: a launch's ranks begin with what the work needs already loaded: what earlier
ranks imported is in every rank before the function starts, forked from the kernel (which
imported it at the end of the launch before) or from a generation of the launch server (which
did), wherever the launches come from (cells, a loop inside one cell, a script), and never what
would make a rank differ from a fresh one (the user's own code, a library installed anew,
variables changed since), whatever a library does to the process loading it ahead."""

from __future__ import annotations

import pytest

from warm_start_helpers import Installed, run, run_script

METHODS = [None, pytest.param("spawn", marks=pytest.mark.slow)]  # fork from this process; the launch server


@pytest.fixture
def installed():
    made = Installed()
    yield made
    made.clean()


LEARNS = """
    import mine  # the user's own module, in the notebook's folder

    def train(package):
        found = {"package": package in sys.modules, "mine": "mine" in sys.modules}
        __import__(package)
        import mine
        return found, os.getppid()

    first, _ = launch(train, PACKAGE, n=2, method=METHOD)[0]
    #%%
    ready = nblaunch.warm_start(wait=120)
    #%%
    second, parent = launch(train, PACKAGE, n=2, method=METHOD)[0]
    say(first=first, second=second, here="mine" in sys.modules, kernel=PACKAGE in sys.modules,
        server=list(ready.server_loaded), kernel_loaded=list(ready.kernel_loaded), parent=parent, me=os.getpid())
"""


@pytest.mark.parametrize("method", METHODS)
def test_what_earlier_ranks_imported_is_loaded_before_the_next_launch_but_never_the_users_own_code(
        method, installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    (tmp_path / "mine.py").write_text("VALUE = 2\n")
    [said], _ = run(LEARNS, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    assert said["first"] == {"package": False, "mine": method is None}  # forked ranks have the kernel's
    assert said["second"]["package"] is True
    if method is None:
        assert said["kernel"] and package in said["kernel_loaded"] and said["parent"] == said["me"]
    else:  # a generation of the server loaded it; this process never did
        assert not said["kernel"] and package in said["server"] and said["parent"] != said["me"]
        assert said["second"]["mine"] is False


LOOP = """
    def train(package):
        found = package in sys.modules
        __import__(package)
        return found

    found = [launch(train, PACKAGE, n=2, method=METHOD) for _ in range(3)]
    say(found=found)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", ["one cell", "a script"])
def test_a_loop_of_launches_begins_warm_from_its_second_launch_in_one_cell_and_in_a_script(
        where, method, installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    setup = f"PACKAGE, METHOD = {package!r}, {method!r}"
    [said], _ = (run if where == "one cell" else run_script)(LOOP, setup=setup, cwd=str(tmp_path))
    assert said["found"] == [[False, False], [True, True], [True, True]]


ANEW = """
    def version(package):
        return __import__(package).VERSION, os.getppid() == KERNEL

    KERNEL = os.getpid()
    first = launch(version, PACKAGE, method=METHOD)
    #%%
    nblaunch.warm_start(wait=120)
    install_anew()
    #%%
    second = launch(version, PACKAGE, method=METHOD)
    #%%
    nblaunch.warm_start(wait=120)
    #%%
    third = launch(version, PACKAGE, method=METHOD)
    say(versions=first + second + third)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.slow
def test_a_library_installed_anew_between_launches_is_the_new_one_in_the_ranks(method, installed, tmp_path):
    package = installed.package("VERSION = 1\n")
    reinstall = (f"import sys; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
                 f"from warm_start_helpers import Installed\n"
                 f"def install_anew(): Installed().rewrite({package!r}, 'VERSION = 2')\n")
    [said], _ = run(ANEW, setup=f"PACKAGE, METHOD = {package!r}, {method!r}\n" + reinstall, cwd=str(tmp_path))
    assert [v for v, _ in said["versions"]] == [1, 2, 2]
    if method is None:  # this process holds the old one: the launch after comes from the launch server
        assert [forked for _, forked in said["versions"]] == [True, False, False]


ENVIRONMENT = """
    def value(package):
        return __import__(package).VALUE, os.getppid() == KERNEL

    KERNEL = os.getpid()
    os.environ["NBL_WARM_VALUE"] = "before"
    first = launch(value, PACKAGE, method=METHOD)
    #%%
    nblaunch.warm_start(wait=120)
    os.environ["NBL_WARM_UNRELATED"] = "changed"  # no library read it: what was loaded ahead stays
    #%%
    kept = launch(value, PACKAGE, method=METHOD)
    #%%
    os.environ["NBL_WARM_VALUE"] = "after"
    second = launch(value, PACKAGE, method=METHOD)
    say(values=first + kept + second)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.slow
def test_a_library_that_reads_a_variable_at_import_sees_it_as_it_is_when_the_launch_starts(
        method, installed, tmp_path):
    package = installed.package("import os\nVALUE = os.environ.get('NBL_WARM_VALUE')\n")
    [said], _ = run(ENVIRONMENT, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    assert [v for v, _ in said["values"]] == ["before", "before", "after"]
    if method is None:  # forked while nothing it read had changed; then from the launch server
        assert [forked for _, forked in said["values"]] == [True, True, False]


BAD_DAY = """
    def use(package):
        return __import__(package).VALUE

    first = launch(use, PACKAGE, method=METHOD)
    #%%
    ready = nblaunch.warm_start(wait=120)
    #%%
    second = launch(use, PACKAGE, method=METHOD)
    #%%
    print("---", file=sys.stderr, flush=True)
    third = launch(use, PACKAGE, method=METHOD)
    say(values=first + second + third, refused=ready.refused, kernel=PACKAGE in sys.modules)
"""
# Each imports fine in a rank (RANK is set there) and misbehaves anywhere else.
MISBEHAVING = {
    "raises": "import os\nif 'RANK' not in os.environ: raise RuntimeError('only in a rank')\nVALUE = 1\n",
    "starts a thread": ("import os, threading\nif 'RANK' not in os.environ:\n"
                        "    threading.Thread(target=threading.Event().wait, daemon=True).start()\nVALUE = 1\n"),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("how", sorted(MISBEHAVING))
@pytest.mark.slow
def test_a_library_that_cannot_be_loaded_ahead_costs_the_next_launch_its_own_import_and_one_line(
        how, method, installed, tmp_path):
    package = installed.package(MISBEHAVING[how])
    [said], stderr = run(BAD_DAY, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    assert said["values"] == [1, 1, 1]
    if how == "starts a thread" and method is None:  # this process has threads anyway: loaded
        assert said["kernel"] and not said["refused"]
        return
    assert package in said["refused"], said
    line = f"nblaunch: could not load {package} ahead of the ranks"
    before, after = stderr.split("---")
    assert before.count(line) == 1 and line not in after, stderr  # said once, at the launch after
    assert ("raised RuntimeError: only in a rank" if how == "raises" else "starts threads") in before


HANGS = """
    from nblaunch.launch.ahead import launch_server, kernel_preload
    launch_server.PACKAGE_HANGS_S = kernel_preload.WAIT_FOR_A_PACKAGE_S = 3.0

    def use(package):
        return __import__(package).VALUE

    first = launch(use, PACKAGE, method=METHOD)
    #%%
    # Between the cells the import here began (and never ends): this cell waited its 3 s first.
    second = launch(use, PACKAGE, method=METHOD)
    ready = nblaunch.warm_start(wait=120 if METHOD else 5)
    #%%
    third = launch(use, PACKAGE, method=METHOD)
    say(values=first + second + third, refused=ready.refused)
"""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.slow
def test_a_library_whose_import_hangs_where_it_is_loaded_ahead_is_given_up(method, installed, tmp_path):
    package = installed.package("import os, time\nif 'RANK' not in os.environ: time.sleep(3600)\nVALUE = 1\n")
    [said], stderr = run(HANGS, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path))
    assert said["values"] == [1, 1, 1]
    assert "did not finish" in said["refused"].get(package, "") or "had not finished" in said["refused"].get(package, "")


GONE = """
    def use(package):
        try:
            return __import__(package).VALUE
        except ImportError:
            return "gone"

    first = launch(use, PACKAGE, method=METHOD)
    #%%
    nblaunch.warm_start(wait=120)
    remove()
    #%%
    second = launch(use, PACKAGE, method=METHOD)
    #%%
    ready = nblaunch.warm_start(wait=120)
    #%%
    third = launch(use, PACKAGE, method=METHOD)
    say(values=first + second + third, refused=ready.refused)
"""


@pytest.mark.slow
def test_a_library_removed_from_disk_between_launches_is_gone_from_the_next_ranks(installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    remove = (f"import shutil\ndef remove(): shutil.rmtree({installed.site!r} + '/' + {package!r})\n")
    [said], _ = run(GONE, setup=f"PACKAGE, METHOD = {package!r}, 'spawn'\n" + remove, cwd=str(tmp_path))
    assert said["values"] == [1, "gone", "gone"]
    assert "ModuleNotFoundError" in said["refused"].get(package, "")


COLLIDING = """
    def use(package):
        return __import__(package).VALUE

    first = launch(use, PACKAGE)
    #%%
    # The kernel began to import PACKAGE between the cells (a slow import, with a circle in it):
    # this cell waits for it, or its own import would meet a half-initialised module.
    __import__(PACKAGE + ".sub")
    import importlib
    say(value=importlib.import_module(PACKAGE).VALUE, first=first)
"""


@pytest.mark.slow
def test_a_cell_that_imports_what_the_kernel_imports_ahead_gets_it_whole(installed, tmp_path):
    package = installed.package("import os, time\nif 'RANK' not in os.environ: time.sleep(2)\n"
                                "from . import sub\nVALUE = sub.VALUE\n")
    with open(f"{installed.site}/{package}/sub.py", "w") as sub:
        sub.write(f"import {package}\nVALUE = 7\n")
    [said], _ = run(COLLIDING, setup=f"PACKAGE = {package!r}", cwd=str(tmp_path))
    assert said == {"value": 7, "first": [7]}


LOUD = """
    def use(package):
        return __import__(package).VALUE

    first = launch(use, PACKAGE)
    #%%
    ready = nblaunch.warm_start(wait=120)
    say(first=first, loaded=PACKAGE in sys.modules, said=ready.said.get(PACKAGE, ""), shown=repr(ready))
"""


@pytest.mark.slow
def test_what_a_library_writes_as_the_kernel_imports_it_ahead_is_kept_from_the_cells(installed, tmp_path):
    # As tqdm.autonotebook does: a warning at import (here, only where no rank's RANK is set).
    package = installed.package("import os, sys, warnings\nif 'RANK' not in os.environ:\n"
                                "    print('BANNER of the library')\n"
                                "    warnings.warn('LOUD at import', UserWarning)\nVALUE = 3\n")
    [said], text = run(LOUD, setup=f"PACKAGE = {package!r}", cwd=str(tmp_path))
    assert said["first"] == [3] and said["loaded"]
    shown = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("RESULT "))
    assert "LOUD" not in shown and "BANNER" not in shown  # under no cell: the user imported nothing
    assert "BANNER of the library" in said["said"] and "UserWarning: LOUD at import" in said["said"]
    assert f"{package} wrote as this process imported it: BANNER of the library" in said["shown"]
