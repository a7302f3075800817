"""The benchmark harness must not rot: run one cheap measurement with tiny sizes, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_benchmark_harness_runs_one_measurement(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "output", "--size", "tiny", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    result = report["results"]["output"]
    assert result["status"] == "ok"
    assert report["machine"]["torch"]
    rows = {r["impl"]: r for r in result["rows"] if r["metric"] == "lines lost"}
    assert rows and all(r["max"] == 0 for r in rows.values()), rows
    assert "| implementation |" in (tmp_path / "latest.md").read_text()
