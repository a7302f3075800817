"""A function and its closure defined in a notebook cell, launched by fork and by spawn, in a
real Jupyter kernel (nbclient)."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

CELLS = [
    "from nblaunch import notebook_launcher\n"
    "offset = 100\n"
    "def make(scale):\n"
    "    def train(x):\n"
    "        import os\n"
    "        return offset + scale * x + int(os.environ['RANK'])\n"
    "    return train",
    "fork = notebook_launcher(make(10), args=(1,), num_processes=2, start_method='fork', display='text')\n"
    "spawn = notebook_launcher(make(10), args=(2,), num_processes=2, start_method='spawn', display='text')\n"
    "print('results', fork, spawn)",
]


def test_a_notebook_cell_closure_runs_under_fork_and_spawn(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    NotebookClient(notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(out.get("text", "") for out in notebook.cells[1].outputs)
    assert "results [110, 111] [120, 121]" in text
    assert "started by the launch server (asked for with start_method='spawn'" in text
    assert not [out for out in notebook.cells[1].outputs if out.output_type == "error"]
