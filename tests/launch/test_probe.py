"""The probe a GPU machine's kernel runs before it imports ahead (``kernel_preload.probe``): a
fork of this process imports each package and says what that did, and is gone after."""

from __future__ import annotations

import sys

import psutil
import pytest

from nblaunch.launch.ahead.kernel_preload import probe
from warm_start_helpers import Installed


@pytest.fixture
def installed():
    made = Installed()
    yield made
    made.clean()


def test_the_probe_judges_each_package_in_a_fork_and_leaves_this_process_as_it_was(installed):
    fine = installed.package("VALUE = 1\n")
    broken = installed.package("raise RuntimeError('not on this machine')\n")
    children_before = {p.pid for p in psutil.Process().children()}
    verdicts = probe([(fine, [fine]), (broken, [broken])])
    assert verdicts[fine] == "ok"
    assert verdicts[broken].startswith("raised RuntimeError: not on this machine")
    assert fine not in sys.modules and broken not in sys.modules  # imported there, not here
    assert {p.pid for p in psutil.Process().children()} == children_before  # killed and reaped
