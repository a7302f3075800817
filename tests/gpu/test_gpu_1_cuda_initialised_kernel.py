"""Issue 31, item 1: a real kernel (ipykernel, run by nbclient) that already used CUDA launches.

Fork is unsafe once a process initialised CUDA: nblaunch must spawn by itself and say so in one
line (or refuse before starting, with what to do), and no rank may ever see "CUDA error:
initialization error". The same for ``%%distributed``. Three kernels: one that made a tensor on
the GPU (torch knows CUDA is initialised), one that only asked ``torch.cuda.is_available()``
(the driver is initialised, torch's flag is not: the most common first line of a notebook), and
one that never touched CUDA (fork, and the ranks still use the GPU).
"""

from __future__ import annotations

import re

import nbformat
import pytest
from nbclient import NotebookClient

from gpu_common import DRIVER_PROBE_SOURCE, GPU_MARKS
from nbcells import everything_shown

pytestmark = GPU_MARKS

ON_THE_GPU = DRIVER_PROBE_SOURCE + '''
import os, time
from nblaunch import notebook_launcher

KERNEL_PID = os.getpid()

def on_the_gpu():
    import os, torch
    x = torch.ones(3, device="cuda")
    return os.getpid(), str(x.device), float(x.sum()), torch.cuda.get_device_name(0)

def launch_and_time(**options):
    started = time.perf_counter()
    results = notebook_launcher(on_the_gpu, num_processes=1, display="text", timeout=180, **options)
    print(f"LAUNCH_SECONDS {time.perf_counter() - started:.3f}")
    print("RESULTS", results, "KERNEL_PID", os.getpid())
    return results
'''

CUDA_STATE = ("import torch\nprint('CUDA_STATE', torch.cuda.is_initialized(), cuda_driver_initialised())")

# The line names the cell's line that initialised CUDA (nblaunch was imported before it).
SPAWN_LINE = re.compile(r"^nblaunch: .*started by the launch server \(CUDA was initialised in this process at cell In\[\d+\], "
                        r"line 2: torch\.zeros\(1, device='cuda'\).*$", re.M)


def run_notebook(tmp_path, cells: list[str]) -> list:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb.cells


def launched(cell) -> tuple[float, str, str]:
    """(seconds, device, kernel pid != rank pid) from a cell that ran ``launch_and_time``."""
    shown = everything_shown(cell)
    assert "initialization error" not in shown, shown
    assert "RESULTS" in shown, shown
    seconds = float(re.search(r"LAUNCH_SECONDS ([\d.]+)", shown).group(1))
    rank_pid, device = re.search(r"RESULTS \[\((\d+), '([^']+)'", shown).groups()
    kernel_pid = re.search(r"KERNEL_PID (\d+)", shown).group(1)
    assert rank_pid != kernel_pid, "the function ran in the kernel, not in a rank"
    return seconds, device, shown


# Each kernel state: the cell that sets it up, what that cell shows, and how the launch after it
# starts (None: not asserted, only recorded: a later issue changes it).
KERNELS = {
    "made a CUDA tensor": ("import torch\ntorch.zeros(1, device='cuda')\n" + CUDA_STATE, "CUDA_STATE True True", "spawn"),
    # is_available() ran cuInit (the driver is initialised) while torch's flag stays False: a
    # fork from here gives ranks whose CUDA fails. nblaunch must not fork then.
    "only asked is_available()": ("import torch\nprint('AVAILABLE', torch.cuda.is_available())\n" + CUDA_STATE,
                                  "AVAILABLE True", None),
    "never touched CUDA": ("import torch\n" + CUDA_STATE, "CUDA_STATE False False", "fork"),
}
# What the first kernel runs after its launch.
MORE_CELLS = {"made a CUDA tensor": [
    "launch_and_time(start_method='fork')",
    "%load_ext nblaunch",
    # The last value: backend, device, a process of its own, started by spawn (python -m nblaunch.worker).
    "%%distributed -n 1\nimport os, sys, torch, torch.distributed as dist\n"
    "(dist.get_backend(), str(torch.ones(1, device='cuda').device), os.getpid() != KERNEL_PID, "
    "'nblaunch' in sys.argv[0])",
    "%%distributed\nt = torch.full((2,), 3.0, device='cuda')\ndist.all_reduce(t)\nt.tolist()",
    "%distributed stop",
]}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The cells of a real kernel in ``state``, run once per state and module."""
    done: dict[str, list] = {}

    def run(state: str) -> list:
        if state not in done:
            setup = KERNELS[state][0]
            done[state] = run_notebook(tmp_path_factory.mktemp("kernel"),
                                       [ON_THE_GPU, setup, "results = launch_and_time()", *MORE_CELLS.get(state, [])])
        return done[state]

    return run


@pytest.mark.parametrize("state", list(KERNELS))
def test_a_kernel_launches_onto_the_gpu_whatever_it_did_with_cuda(kernel, state, record_property):
    _, shows, start = KERNELS[state]
    cells = kernel(state)
    assert shows in everything_shown(cells[1]), everything_shown(cells[1])
    seconds, device, shown = launched(cells[2])
    assert device == "cuda:0", shown
    if start == "spawn":  # and says so in one line
        assert len(SPAWN_LINE.findall(shown)) == 1, shown
    elif start == "fork":
        assert "started by fork" in shown, shown
    record_property(f"launch_seconds {state}", seconds)
    record_property(f"start_line {state}", next((line for line in shown.splitlines() if line.startswith("nblaunch: ")), ""))


def test_asking_for_fork_after_cuda_is_refused_before_anything_starts(kernel):
    shown = everything_shown(kernel("made a CUDA tensor")[3])
    assert "LaunchConfigError" in shown and "start_method='fork' would break CUDA" in shown, shown
    # Nothing ran: no line a launch prints (the cell's own source, in the traceback, names RESULTS).
    assert not re.search(r"^RESULTS ", shown, re.M) and "[rank 0]" not in shown, shown


def test_distributed_magic_after_cuda_spawns_one_nccl_rank_on_the_gpu(kernel):
    # The magic shows the widget, whose header carries the reason; nbclient keeps only its static
    # summary, so the start method is read in the rank (a spawned rank runs nblaunch.worker).
    cells = kernel("made a CUDA tensor")
    first = everything_shown(cells[5])
    assert "initialization error" not in first, first
    assert "[('nccl', 'cuda:0', True, True)]" in first, first
    assert "[[3.0, 3.0]]" in everything_shown(cells[6]), everything_shown(cells[6])
