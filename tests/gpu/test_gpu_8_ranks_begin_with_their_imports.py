"""Issues 44 and 60: re-running a GPU cell at the kernel's speed. In a real kernel (nbclient) that
asked ``torch.cuda.is_available()`` first (so every launch's ranks come from the launch server),
the tutorial's loop (BasicNet, Accelerator(mixed_precision=...), AdamW; scikit-learn imported
inside) launched cell after cell: the server is up before the first launch (``import nblaunch``
started it); the first launch's rank already finds scikit-learn and torch._dynamo loaded (the
server imported what the function's code imports before forking it); each launch's GPU memory is
freed and mixed precision changes from one launch to the next; a library that starts CUDA at
import is never imported where ranks are forked from: the server that tried is replaced without
it, and a CUDA-clean kernel imports only torch's and nblaunch's own modules for its ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sysconfig
import uuid

import nbformat
import pytest
from nbclient import NotebookClient

from gpu_common import DRIVER_PROBE_SOURCE, GPU_MARKS
from nbcells import everything_shown

pytestmark = GPU_MARKS

TUTORIAL = '''
import json, os, sys, time
import torch

def train(mixed_precision, hold_gib=0, extra=None):
    """The tutorial's loop, timed by phases inside the rank."""
    began = time.perf_counter()
    found = {"cuda_ready": torch.cuda.is_initialized(), "sklearn": "sklearn" in sys.modules,
             "dynamo": "torch._dynamo" in sys.modules, "pid": os.getpid()}
    if extra:
        __import__(extra)
    from sklearn.datasets import load_digits
    import torch.nn as nn, torch.nn.functional as F
    from nblaunch import Accelerator
    imported = time.perf_counter()

    class BasicNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
            self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
            self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            x = self.fc2(self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))))
            return F.log_softmax(x, dim=1)

    digits = load_digits()
    images = F.interpolate(torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16, size=(28, 28))
    data = torch.utils.data.TensorDataset(images, torch.tensor(digits.target))
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    model = BasicNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    prepared = time.perf_counter()
    first_step = None
    for epoch in range(3):
        for x, y in loader:
            loss = F.nll_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if first_step is None:
                torch.cuda.synchronize()
                first_step = time.perf_counter() - prepared
    held = torch.empty(hold_gib << 30, dtype=torch.uint8, device=accelerator.device) if hold_gib else None
    torch.cuda.synchronize()
    done = time.perf_counter()
    found.update(imports_s=imported - began, prepare_s=prepared - imported, first_step_s=first_step,
                 total_s=done - began, loss=float(loss), precision=accelerator.mixed_precision,
                 device=str(accelerator.device), held=held is not None)
    return found

def launch(mixed_precision, hold_gib=0, extra=None):
    started = time.perf_counter()
    [result] = notebook_launcher(train, args=(mixed_precision, hold_gib, extra), num_processes=1, display="text",
                                 timeout=300)
    result["launch_s"] = time.perf_counter() - started
    print("LAUNCHED " + json.dumps(result), flush=True)
    return result

def gpu_used_mib():
    from nblaunch.machine import nvml
    library, handles = nvml.open_nvml()
    free, used, total = nvml.memory_info(library, handles[0])
    library.nvmlShutdown()
    return used >> 20

def ready():
    report = nblaunch.preloaded()
    print("READY " + json.dumps({"server": list(report.server), "pid": report.server_pid, "refused": report.refused,
                                 "replaced": report.server_replaced}), flush=True)
    return report
