"""Accelerate's own distributed test scripts, from the installed package, ported by README's
import change: the count docs/coming-from-accelerate.md publishes is the count measured here, and every call that
fails under nblaunch (but passes under Accelerate) is listed with its reason in
docs/accelerator.md."""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("accelerate")

import accelerate_scripts  # noqa: E402  (pytest puts this folder on sys.path: it has no __init__.py)

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.slow
def test_accelerates_scripts_pass_as_readme_says_and_every_failure_is_explained():
    import accelerate

    outcomes = accelerate_scripts.conformance()
    passed, total = accelerate_scripts.summary(outcomes)
    readme = " ".join(_read("docs/coming-from-accelerate.md").split())
    claim = re.search(r"(\d+) of the (\d+) test calls that pass under Accelerate pass under nblaunch "
                      r"\(accelerate ([\d.]+)", readme)
    assert claim, "docs/coming-from-accelerate.md must give the count"
    table = "\n".join(f"{o.script} | {o.call} | {o.accelerate} | {o.nblaunch}" for o in outcomes)
    assert (passed, total, accelerate.__version__) == (int(claim[1]), int(claim[2]), claim[3]), table
    documented = _read("docs/accelerator.md").split("## Accelerate's test scripts", 1)[1]
    failing = {o.call.split(" #")[0] for o in outcomes if o.accelerate == "pass" and o.nblaunch != "pass"}
    unexplained = {name for name in failing if f"`{name}`" not in documented}
    assert not unexplained, f"failing calls missing from docs/accelerator.md: {unexplained}\n{table}"
