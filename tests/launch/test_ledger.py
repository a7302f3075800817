"""The ledger of what ranks imported (``launch/ahead/ledger``): a package that starts CUDA is kept
from the CUDA-clean processes only, and a package not loaded ahead is said once, under a launch
whose ranks imported it (issue 52: it was said under whatever launch came next)."""

from __future__ import annotations

from nblaunch.launch.ahead.ledger import Ledger
from nblaunch.server.loading import CUDA


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