'''

SERVER_PATH = [
    "import json, time, torch\nprint('AVAILABLE', torch.cuda.is_available())",  # the driver starts: the server from now on
    "import nblaunch, psutil\nfrom nblaunch import notebook_launcher\n" + DRIVER_PROBE_SOURCE
    + "print('CHILDREN ' + json.dumps([' '.join(p.cmdline()) for p in psutil.Process().children()]))",
    TUTORIAL,
    "first = launch('fp16')\nready()",
    "before = gpu_used_mib()\nsecond = launch('bf16', hold_gib=4)\n"
    "print('MEMORY ' + json.dumps({'before': before, 'after': gpu_used_mib()}))",
    "third = launch('no')",
    # A library that starts CUDA at import, which the ranks imported: the server that imports it
    # for the next launch is unfit, is replaced without it, and says so once.
    "fourth = launch('bf16', extra=STARTS_CUDA)",
    "fifth = launch('bf16')\nready()",
    "sixth = launch('bf16')",
]


def run_notebook(folder, cells: list[str]) -> list:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in cells])
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(folder)}}).execute()
    return nb.cells


def said(cell, tag: str) -> list:
    shown = everything_shown(cell)
    assert "Traceback" not in shown or tag == "", shown[-3000:]
    return [json.loads(m) for m in re.findall(rf"^{tag} (.*)$", shown, re.M)]


@pytest.fixture(scope="module")
def starts_cuda():
    """A library installed for real (site-packages) that starts CUDA when imported."""
    name = f"nbl_warm_cuda_{uuid.uuid4().hex[:8]}"
    folder = os.path.join(sysconfig.get_paths()["purelib"], name)
    os.makedirs(folder)
    with open(os.path.join(folder, "__init__.py"), "w") as f:
        f.write(STARTS_CUDA)
    yield name
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server_path(tmp_path_factory, starts_cuda):
    return run_notebook(tmp_path_factory.mktemp("preload"), [f"STARTS_CUDA = {starts_cuda!r}", *SERVER_PATH])


def test_the_launch_server_is_up_before_the_first_launch_needs_it(server_path, record_property):
    [children] = said(server_path[2], "CHILDREN")
    record_property("kernel's children before any launch", children)
    assert any("nblaunch.launch.starting.server_process" in command for command in children), children


def test_the_first_launchs_rank_finds_what_the_function_imports_loaded_and_later_ones_too(server_path,
                                                                                           record_property):
    [first], [report] = said(server_path[4], "LAUNCHED"), said(server_path[4], "READY")
    [second] = said(server_path[5], "LAUNCHED")
    for name, run in (("first", first), ("second", second)):
        record_property(f"{name} launch", {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()})
    assert first["sklearn"] and first["dynamo"], first  # imported by the server before the fork
    assert {"sklearn"} <= set(report["server"]) and report["pid"], report
    assert second["sklearn"] and second["dynamo"] and second["pid"] != first["pid"], second  # a fresh process
    assert second["device"] == "cuda:0" and second["precision"] == "bf16" and first["precision"] == "fp16"


def test_a_launchs_gpu_memory_is_freed_and_mixed_precision_changes_between_launches(server_path, record_property):
    [memory] = said(server_path[5], "MEMORY")
    [third] = said(server_path[6], "LAUNCHED")
    record_property("GPU MiB used before and after a launch that held 4 GiB", memory)
    assert memory["after"] - memory["before"] < 1024, memory  # the 4 GiB went with the launch
    assert third["precision"] == "no" and third["loss"] > 0


STARTS_CUDA = "import os, torch\ntorch.cuda.init()\nVALUE = 1\n"
FORK_PATH = [
    "import json, os, sys, time\nimport torch, nblaunch\nfrom nblaunch import notebook_launcher\n" + DRIVER_PROBE_SOURCE,
    "def use(package):\n    import torch\n    return __import__(package).VALUE, float(torch.ones(2, device='cuda').sum())\n"
    "print('FIRST ' + json.dumps(notebook_launcher(use, args=(PACKAGE,), num_processes=1, display='text')))\n"
    "print('KERNEL ' + json.dumps({'clean': not cuda_driver_initialised() and not torch.cuda.is_initialized(), "
    "'loaded': PACKAGE in sys.modules}))\n"
    "print('SECOND ' + json.dumps(notebook_launcher(use, args=(PACKAGE,), num_processes=1, display='text')))",
]


def test_a_library_that_starts_cuda_at_import_is_never_imported_by_the_server_for_its_ranks(server_path, starts_cuda,
                                                                                              record_property):
    [fourth] = said(server_path[7], "LAUNCHED")
    [fifth], [report] = said(server_path[8], "LAUNCHED"), said(server_path[8], "READY")
    record_property("refused", report["refused"])
    assert fourth["loss"] > 0 and fifth["loss"] > 0
    assert report["refused"].get(starts_cuda) == "initialises CUDA", report
    shown = everything_shown(server_path[8]) + everything_shown(server_path[9])
    assert shown.count(f"could not import {starts_cuda} in the launch server for the ranks: initialises CUDA") == 1, \
        shown[-3000:]
    [sixth] = said(server_path[9], "LAUNCHED")
    assert sixth["sklearn"] and sixth["dynamo"], sixth  # from the server that replaced it


def test_a_cuda_clean_kernel_imports_no_library_for_its_ranks_but_torchs_and_nblaunchs(starts_cuda, tmp_path,
                                                                                      record_property):
    cells = run_notebook(tmp_path, [f"PACKAGE = {starts_cuda!r}", *FORK_PATH])
    [first], [kernel], [second] = said(cells[2], "FIRST"), said(cells[2], "KERNEL"), said(cells[2], "SECOND")
    record_property("fork path", kernel)
    assert first == second == [[1, 2.0]]
    assert kernel["clean"] and not kernel["loaded"], kernel
