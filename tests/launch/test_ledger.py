"""The ledger of what ranks imported (``launch/ahead/ledger``): a package that starts CUDA is kept
from the CUDA-clean processes only, and a package not loaded ahead is said once, under a launch
whose ranks imported it (issue 52: it was said under whatever launch came next); ranks tell
what they import as they go."""

from __future__ import annotations

import os
import threading
import time

from nblaunch import notebook_launcher
from nblaunch.launch.ahead.ledger import Ledger, ledger
from nblaunch.server.loading import CUDA
from warm_start_helpers import Installed


def test_a_package_that_starts_cuda_is_loaded_ahead_only_where_cuda_is_allowed():
    ledger = Ledger()
    ledger.learn(["nbl_cuda_lib", "nbl_cuda_lib.models", "nbl_plain"])
    ledger.refuse("nbl_cuda_lib", CUDA, seconds=4.2)
    assert ledger.for_kernel() == ["nbl_plain"]  # this process forks: never CUDA here
    assert "nbl_cuda_lib" not in ledger.for_server()  # generations fork ranks: never CUDA there
    assert ledger.for_cuda() == ["nbl_cuda_lib", "nbl_cuda_lib.models", "nbl_plain"]  # ranks on standby


def test_a_package_not_loaded_ahead_is_said_under_a_launch_whose_ranks_imported_it_once():
    ledger = Ledger()
    ledger.learn(["nbl_raises"])
    ledger.refuse("nbl_raises", "it raised OSError: no such file", seconds=1.5)
    assert ledger.notices(["numpy"]) == []  # another launch: not its line
    [line] = ledger.notices(["nbl_raises.sub"])
    assert "could not load nbl_raises ahead of the ranks: it raised OSError: no such file" in line
    assert "(1.5 s here)" in line and "import it in a cell" in line  # what it costs, what to do
    assert ledger.notices(["nbl_raises"]) == []  # once
    assert ledger.for_kernel() == [] and "nbl_raises" in ledger.refused()


def imports_then_waits(package: str, go_on: str) -> bool:
    __import__(package)
    while not os.path.exists(go_on):  # until the test has seen what it was told
        time.sleep(0.02)
    return True


def test_a_rank_tells_what_it_imported_while_it_runs(tmp_path):
    """What a long launch's ranks import is known before they end, so the next launch's warm-up
    can run beside them (on cores they leave free)."""
    installed = Installed()
    try:
        package = installed.package("VALUE = 1\n")
        go_on = str(tmp_path / "go-on")
        launch = notebook_launcher(imports_then_waits, args=(package, go_on), num_processes=1, display="none",
                                   block=False, stall_after=1.0)  # the look-out looks every 0.25 s
        try:
            told, backstop = threading.Event(), time.monotonic() + 30
            while not told.wait(0.05) and time.monotonic() < backstop:
                if package in ledger().learned():
                    told.set()
            assert told.is_set() and launch.status == "running"  # told, and the rank still waits
        finally:
            open(go_on, "w").close()
        assert launch.result() == [True]
    finally:
        installed.clean()
