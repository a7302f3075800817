"""Issue 53: warm ranks on the GPU after a device-side assert, in a real kernel, as a user types
the cells: the state is kept through an ordinary error and an interrupt; after the assert the
cell says which rank's GPU no longer works and that the warm ranks were ended; the next cell,
without options, starts fresh ranks saying so once; a cell that restates its options works too;
nothing is left on the GPU when the kernel ends."""

from __future__ import annotations

import re
import subprocess
import time


from gpu_common import GPU_MARKS
from kernel_session import KernelSession

pytestmark = GPU_MARKS

SETUP = ("%%distributed -n 1 --display text\nimport os, torch\nfrom nblaunch import Accelerator\n"
         "acc = Accelerator()\nx = torch.arange(4., device=acc.device)\nsteps = 0\nos.getpid()")


def _pids_on_gpu() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_a_device_side_assert_ends_the_warm_ranks_saying_so_and_the_next_cell_starts_fresh(tmp_path):
    kernel = KernelSession(str(tmp_path))
    try:
        assert kernel.run("%load_ext nblaunch").error is None
        first = kernel.run(SETUP)
        assert first.error is None, first.text
        failed = kernel.run("%%distributed --display text\nprint(undefined_name)")
        assert failed.error is not None and "NameError" in failed.error[1]
        kept = kernel.run("%%distributed --display text\nx.sum().item()")
        assert kept.result == [6.0], kept.text  # an ordinary error keeps the state
        assert_ = kernel.run("%%distributed --display text\n"
                             "emb = torch.nn.Embedding(10, 4).to(acc.device)\nemb(torch.tensor([42], device=acc.device))\n"
                             "torch.cuda.synchronize()")
        assert assert_.error is not None, assert_.text
        assert re.search(r"rank 0's GPU no longer works in its process \(.*\), so the warm ranks were ended",
                         assert_.text), assert_.text
        fresh = kernel.run("%%distributed --display text\nimport os, torch\nos.getpid()")
        assert fresh.error is None, fresh.text
        assert fresh.result != first.result and "starting 1 fresh one:" in fresh.text, fresh.text
        again = kernel.run("%%distributed --display text\ntorch.ones(2, device='cuda').sum().item()")
        assert again.result == [2.0] and "fresh" not in again.text, again.text
        restated = kernel.run(SETUP)
        assert restated.error is None, restated.text
        pids = set(fresh.result) | set(restated.result) | set(first.result)
    finally:
        kernel.close()
    deadline = time.monotonic() + 30
    while _pids_on_gpu() & pids and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _pids_on_gpu() & pids, "a warm rank still holds the GPU after the kernel ended"
