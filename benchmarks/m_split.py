"""15. What the step split costs: DDP steps/s of nblaunch's Accelerator inside a launch with the
split on (the default) and off (``NBLAUNCH_STEP_SPLIT=0``), beside raw torch and Accelerate.

Both nblaunch columns are real ``notebook_launcher`` launches of 2 ranks, since the rank's clock
starts only inside one; raw torch and Accelerate's Accelerator run in the ``ddp`` measurement's
carrier (``torch.multiprocessing`` fork). Steps/s are measured inside the ranks (the mean of the
two), over the same loop as ``ddp`` (a 256-512-512-10 MLP, batch 64 per rank, one intra-op thread
per rank); each round runs every column once, in a rotating order.

Launch against launch, two cores shared by two ranks vary by 5 % or more, more than the split can
cost. So the goal is measured in pairs inside one launch: two copies of the model, one prepared
with the rank's clock running (its forward hooks) and one without, trained in alternating blocks of steps with the clock on and off; each
pair of neighbouring blocks gives one ratio.
"""

from __future__ import annotations

import os

from benchmarks.common import have_accelerate, interleave, pair_ratios, row, summary
from benchmarks.m_train import _carrier, _preimport
from benchmarks.workloads import make_data, train_phases

GOAL_ON_OFF = 0.98
BLOCK_STEPS = 25


def alternating_blocks(x, y, pairs: int) -> list[float]:
    """In a rank: ``pairs`` ratios of steps/s, split on over split off, from neighbouring blocks."""
    import time

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.workloads import make_mlp
    from nblaunch.training import Accelerator
    from nblaunch.worker import step_clock

    accelerator = Accelerator(cpu=True)  # starts the rank's clock
    torch.set_num_threads(1)
    torch.manual_seed(0)
    loader = accelerator.prepare(DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))

    def prepared() -> tuple:
        model = accelerator.prepare(make_mlp())
        return model, accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    timed = prepared()  # with the clock running: its forward hooks
    with step_clock.set_aside():
        untimed = prepared()  # as with the split off

    def run(which) -> float:
        if which is timed:
            return block(*which)
        with step_clock.set_aside():
            return block(*which)

    def block(model, optimizer) -> float:
        began, done = time.perf_counter(), 0
        while done < BLOCK_STEPS:
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done == BLOCK_STEPS:
                    break
        return BLOCK_STEPS / (time.perf_counter() - began)

    for which in (timed, untimed):  # warm-up
        run(which)
    ratios = []
    for index in range(pairs):
        rates = {}
        for which in ((timed, untimed) if index % 2 == 0 else (untimed, timed)):
            rates[which is timed] = run(which)
        ratios.append(rates[True] / rates[False])
    return ratios


def _in_a_launch(x, y, steps: int, split: bool) -> float:
    from nblaunch import notebook_launcher

    saved = os.environ.get("NBLAUNCH_STEP_SPLIT")
    os.environ["NBLAUNCH_STEP_SPLIT"] = "1" if split else "0"
    try:
        per_rank = notebook_launcher(train_phases, args=("nblaunch", x, y, 64, "no", 20, steps, 1),
                                     num_processes=2, display="none")
    finally:
        if saved is None:
            os.environ.pop("NBLAUNCH_STEP_SPLIT")
        else:
            os.environ["NBLAUNCH_STEP_SPLIT"] = saved
    return sum(r["steps_per_s"] for r in per_rank) / len(per_rank)


def _paired(x, y, pairs: int) -> list[float]:
    from nblaunch import notebook_launcher

    per_rank = notebook_launcher(alternating_blocks, args=(x, y, pairs), num_processes=2, display="none")
    return [(a + b) / 2 for a, b in zip(*per_rank)]


def _in_the_carrier(impl: str, x, y, steps: int) -> float:
    per_rank = _carrier(train_phases, (impl, x, y, 64, "no", 20, steps, 1))
    return sum(r["steps_per_s"] for r in per_rank) / len(per_rank)


def run(quick: bool = False, size: str | None = None) -> dict:
    impls = ["raw", "nblaunch"] + (["accelerate"] if have_accelerate() else [])
    _preimport(impls)
    samples = 2048 if size == "tiny" else 16384
    rounds = 1 if size == "tiny" else (2 if quick else 5)
    steps = 20 if size == "tiny" else (100 if quick else 200)
    x, y = make_data(samples)
    columns = {
        "nblaunch (split on)": lambda: _in_a_launch(x, y, steps, True),
        "nblaunch (split off)": lambda: _in_a_launch(x, y, steps, False),
        "raw": lambda: _in_the_carrier("raw", x, y, steps),
    }
    if "accelerate" in impls:
        columns["accelerate"] = lambda: _in_the_carrier("accelerate", x, y, steps)
    pairs = 4 if size == "tiny" else (12 if quick else 24)
    columns["nblaunch, on/off in one launch"] = lambda: _paired(x, y, pairs)
    res = interleave(rounds, columns)
    notes = [f"{name}: {len(errors)} failed: {errors[0]}" for name, errors in res["_errors"].items()]
    on, off, raw = res["nblaunch (split on)"], res["nblaunch (split off)"], res["raw"]
    rows = []
    for name in ("nblaunch (split on)", "nblaunch (split off)", "raw", "accelerate"):
        if name not in res:
            continue
        ratios = {"vs raw": pair_ratios(res[name], raw)} if name != "raw" else None
        if name == "nblaunch (split on)":
            ratios["vs split off"] = pair_ratios(on, off)
        rows.append(row(name, "DDP steps/s (fp32), launch by launch", "steps/s", res[name], ratios=ratios,
                        lower_is_better=False))
    paired = [ratio for one_round in res["nblaunch, on/off in one launch"] if one_round for ratio in one_round]
    median = summary(paired)["median"]
    rows.append(row("nblaunch (split on)", f"steps/s against split off, in pairs of {BLOCK_STEPS}-step blocks "
                    "in one launch", "", paired, goal=f">= {GOAL_ON_OFF}x split off",
                    met=median is not None and median >= GOAL_ON_OFF,
                    ratios={"vs split off, paired": summary(paired)}, lower_is_better=False))
    notes.append(f"MLP 256-512-512-10, {samples} samples, batch 64 per rank, SGD+momentum, 2 ranks x 1 thread; "
                 f"{rounds} interleaved rounds of 20 warm-up + {steps} timed steps. nblaunch's columns are "
                 "notebook_launcher launches (the split runs only inside one: a prepared DataLoader's wait, the "
                 "forward hooks, the backward and its end of compute, the optimizer's step, a send twice a "
                 "second); raw and accelerate run in the ddp measurement's torch.multiprocessing carrier")
    return {"rows": rows, "notes": notes}
