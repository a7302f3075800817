"""The tutorial's loop re-run cell after cell on one GPU (issue 44), in a real Jupyter kernel.

As a Colab user does it: the kernel's first cell asks ``torch.cuda.is_available()``; a cell
imports the launcher and defines the tutorial's ``BasicNet`` and its loop (``Accelerator(
mixed_precision="fp16")``, AdamW, 3 epochs; scikit-learn's digits scaled to 28x28 stand in for
MNIST, scikit-learn imported inside the function); then the launch cell is run again and again,
3 s apart. nblaunch: ``notebook_launcher(train, num_processes=1)`` (its ranks come from the
launch server: CUDA was started in the kernel); Accelerate: its ``notebook_launcher``, which with
one GPU runs the function in the kernel itself; raw torch: ``torch.multiprocessing`` with
``start_method="spawn"`` (the function in a file beside the notebook: spawn cannot run one
defined in a cell), ``torch.autocast`` and a ``GradScaler``. Each implementation gets a kernel of
its own; each launch is timed in its cell.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

GAP_S = 3.0
LAUNCHES = {"nblaunch": 4, "accelerate": 4, "raw": 2}  # raw's are all alike: a fresh interpreter each

MODEL = '''
import json, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F

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

def digits_loader():
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = F.interpolate(torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16, size=(28, 28))
    data = torch.utils.data.TensorDataset(images, torch.tensor(digits.target))
    return torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
'''

WITH_ACCELERATOR = MODEL + '''
def train():
    began = time.perf_counter()
    loader = digits_loader()
    accelerator = Accelerator(mixed_precision="fp16")
    model = BasicNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    prepared = time.perf_counter()
    for epoch in range(3):
        for x, y in loader:
            loss = F.nll_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    torch.cuda.synchronize()
    return {"prepare_s": prepared - began, "loop_s": time.perf_counter() - prepared, "loss": float(loss)}
'''

RAW = MODEL + '''
def main(rank):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    loader = digits_loader()
    model = BasicNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(3):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.nll_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    torch.cuda.synchronize()
'''

FIRST_CELL = "import time, json, torch\nprint('AVAILABLE', torch.cuda.is_available())"
SETUP = {
    "nblaunch": "from nblaunch import notebook_launcher, Accelerator\n" + WITH_ACCELERATOR,
    "accelerate": "from accelerate import notebook_launcher, Accelerator\n" + WITH_ACCELERATOR,
    "raw": "import torch.multiprocessing as mp\nimport tutorial_raw",
}
LAUNCH = {
    "nblaunch": "t = time.perf_counter()\nr = notebook_launcher(train, num_processes=1)\n"
                "print('TIMED ' + json.dumps({'s': time.perf_counter() - t, 'rank': r[0]}))",
    "accelerate": "t = time.perf_counter()\nr = notebook_launcher(train, num_processes=1)\n"
                  "print('TIMED ' + json.dumps({'s': time.perf_counter() - t, 'rank': r}))",
    "raw": "t = time.perf_counter()\nmp.start_processes(tutorial_raw.main, nprocs=1, start_method='spawn')\n"
           "print('TIMED ' + json.dumps({'s': time.perf_counter() - t}))",
}


def cells(impl: str) -> list[str]:
    pause = f"time.sleep({GAP_S})"
    found = [FIRST_CELL, pause, SETUP[impl], pause]
    for index in range(LAUNCHES[impl]):
        found += ([pause] if index else []) + [LAUNCH[impl]]
    return found


def run_kernel(impl: str, timeout: float = 300) -> dict:
    """One kernel's cells; the time of each launch cell and what the rank said, in order."""
    import nbformat
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "tutorial_raw.py"), "w") as f:
            f.write(RAW)
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells(impl)])
        NotebookClient(notebook, timeout=timeout, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": folder}}).execute()
    launches, errors = [], []
    for cell in notebook.cells:
        for output in cell.outputs:
            text = output.get("text", "") if output.output_type == "stream" else ""
            launches += [json.loads(m) for m in re.findall(r"^TIMED (.*)$", text, re.M)]
            if output.output_type == "error":
                errors.append(f"{output.ename}: {output.evalue}")
    if errors or len(launches) != LAUNCHES[impl]:
        raise RuntimeError(f"{impl}: {len(launches)} of {LAUNCHES[impl]} launches timed; {errors[:2]}")
    return {"launches": launches}


def rows(deadline: float, notes: list[str]) -> list[dict]:
    """The benchmark's rows: each implementation's first, second and later launches."""
    import time

    from benchmarks.common import row

    found: dict[str, list[float]] = {}
    ranks: list[dict] = []
    for impl in os.environ.get("NBLAUNCH_TUTORIAL_IMPLS", ",".join(LAUNCHES)).split(","):
        if impl == "accelerate" and not _have("accelerate"):
            continue
        if time.time() + 90 > deadline:
            notes.append(f"tutorial, {impl}: not taken: the lane's time ran out")
            continue
        try:
            done = run_kernel(impl)
        except Exception as error:  # noqa: BLE001  one implementation failing must not lose the others
            notes.append(f"tutorial, {impl}: failed: {str(error)[:300]}")
            continue
        found[impl] = [launch["s"] for launch in done["launches"]]
        ranks += [dict(launch.get("rank") or {}, impl=impl) for launch in done["launches"] if impl == "nblaunch"]
    out = []
    first_acc = (found.get("accelerate") or [None])[0]
    for impl, times in found.items():
        mine = impl == "nblaunch"
        out.append(row(impl, "tutorial loop on 1 GPU, cells 3 s apart: the first launch (CUDA started in the kernel)",
                       "s", times[:1], goal="<= Accelerate's first" if mine and first_acc else None,
                       met=(times[0] <= first_acc) if mine and first_acc else None))
        out.append(row(impl, "the same, the second launch", "s", times[1:2], goal="<= 1.0 s" if mine else None,
                       met=(times[1] <= 1.0) if mine and len(times) > 1 else None))
        if len(times) > 2:
            out.append(row(impl, "the same, the third and later launches", "s", times[2:], goal="<= 1.0 s" if mine else None,
                           met=(max(times[2:]) <= 1.0) if mine else None))
    if ranks:
        notes.append("tutorial, nblaunch, inside the rank per launch (prepare, loop): "
                     + "; ".join(f"{r.get('prepare_s', 0):.2f} s, {r.get('loop_s', 0):.2f} s" for r in ranks))
    notes.append("tutorial: each implementation in a Jupyter kernel of its own whose first cell asked "
                 "torch.cuda.is_available(); the function imports scikit-learn inside; raw: torch.multiprocessing "
                 "spawn, the function in a file")
    return out


def _have(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None
