"""``%%distributed`` in a real kernel (nbclient): state kept per rank, values per rank, failures,
and a kernel restart that takes the warm ranks with it."""

from __future__ import annotations

import re

import nbformat
import psutil
import pytest
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

from nbcells import everything_shown
from nblaunch.warm.magic import assigned_names, used_names

CELLS = [
    "%load_ext nblaunch",
    # 1: starts the pool; the last expression comes back per rank
    "%%distributed -n 2\n"
    "import os, torch, torch.distributed as dist\n"
    "from nblaunch import Accelerator\n"
    "accelerator = Accelerator()\n"
    "weights = torch.full((2,), float(accelerator.process_index + 1))\n"
    "accelerator.process_index",
    # 2: the notebook's own names are sent along
    "scale = 10\ndef double(x):\n    return 2 * x",
    # 3: the ranks' names from cell 1, the group from cell 1, the notebook's scale and double
    "%%distributed\nt = weights * scale\ndist.all_reduce(t)\ndouble(t).tolist()",
    "%distributed status",
    "%%distributed\nprint(f'rank {accelerator.process_index} pid {os.getpid()}')",
    # 6: a typo is refused in the kernel: the ranks keep their state (7)
    "%%distributed\nweights = (",
    "%%distributed\nweights.tolist()",
    # 8: a failure is the cell's...
    "%%distributed\nif accelerator.process_index == 1:\n    raise ValueError('bad shape in a cell')\nimport time\ntime.sleep(3)",
    # 9: ...and the next cell runs on the same ranks, which keep their names
    "%%distributed\n'weights' in globals()",
    "%%distributed\nimport os\nos.getpid()",
]


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in CELLS])
    client = NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path_factory.mktemp("magic"))}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        value = next(o.data["text/plain"] for o in nb.cells[10].outputs if o.output_type == "execute_result")
        pids = [int(p) for p in re.fullmatch(r"\[(\d+), (\d+)\]", value).groups()]
        alive_before = [p for p in pids if psutil.pid_exists(p)]
        run_sync(client.km.restart_kernel)(now=True)
        gone = psutil.wait_procs([psutil.Process(p) for p in alive_before if psutil.pid_exists(p)], timeout=30)[1]
    return nb.cells, pids, alive_before, gone


GROUP_CELLS = [
    "%load_ext nblaunch",
    "%%distributed -n 2\nimport torch, torch.distributed as dist\nt = torch.ones(1) * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n(dist.get_rank(), t.item())",
    "%%distributed\nfrom nblaunch import Accelerator\naccelerator = Accelerator()\n"
    "(accelerator.num_processes, accelerator.state.adopted_process_group)",
    "%distributed stop",
]


def test_the_first_cell_has_a_process_group_and_an_accelerator_adopts_it(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in GROUP_CELLS])
    NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert "[(0, 3.0), (1, 3.0)]" in everything_shown(nb.cells[1]), everything_shown(nb.cells[1])
    assert "[(2, True), (2, True)]" in everything_shown(nb.cells[2]), everything_shown(nb.cells[2])


def test_the_last_expression_comes_back_per_rank(notebook):
    cells, *_ = notebook
    assert "[0, 1]" in everything_shown(cells[1])


def test_names_live_on_in_the_ranks_and_notebook_names_are_sent(notebook):
    cells, *_ = notebook
    assert "[[60.0, 60.0], [60.0, 60.0]]" in everything_shown(cells[3])  # (1 + 2) * 10, doubled
    assert "<WarmRanks: 2 processes, up>" in everything_shown(cells[4])
    shown = everything_shown(cells[5])
    assert "rank 0 pid" in shown and "rank 1 pid" in shown


def test_a_failure_names_the_rank_and_the_cell_line_and_the_ranks_keep_their_state(notebook):
    cells, *_ = notebook
    failed = everything_shown(cells[8])
    assert "RankFailedError" in failed and "rank 1 failed: ValueError: bad shape in a cell" in failed
    assert "distributed cell" in failed and "raise ValueError('bad shape in a cell')" in failed
    kept = everything_shown(cells[9])
    assert "[True, True]" in kept and "warm ranks had ended" not in kept


def test_a_typo_is_refused_in_the_kernel_and_the_ranks_keep_their_state(notebook):
    cells, *_ = notebook
    assert "SyntaxError" in everything_shown(cells[6]) and "distributed cell" in everything_shown(cells[6])
    assert "[[1.0, 1.0], [2.0, 2.0]]" in everything_shown(cells[7])


def test_a_kernel_restart_takes_the_warm_ranks_with_it(notebook):
    _, pids, alive_before, gone = notebook
    assert len(pids) == 2 and alive_before == pids
    assert gone == [], f"warm ranks outlived the kernel: {gone}"


def test_which_names_a_cell_reads_and_binds():
    assert used_names("model(x) + f(y)") == {"model", "x", "f", "y"}
    assert assigned_names("import torch.nn as nn\nx = 1\ndef f():\n    y = 2\nfor i in range(3): pass") == {"nn", "x", "f", "i"}
