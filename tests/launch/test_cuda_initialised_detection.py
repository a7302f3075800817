"""The CPU side of issue 31's GPU lane: what can be checked without a GPU, with real parts.

- Whether CUDA was initialised in the launching process decides fork or spawn. nblaunch asks
  ``torch.cuda.is_initialized()``; a CPU build of torch can never reach that state (its lazy init
  refuses: "Torch not compiled with CUDA enabled"), which the first test shows. So the spawn branch
  is driven here by the one flag torch's lazy init sets, set by hand in a child interpreter (the one
  stand-in of this file, for torch's state, not nblaunch's); everything after it is real: the plan,
  the line the display prints, spawned ranks, the refusal of ``start_method="fork"``.
  tests/gpu/test_gpu_1_cuda_initialised_kernel.py checks the real thing in a real kernel on a GPU.
- The refusals of a one-GPU machine, through nblaunch's real NVML probe: a child interpreter loads
  a stand-in NVIDIA driver library (``libnvidia-ml.so.1``, built here with the C compiler, reporting
  one GPU), so the probe, ``CUDA_VISIBLE_DEVICES`` and the plan all run as on Colab's T4.
- tools/gpu_lane.sh runs end to end in a copy of the repository and reports "no CUDA device".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from nblaunch.launch.planning import devices
from nblaunch.launch.planning.plan import start_method_for
from stand_ins import FAKE_NVML, run_child, stand_in_library

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU build of torch; tests/gpu checks CUDA builds")
def test_a_cpu_build_of_torch_never_initialises_cuda_so_the_launcher_forks():
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        torch.cuda.init()
    assert not torch.cuda.is_initialized() and not devices.cuda_initialized()
    assert start_method_for(None, False) == ("fork", "the quickest start: each process begins as a copy of this one")


def test_without_torch_imported_cuda_counts_as_untouched(tmp_path):
    found, _ = run_child("import json, sys\nfrom nblaunch.launch.planning import devices\n"
                         "print('RESULT ' + json.dumps([devices.cuda_initialized(), 'torch' in sys.modules]))", tmp_path)
    assert found == [False, False]


CUDA_INITIALISED = '''
import json, os
import torch

torch.cuda._initialized = True  # the flag torch's lazy init sets (a CPU build cannot set it itself)
from nblaunch import LaunchConfigError, notebook_launcher
from nblaunch.launch.planning import devices

def where():
    import os
    return os.getpid()

out = {"detected": devices.cuda_initialized(), "parent": os.getpid()}
out["spawned"] = notebook_launcher(where, num_processes=2, display="text")
try:
    notebook_launcher(where, num_processes=1, start_method="fork", display="none")
except LaunchConfigError as error:
    out["fork"] = str(error)
out["cpu"] = notebook_launcher(where, num_processes=1, cpu=True, display="text")
print("RESULT " + json.dumps(out), flush=True)
'''


def test_cuda_initialised_in_the_launcher_spawns_says_so_in_one_line_and_refuses_fork(tmp_path):
    found, printed = run_child(CUDA_INITIALISED, tmp_path)
    assert found["detected"] is True
    assert len(found["spawned"]) == 2 and found["parent"] not in found["spawned"]
    spawn_lines = [l for l in printed.splitlines() if "started by the launch server" in l]
    assert len(spawn_lines) == 1, printed
    # torch said CUDA was initialised before nblaunch was imported: the line could not be seen.
    assert re.search(r"started by the launch server \(CUDA was initialised in this process before nblaunch was imported "
                     r"\(import nblaunch first to have the line named\), and forked workers could not use it\)",
                     spawn_lines[0])
    assert found["fork"] == (
        "start_method='fork' would break CUDA in the workers: CUDA was already initialised in this process, before "
        "nblaunch was imported (import nblaunch first to have the line named). Use start_method=None (nblaunch then "
        "starts the ranks from its launch server), or move the CUDA code into the function.")
    # cpu=True hides the GPUs from the ranks: nothing there uses CUDA, so the quick fork is safe.
    assert len(found["cpu"]) == 1 and "started by fork (the quickest start" in printed


NAMED_LINE = '''
import json
import nblaunch          # first: it watches for torch.cuda to load
import torch
from nblaunch.launch.planning import cuda_culprit, plan

def set_up_the_gpu():
    # What torch's lazy CUDA initialisation does first, on the stack of whatever asked for CUDA
    # (a CPU build stops before it): run the calls queued with torch.cuda._lazy_call.
    for queued, _ in torch.cuda._queued_calls: queued()

set_up_the_gpu()
torch.cuda._initialized = True
print("RESULT " + json.dumps([cuda_culprit.where_cuda_started(), plan.start_method_for(None, False)]))
'''


def test_the_line_that_initialised_cuda_is_named(tmp_path):
    (line, (method, reason)), _ = run_child(NAMED_LINE, tmp_path)
    assert line == "child.py, line 10: for queued, _ in torch.cuda._queued_calls: queued()"
    assert method == "server"
    assert reason == f"CUDA was initialised in this process at {line}, and forked workers could not use it"


DRIVER_ONLY = '''
import json
import nblaunch, torch
from nblaunch.launch.planning import devices, plan
devices.cuda_initialized = lambda: True   # the driver's own state, which a CPU machine cannot reach
print("RESULT " + json.dumps(plan.start_method_for(None, False)))
'''


def test_cuda_started_by_the_driver_alone_is_said_with_what_does_that(tmp_path):
    (method, reason), _ = run_child(DRIVER_ONLY, tmp_path)
    assert method == "server" and "torch.cuda.is_available()" in reason and "PYTORCH_NVML_BASED_CUDA_CHECK=1" in reason


ONE_GPU_MACHINE = '''
import json, os
from nblaunch import LaunchConfigError, WarmRanks, notebook_launcher
from nblaunch.launch.planning import devices
from nblaunch.launch.planning.plan import plan_here
from nblaunch.launch.planning.request import LaunchRequest

def where():
    import os, torch
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()

default = plan_here(LaunchRequest(where))
out = {"count": devices.cuda_device_count(), "default": [default.num_processes, default.device_kind, default.devices],
       "capability": devices.cuda_capability(), "auto": plan_here(LaunchRequest(where, mixed_precision="auto")).precision}
for name, call in (("launch", lambda: notebook_launcher(where, num_processes=2, display="none")),
                   ("warm", lambda: WarmRanks(num_processes=2, display="none"))):
    try:
        call()
        out[name] = None
    except LaunchConfigError as error:
        out[name] = str(error)
out["cpu"] = notebook_launcher(where, num_processes=2, cpu=True, display="none")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
hidden = plan_here(LaunchRequest(where))
out["hidden"] = [devices.cuda_device_count(), hidden.num_processes, hidden.device_kind]
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.fixture
def one_gpu_driver(tmp_path):
    """The environment of a child interpreter that finds a driver reporting one NVIDIA GPU."""
    return {**stand_in_library(tmp_path, "libnvidia-ml.so.1", FAKE_NVML), "FAKE_NVML_GPUS": "1", "FAKE_NVML_CC": "7.5"}


def test_a_one_gpu_machine_refuses_two_gpu_ranks_and_runs_cpu_ranks(tmp_path, one_gpu_driver):
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        pytest.skip("CUDA_VISIBLE_DEVICES is set here; the one-GPU machine has it unset")
    found, _ = run_child(ONE_GPU_MACHINE, tmp_path, one_gpu_driver)
    assert found["count"] == 1
    assert found["default"] == [1, "cuda", "1 CUDA GPU"]  # one rank per GPU when num_processes is left out
    # A T4 (compute capability 7.5), asked through NVML: "auto" is its fast fp16, not emulated bf16.
    assert found["capability"] == [7, 5] and found["auto"] == "fp16"
    refusal = ("num_processes=2, but 1 GPU is visible and a GPU rank needs a GPU of its own: pass num_processes=1 "
               "(or leave it out), or cpu=True to run 2 ranks on the CPU (to try or debug distributed code).")
    assert found["launch"] == refusal and found["warm"] == refusal
    assert found["cpu"] == [["", False], ["", False]]  # the GPU hidden in every rank
    assert found["hidden"] == [0, 2, "cpu"]  # CUDA_VISIBLE_DEVICES="" in the notebook: a CPU machine


@pytest.mark.slow
def test_the_gpu_lane_runs_here_end_to_end_and_reports_no_cuda_device(tmp_path):
    if torch.version.cuda is not None and devices.cuda_device_count():
        pytest.skip("a CUDA device is here: run tools/gpu_lane.sh itself")
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("nblaunch", "benchmarks", "tools"):
        shutil.copytree(os.path.join(ROOT, name), copy / name, ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "tests", "gpu"), copy / "tests" / "gpu", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE", "tests/conftest.py", "tests/lanes.py", "tests/nbcells.py",
                 "tests/kernel_session.py"):
        shutil.copy(os.path.join(ROOT, name), copy / name)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_LANE_PYTHON": sys.executable, "GPU_LANE_VENV": str(tmp_path / "venv"),
           "GPU_LANE_BUDGET_S": "300"}
    proc = subprocess.run(["bash", "tools/gpu_lane.sh"], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["benchmark.json", "benchmark.md", "junit.xml", "lane.log", "report.md",
                                       "status.json", "versions.json"]
    report = (out / "report.md").read_text()
    assert "**no CUDA device**" in report
    for item in range(1, 8):
        assert re.search(rf"^## {item}\. .*: skipped$", report, re.M), report
    assert "0 passed, 0 failed, 0 errors" in report
    assert "nothing measured: no CUDA device" in (out / "benchmark.md").read_text()
    assert not (tmp_path / "venv").exists()  # the lane removes its venv


FAKE_DRIVER = r'''
/* The CUDA driver's answers, per process as the real one's: cuDeviceGetCount says 3 (not
   initialised) until this process has run cuInit. Loading the library initialises nothing: a CUDA
   build of torch loads it at import, and a fresh interpreter (the launch server) starts clean. */
static int initialised;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return 0; }
int cuDeviceGetCount(int *count) {
    if (!initialised) return 3;
    *count = 1;
    return 0;
}
'''

DRIVER_PROBE = '''
import ctypes, json, os, sys
from nblaunch.launch.planning import devices
before = devices.cuda_initialized()          # the driver is not loaded in this process
driver = ctypes.CDLL("libcuda.so.1")         # what torch.cuda.is_available() does first,
if os.environ["PROBE_RUNS_CUINIT"] == "1":   # then cuInit
    driver.cuInit(0)
print("RESULT " + json.dumps({"not_loaded": before, "loaded": devices.cuda_initialized(),
                  "torch_flag": sys.modules["torch"].cuda.is_initialized() if "torch" in sys.modules else None}))
'''


@pytest.mark.parametrize("initialised", [True, False])
def test_a_driver_initialised_without_torch_knowing_is_detected(tmp_path, initialised):
    """torch.cuda.is_available() runs cuInit without setting torch's own flag: a fork then breaks
    CUDA in the ranks. The launcher asks the driver itself (a stand-in here, built with cc)."""
    env = {**stand_in_library(tmp_path, "libcuda.so.1", FAKE_DRIVER),
           "PROBE_RUNS_CUINIT": "1" if initialised else "0"}
    found, _ = run_child(DRIVER_PROBE, tmp_path, env)
    assert found == {"not_loaded": False, "loaded": initialised, "torch_flag": None}
