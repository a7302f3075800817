"""Issue 44: in a notebook on a machine with a GPU the launch server is up, warm, before the first
launch needs it (a real kernel, nbclient; the GPU is NVML's stand-in, ``tests/stand_ins.py``);
on a machine without one, and outside a notebook, nothing starts early."""

from __future__ import annotations

import json
import re

import nbformat
import pytest
from nbclient import NotebookClient

from nbcells import everything_shown
from stand_ins import FAKE_NVML, stand_in_library

CELLS = [
    "import json, os, sys, psutil\nimport nblaunch\nfrom nblaunch.launch.ahead import early_start\n"
    "early_start.wait_started(60)\n"
    "print('BEFORE ' + json.dumps([' '.join(p.cmdline()) for p in psutil.Process().children()]))",
    "ready = nblaunch.warm_start(wait=120)\nprint('LOADED ' + json.dumps(list(ready.server_loaded)))",
    "def found():\n    return 'torch._dynamo' in sys.modules, os.getppid() != KERNEL\nKERNEL = os.getpid()\n"
    "print('FIRST ' + json.dumps(nblaunch.notebook_launcher(found, num_processes=1, cpu=True, start_method='spawn', "
    "display='none')))",
]


def run_kernel(tmp_path) -> list:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return notebook.cells


def tagged(cell, tag: str):
    return json.loads(re.search(rf"^{tag} (.*)$", everything_shown(cell), re.M).group(1))


@pytest.mark.slow
def test_a_notebook_on_a_gpu_machine_has_its_launch_server_warm_before_its_first_launch(tmp_path, monkeypatch):
    for name, value in stand_in_library(tmp_path, "libnvidia-ml.so.1", FAKE_NVML).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FAKE_NVML_GPUS", "1")
    cells = run_kernel(tmp_path)
    assert any("nblaunch.server.base_process" in command for command in tagged(cells[0], "BEFORE"))
    assert {"torch", "nblaunch"} <= set(tagged(cells[1], "LOADED"))
    assert tagged(cells[2], "FIRST") == [[True, True]]  # from a generation that had torch._dynamo loaded


def test_nothing_starts_early_without_a_gpu(tmp_path):
    cells = run_kernel(tmp_path)
    assert not any("nblaunch.server" in command for command in tagged(cells[0], "BEFORE"))
