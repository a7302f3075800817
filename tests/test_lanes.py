"""The lanes (tests/lanes.py): the default run keeps its promise, and every lane is run by CI and
listed for contributors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lanes import DEFAULT_COVERS, DEFAULT_RUN, LANES

ROOT = Path(__file__).resolve().parent.parent


def test_the_default_run_keeps_a_test_of_every_part_of_the_product(request):
    config = request.config
    if not config.stash[DEFAULT_RUN] or config.option.keyword or config.getoption("lf", False):
        pytest.skip("checks the default run's selection: a plain `pytest`")
    selected = {item.nodeid for item in request.session.items}  # every worker's, under -n
    lost = {part: test for part, test in DEFAULT_COVERS.items() if test not in selected}
    assert not lost, f"the default run lost its test of {lost}: keep it out of the lanes, or name another in tests/lanes.py"


def test_every_lane_is_run_by_ci_and_listed_in_contributing():
    ci = (ROOT / ".ci" / "run").read_text()
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    for lane in LANES:
        assert re.search(rf"^lane {lane} .*-m {lane}\b", ci, re.M), f".ci/run does not run the {lane} lane"
        assert re.search(rf"^\| `{lane}` \|", contributing, re.M), f"CONTRIBUTING.md's lanes table has no {lane}"

