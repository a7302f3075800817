"""%debug on a failed rank, in a real kernel, answered as a person types: after a launch (the
rank's frames kept and rebuilt here) and after a %%distributed cell (the rank's frames live:
pdb's questions are answered by the rank itself, and the pool goes on after q)."""

from __future__ import annotations

import re

import pytest

from kernel_session import KernelSession

LAUNCH = """
import os, torch
from nblaunch import notebook_launcher

def step(x, scale):
    y = x * scale
    if os.environ["RANK"] == "1":
        raise ValueError("bad shape")
    return 1

def train():
    x = torch.zeros(3, 5)
    return step(x, 2.0)

notebook_launcher(train, num_processes=2, display="text")
"""


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # ipdb colours its listing


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    session = KernelSession(str(tmp_path_factory.mktemp("debugging")))
    yield session
    session.close()


def test_debug_after_a_launch_opens_the_failing_rank_with_its_locals_and_q_returns(kernel):
    failed = kernel.run(LAUNCH)
    assert failed.error is not None and failed.error[0] == "RankFailedError", failed.text
    # The failure's locals block: the failing line's names with their shapes.
    shown = plain(failed.traceback)
    under = shown[shown.index('raise ValueError("bad shape")'):]
    assert under.splitlines()[1:4] == ["    locals:", "      x      Tensor[3, 5] float32 cpu", "      scale  float 2.0"], shown
    pdb = kernel.run("%debug", answers=["p x.shape", "p scale", "where", "up", "p x.sum().item()", "ll", "q"])
    assert pdb.error is None, pdb.text
    pdb.text = plain(pdb.text)
    assert "torch.Size([3, 5])" in pdb.text and "2.0" in pdb.text, pdb.text
    assert 'raise ValueError("bad shape")' in pdb.text, pdb.text  # at the rank's line, in the cell's source
    assert "in train" in pdb.text or "train()" in pdb.text, pdb.text  # `where` and `up` reach the outer frame
    assert "x = torch.zeros(3, 5)" in pdb.text, pdb.text  # `ll` of train, from the cell
    after = kernel.run("1 + 1")
    assert after.result == 2  # back in the kernel


def test_debug_chooses_another_rank_or_says_in_a_line_why_not(kernel):
    kernel.run(LAUNCH)
    assert kernel.run("import nblaunch; nblaunch.debug(rank=0)").text.strip() == (
        "nblaunch.debug: rank 0 did not fail in this launch (these did: 1)")
    opened = kernel.run("nblaunch.debug(rank=1)", answers=["p y.shape", "q"])
    assert "torch.Size([3, 5])" in opened.text, opened.text
    kernel.run("1 / 0")
    assert kernel.run("nblaunch.debug()").text.startswith("nblaunch.debug: the last error was not a failed launch's")


def test_debug_after_a_distributed_cell_reads_the_ranks_values_and_the_pool_goes_on(kernel):
    assert kernel.run("%load_ext nblaunch").error is None
    started = kernel.run("%%distributed -n 2 --cpu --display text\nimport os, torch, torch.distributed as dist\n"
                         "w = torch.ones(4, 2) * (dist.get_rank() + 1)\nos.getpid()")
    assert started.error is None, started.text
    failed = kernel.run("%%distributed --display text\nh = w @ torch.ones(3)")
    assert failed.error is not None and failed.error[0] == "RankFailedError", failed.text
    assert "Tensor[4, 2] float32 cpu" in failed.traceback, failed.traceback
    first = int(re.match(r"rank (\d) failed", failed.error[1])[1])  # both raise: the first to
    pdb = kernel.run("%debug", answers=["p w.shape", "p w[0, 0].item()", "ll", "p os.getpid()", "!w.mul_(10)",
                                        "marker = 7", "q"])
    pdb.text = plain(pdb.text)
    assert "torch.Size([4, 2])" in pdb.text and f"{first + 1.0}" in pdb.text, pdb.text  # that rank's value
    assert "h = w @ torch.ones(3)" in pdb.text, pdb.text
    assert str(started.result[first]) in pdb.text, pdb.text  # evaluated in the rank itself, live
    kept = kernel.run("%%distributed --display text\n(w.sum().item(), 'marker' in dir())")
    expected = [(8.0, False), (16.0, False)]
    expected[first] = (80.0 * (first + 1), True)  # what pdb did there stays in that rank
    assert kept.error is None and kept.result == expected, kept.text
    assert kernel.run("%distributed stop").error is None
