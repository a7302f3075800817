"""What a user reads in a cell whose launch failed, in a saved notebook run by a real kernel
(nbclient): the rank's traceback once, a headline naming the rank, the exception and the cell
line, and nothing of nblaunch's own code."""

from __future__ import annotations

import os
import re

import nbformat
import pytest
from nbclient import NotebookClient
from nbcells import everything_shown

import nblaunch

PACKAGE = os.path.dirname(os.path.realpath(nblaunch.__file__))

DEFINE = '''\
import time
import torch.distributed as dist
from nblaunch import notebook_launcher

def check(x):
    if x == 3:
        raise ValueError(f"bad value {x}")

def train():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        check(3)
    dist.barrier()
'''


def run_cells(tmp_path, *sources: str) -> list:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return nb.cells


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    return run_cells(tmp_path_factory.mktemp("failed"), DEFINE, "notebook_launcher(train, num_processes=2)")[1]


@pytest.fixture(scope="module")
def failed_later(tmp_path_factory):
    cells = run_cells(tmp_path_factory.mktemp("failed_later"), DEFINE,
                      "launch = notebook_launcher(train, num_processes=2, block=False)",
                      "launch.result()")
    return cells[2]


@pytest.mark.parametrize("which", ["failed", pytest.param("failed_later", marks=pytest.mark.notebooks)])
def test_the_users_traceback_appears_once_and_no_nblaunch_code(request, which):
    shown = everything_shown(request.getfixturevalue(which))
    # The user's frames, once each: the raise in check, the call in train.
    assert shown.count('raise ValueError(f"bad value {x}")') == 1, shown
    assert shown.count("check(3)") == 1, shown
    assert PACKAGE + os.sep not in shown, shown  # no file of nblaunch's own package
    assert "bootstrap.py" not in shown and "supervisor.py" not in shown and "handle.py" not in shown


def test_the_headline_names_the_rank_the_exception_and_the_cell_line(failed):
    (error,) = [o for o in failed.outputs if o.output_type == "error"]
    assert error.ename == "RankFailedError"
    assert error.evalue.splitlines()[0] == "rank 1 failed: ValueError: bad value 3 (Cell In[1], line 7, in check)"


@pytest.mark.parametrize("which", ["failed", pytest.param("failed_later", marks=pytest.mark.notebooks)])
def test_one_chain_the_ranks_frames_then_the_headline(request, which):
    (error,) = [o for o in request.getfixturevalue(which).outputs if o.output_type == "error"]
    shown = "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", part) for part in error.traceback)
    # Two hops: the rank's traceback (its frames, then its exception's line), then the headline.
    # No hop in between with a header and no frame (the rank's exception, rebuilt here).
    hops = shown.split("The above exception was the direct cause of the following exception:")
    assert len(hops) == 2, shown
    assert "raise ValueError" in hops[0] and hops[0].rstrip().endswith("ValueError: bad value 3"), shown
    assert hops[1].lstrip().startswith("RankFailedError"), shown


WAIT_IN_COLLECTIVES = '''\
import torch
import torch.distributed as dist
from nblaunch import notebook_launcher

def wait_in_collectives():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    else:
        dist.barrier()
'''


@pytest.mark.notebooks
@pytest.mark.parametrize("display", ["text", "widget"])
def test_a_timeout_while_ranks_wait_in_collectives_shows_every_ranks_stack(tmp_path, display):
    cells = run_cells(tmp_path, WAIT_IN_COLLECTIVES,
                      f"notebook_launcher(wait_in_collectives, num_processes=2, timeout=3, display={display!r})")
    shown = everything_shown(cells[1])
    assert "LaunchTimeoutError" in shown, shown
    if display == "text":  # one line per rank: where it was (the whole stack is in its log)
        assert "[rank 0] stopped at Cell In[1], line 8, in wait_in_collectives: dist.recv(" in shown, shown
        assert "[rank 1] stopped at Cell In[1], line 10, in wait_in_collectives: dist.barrier()" in shown, shown
    else:  # the summary the saved notebook keeps: each rank's stack, folded, the place in the label
        assert "rank 0: where it was stopped · Cell In[1], line 8, in wait_in_collectives" in shown, shown
        assert "rank 1: where it was stopped · Cell In[1], line 10, in wait_in_collectives" in shown, shown
