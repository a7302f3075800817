"""notebooks/07_long_runs.ipynb, top to bottom in a real kernel, with the kernel restarted where
the notebook says to (a hard restart: the process is killed): the detached launch and the
detached warm ranks carry on, and the cells after each restart find them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import nbformat
import psutil
import pytest
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

from nbcells import everything_shown

pytestmark = pytest.mark.notebooks


def cell(nb, text: str):
    (found,) = [c for c in nb.cells if c.cell_type == "code" and text in c.source]
    return found

NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "07_long_runs.ipynb"


def test_the_long_runs_notebook_carries_on_across_kernel_restarts(tmp_path):
    if importlib.util.find_spec("sklearn") is None:  # not imported here: it sets variables in os.environ
        pytest.skip("scikit-learn is not installed")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    restarts, kernel_pids = 0, []
    with client.setup_kernel(env=dict(os.environ, NBLAUNCH_STATE_DIR=str(tmp_path / "state"))):
        for index, each in enumerate(nb.cells):
            if "restart-kernel" in each.metadata.get("tags", []):
                kernel_pids.append(client.km.provisioner.process.pid)
                run_sync(client.km.restart_kernel)(now=True)  # kills the kernel's process, starts a new one
                run_sync(client.kc.wait_for_ready)(timeout=60)
                restarts += 1
            elif each.cell_type == "code":
                client.execute_cell(each, index)
    assert restarts == 2 and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                                     for pid in kernel_pids)
    listed = everything_shown(cell(nb, "nblaunch.launches()"))
    # Starting, still: its supervisor may be importing what the ranks will import (issue 60).
    assert re.search(r"\w{12}\s+(starting|running|done)\s+\S+ \S+\s+train on 2 ranks", listed), listed
    accuracy = everything_shown(cell(nb, "accuracy = launch.result()"))
    values = [float(v) for v in re.findall(r"0\.\d+", accuracy)]
    assert len(values) == 2 and min(values) > 0.9, accuracy
    stopped = everything_shown(cell(nb, "timeout=5"))  # the stop: one step on every rank, saved, named
    assert re.search(r"every rank stopped after \d+ training steps and saved its state in \S+checkpoint_0", stopped), stopped
    resumed = everything_shown(cell(nb, "args=(1e-3,)"))
    assert "resumed from" in resumed and "at lr 0.001" in resumed and "at lr 0.01" not in resumed, resumed
    assert min(float(v) for v in re.findall(r"0\.\d+", resumed.split("accuracy on every rank")[-1])) > 0.8, resumed
    before = everything_shown(cell(nb, "weights = torch.randn(1000)"))
    after = everything_shown(cell(nb, "the same numbers as before the restart"))
    assert "reattached to the detached warm ranks" in after, after
    assert re.findall(r"\[-?\d+\.\d+, -?\d+\.\d+\]", before)[-1] == re.findall(r"\[-?\d+\.\d+, -?\d+\.\d+\]", after)[-1]
    # Nothing left: the launch ended, `%distributed stop` closed the warm ranks.
    from nblaunch.detached import store

    states = [json.loads((folder / "state.json").read_text()) for folder in (tmp_path / "state" / "detached").iterdir()]
    assert sorted(s["kind"] for s in states) == ["launch", "pool"]
    _, alive = psutil.wait_procs([psutil.Process(s["supervisor_pid"]) for s in states
                                  if psutil.pid_exists(s["supervisor_pid"])], timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not any(store.supervisor_alive(s) for s in states)
    errors = [c for c in nb.cells if c.cell_type == "code" and any(o.output_type == "error" for o in c.outputs)]
    assert not errors, [everything_shown(c) for c in errors]
