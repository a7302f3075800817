"""4. Memory: the parent holds a tensor data set; 2 workers read their halves.

Sum of the workers' private memory (USS) and proportional memory (PSS) over the data set's
size, and the seconds from the call to the start of the function in the workers. nblaunch's fork
and spawn paths, with torch.multiprocessing spawn (tensors through shared memory) as reference.
"""

from __future__ import annotations

import gc
import tempfile
import time

from benchmarks.common import free_port, interleave, row
from benchmarks.workloads import raw_wrap, read_results, touch_shard

GOAL_FORK = 0.10
GOAL_SPAWN = 0.25
GOAL_SPAWN_START_S = 10.0


def _make(nbytes: int):
    import torch

    rows = max(2, nbytes // (256 * 4))
    return torch.full((rows, 256), 1.0)


def _one(impl: str, nbytes: int) -> dict:
    data = _make(nbytes)
    size = data.numel() * data.element_size()
    t_call = time.time()
    if impl.startswith("nblaunch"):
        from nblaunch import notebook_launcher

        per_rank = notebook_launcher(touch_shard, args=(data, t_call), num_processes=2, display="none",
                                     start_method=impl.split()[1])
    else:  # torch.multiprocessing spawn: tensors travel through shared memory
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(raw_wrap, args=(free_port(), 2, touch_shard, (data, t_call, tmp)), nprocs=2,
                               start_method="spawn")
            per_rank = read_results(tmp, 2)
    elapsed = time.time() - t_call
    expected = float(size // 4)
    assert abs(sum(r["sum"] for r in per_rank) - expected) < 1e-3 * expected, "workers saw wrong data"
    del data
    gc.collect()
    return {"uss": sum(r["uss"] for r in per_rank) / size, "pss": sum(r["pss"] for r in per_rank) / size,
            "start_s": max(r["start_s"] for r in per_rank), "total_s": elapsed, "size": size}


def run(quick: bool = False, size: str | None = None) -> dict:
    nbytes = {"tiny": 32 << 20}.get(size or "", (384 << 20) if quick else int(1.5e9))
    rounds = 1 if size == "tiny" or quick else 2
    impls = ["nblaunch fork", "nblaunch spawn", "torch.mp spawn"]
    if size == "tiny":
        impls = impls[:2]
    res = interleave(rounds, {impl: (lambda impl=impl: _one(impl, nbytes)) for impl in impls})
    rows, notes = [], [f"{impl}: {len(e)} failed: {e[0]}" for impl, e in res["_errors"].items()]
    for impl in impls:
        vals = res[impl]
        get = lambda k: [None if v is None else v[k] for v in vals]  # noqa: E731
        goal_uss = {"nblaunch fork": GOAL_FORK, "nblaunch spawn": GOAL_SPAWN}.get(impl)
        uss = get("uss")
        met = None if goal_uss is None else (bool(uss) and None not in uss and max(uss) <= goal_uss)
        rows.append(row(impl, "workers' USS sum / data set", "x", uss,
                        goal=None if goal_uss is None else f"<= {goal_uss}x", met=met))
        rows.append(row(impl, "workers' PSS sum / data set", "x", get("pss")))
        start = get("start_s")
        goal = met = None
        if impl == "nblaunch spawn":
            goal, met = f"starts in < {GOAL_SPAWN_START_S:g} s", bool(start) and None not in start and max(start) < GOAL_SPAWN_START_S
        rows.append(row(impl, "call -> function starts in the workers", "s", start, goal=goal, met=met))
    notes.append(f"data set: one float32 tensor of {nbytes / 1e9:.2f} GB in the parent; {rounds} interleaved round(s); "
                 "USS = private clean + dirty pages (smaps_rollup), includes each worker's own interpreter and torch")
    return {"rows": rows, "notes": notes}
