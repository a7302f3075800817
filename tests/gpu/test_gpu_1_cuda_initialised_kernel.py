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

SPAWN_LINE = re.compile(r"^nblaunch: .*started by spawn \(CUDA is already initialised in this process.*$", re.M)


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


@pytest.fixture(scope="module")
def touched(tmp_path_factory):
    return run_notebook(tmp_path_factory.mktemp("touched"), [
        ON_THE_GPU,
        "import torch\ntorch.zeros(1, device='cuda')\n" + CUDA_STATE,
        "results = launch_and_time()",
        "launch_and_time(start_method='fork')",
        "%load_ext nblaunch",
        # The last value: backend, device, a process of its own, started by spawn (python -m nblaunch.worker).
        "%%distributed -n 1\nimport os, sys, torch, torch.distributed as dist\n"
        "(dist.get_backend(), str(torch.ones(1, device='cuda').device), os.getpid() != KERNEL_PID, "
        "'nblaunch' in sys.argv[0])",
        "%%distributed\nt = torch.full((2,), 3.0, device='cuda')\ndist.all_reduce(t)\nt.tolist()",
        "%distributed stop",
    ])


def test_a_kernel_that_made_a_cuda_tensor_spawns_and_says_so_in_one_line(touched, record_property):
    assert "CUDA_STATE True True" in everything_shown(touched[1])
    seconds, device, shown = launched(touched[2])
    assert device == "cuda:0"
    assert len(SPAWN_LINE.findall(shown)) == 1, shown
    record_property("launch_seconds_spawn_cuda_initialised", seconds)


def test_asking_for_fork_after_cuda_is_refused_before_anything_starts(touched):
    shown = everything_shown(touched[3])
    assert "LaunchConfigError" in shown and "start_method='fork' would break CUDA" in shown, shown
    assert "RESULTS" not in shown and "[rank 0]" not in shown


def test_distributed_magic_after_cuda_spawns_one_nccl_rank_on_the_gpu(touched):
    # The magic shows the widget, whose header carries the reason; nbclient keeps only its static
    # summary, so the start method is read in the rank (a spawned rank runs nblaunch.worker).
    first = everything_shown(touched[5])
    assert "initialization error" not in first, first
    assert "[('nccl', 'cuda:0', True, True)]" in first, first
    assert "[[3.0, 3.0]]" in everything_shown(touched[6]), everything_shown(touched[6])


@pytest.fixture(scope="module")
def only_asked(tmp_path_factory):
    return run_notebook(tmp_path_factory.mktemp("asked"), [
        ON_THE_GPU,
        "import torch\nprint('AVAILABLE', torch.cuda.is_available())\n" + CUDA_STATE,
        "results = launch_and_time()",
    ])


def test_a_kernel_that_only_asked_is_available_still_launches_onto_the_gpu(only_asked, record_property):
    # is_available() ran cuInit (the driver is initialised) while torch's flag stays False: a
    # fork from here gives ranks whose CUDA fails. nblaunch must not fork then.
    state = everything_shown(only_asked[1])
    assert "AVAILABLE True" in state, state
    record_property("cuda_state_after_is_available", state.strip().splitlines()[-1])
    seconds, device, shown = launched(only_asked[2])
    assert device == "cuda:0", shown
    record_property("launch_seconds_after_is_available", seconds)
    record_property("start_line", next((l for l in shown.splitlines() if l.startswith("nblaunch: ")), ""))


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    return run_notebook(tmp_path_factory.mktemp("untouched"), [
        ON_THE_GPU,
        "import torch\n" + CUDA_STATE,
        "results = launch_and_time()",
    ])


def test_a_kernel_that_never_touched_cuda_forks_and_the_rank_uses_the_gpu(untouched, record_property):
    assert "CUDA_STATE False False" in everything_shown(untouched[1])
    seconds, device, shown = launched(untouched[2])
    assert device == "cuda:0" and "started by fork" in shown, shown
    record_property("launch_seconds_fork", seconds)
