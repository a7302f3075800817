"""12. Re-running a cell (issues 44, 60): a later launch of a training function that imports
scikit-learn inside and trains a small CNN with DDP and AdamW for 8 steps, 2 s after the launch
before it.

Each sample is a fresh Jupyter kernel (nbclient): its first cell imports torch and the launcher,
the next launches the function once (not timed), then it is launched twice more, each in a cell
of its own run 2 s after the one before ended (the kernel idle meanwhile, as when a person
re-runs a cell). A cell is timed as its user waits for it: from the kernel taking it up to its
reply (the kernel's own timestamps), so whatever a cell waits for before its code runs counts. nblaunch forks its ranks from the kernel (``fork``) or takes them
from its launch server (``server``: ``start_method="spawn"``, the path of a kernel that started
CUDA); raw torch (``torch.multiprocessing``, fork) and Accelerate's ``notebook_launcher`` start
plain ranks each time. For scale: a trivial launch (a function that returns at once), and the
same function's second run in the calling process.
"""

from __future__ import annotations

import os
import time

from benchmarks.common import have_accelerate, interleave, pair_ratios, row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GAP_S = 2.0
GOAL_S = 0.25
IMPLS = {"nblaunch fork": ("nblaunch", None), "nblaunch server": ("nblaunch", "spawn"), "raw": ("raw", None),
         "accelerate": ("accelerate", None)}


def small_cnn_step() -> float:
    """The function each rank runs (issue 60's): scikit-learn's digits imported inside, a small
    CNN under DDP (its own gloo group where the launcher made none), AdamW, 8 steps. Where
    ``NBLAUNCH_BENCH_ENDS`` names a folder, each rank writes there when it returned (wall clock):
    every launcher's ranks report their end the same way."""
    started = time.perf_counter()
    from sklearn.datasets import load_digits
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    digits = load_digits()
    images = torch.tensor(digits.images[:256], dtype=torch.float32)[:, None] / 16
    labels = torch.tensor(digits.target[:256])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(8):
        batch = slice(32 * step, 32 * step + 32)
        loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ends = os.environ.get("NBLAUNCH_BENCH_ENDS")
    if ends:
        with open(os.path.join(ends, f"{os.getpid()}.tmp"), "w") as end:
            end.write(repr(time.time()))
        os.replace(end.name, end.name[:-len(".tmp")])
    return time.perf_counter() - started


def returns_at_once() -> int:
    return 0


def _cells(name: str) -> list[str]:
    """The kernel's cells for ``name``: a setup, a first launch, then two timed ones 2 s apart."""
    impl, method = IMPLS.get(name, ("nblaunch", None))
    options = f", start_method={method!r}" if method else ""
    function = "returns_at_once" if name == "trivial launch" else "small_cnn_step"
    setup = (f"import sys, time, json\nsys.path.insert(0, {ROOT!r})\nimport torch\n"
             f"from benchmarks.m_rerun import small_cnn_step, returns_at_once\n"
             f"from benchmarks.workloads import run_launch\n" + ("import nblaunch\n" if impl == "nblaunch" else ""))
    if name == "in the calling process":  # a group of one, for the function's own init_process_group
        setup += ("import os\nfrom benchmarks.common import free_port\n"
                  "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()), RANK='0', WORLD_SIZE='1')\n")
        launch = "small_cnn_step()"
    else:
        launch = f"run_launch({impl!r}, {function}{options})"
    return [setup, launch, launch, launch]


def _fresh(name: str) -> dict:
    import datetime

    import nbformat
    from nbclient import NotebookClient

    def pause(cell, cell_index, **_):  # the kernel is idle meanwhile, as between a person's cells
        if cell_index >= 1:
            time.sleep(GAP_S)

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in _cells(name)])
    NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True, on_cell_executed=pause,
                   resources={"metadata": {"path": ROOT}}).execute()
    errors = [f"{o.ename}: {o.evalue}" for cell in notebook.cells for o in cell.outputs if o.output_type == "error"]
    if errors:
        raise RuntimeError(f"{name}: {errors[0]}")
    later = []
    for cell in notebook.cells[2:]:
        execution = cell.metadata["execution"]
        began, replied = (datetime.datetime.fromisoformat(execution[key].replace("Z", "+00:00"))
                          for key in ("iopub.execute_input", "shell.execute_reply"))
        later.append((replied - began).total_seconds())
    return {"later_s": later}


def run(quick: bool = False, size: str | None = None) -> dict:
    names = [n for n in IMPLS if n != "accelerate" or have_accelerate()] + ["trivial launch", "in the calling process"]
    rounds = 1 if quick else 3
    done = interleave(rounds, {name: (lambda name=name: _fresh(name)) for name in names})
    notes = [f"{name}: {len(errors)} failed: {errors[0]}" for name, errors in done["_errors"].items()]
    rows = []
    for which, label in ((0, "the second launch of a function that imports scikit-learn and trains a small CNN "
                             "(DDP, AdamW, 8 steps), 2 s after the first"), (1, "the same, the third, 2 s after the second")):
        samples = {name: [sample["later_s"][which] if sample and len(sample["later_s"]) > which else None
                          for sample in done[name]] for name in names}
        for name in names:
            goal = met = ratios = None
            if name.startswith("nblaunch"):
                taken = [s for s in samples[name] if s is not None]
                goal, met = f"<= {GOAL_S} s", bool(taken) and max(taken) <= GOAL_S
                ratios = {"vs raw": pair_ratios(samples[name], samples.get("raw", []))}
            rows.append(row(name, label, "s", samples[name], goal=goal, met=met, ratios=ratios))
    notes.append(f"{rounds} fresh interpreter(s) per implementation, interleaved; 'trivial launch' is nblaunch fork "
                 "with a function that returns at once; 'in the calling process' times the function's second run "
                 "(a call, not a launch); every sample in a Jupyter kernel of its own")
    return {"rows": rows, "notes": notes}
