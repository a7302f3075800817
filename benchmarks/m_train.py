"""2. DDP steps/s of a small MLP, phase by phase, and 3. prepared DataLoader batches/s.

Every implementation runs inside the same carrier (torch.multiprocessing fork, one intra-op
thread per worker, torch._dynamo and both Accelerators imported in the parent first), so only
what happens inside the workers differs. Each round launches each implementation once, in a
rotating order; the numbers are measured inside the workers (mean over the ranks).
"""

from __future__ import annotations

import tempfile

from benchmarks.common import free_port, have_accelerate, interleave, pair_ratios, row
from benchmarks.workloads import IMPLS_ALL, loader_rate, make_data, raw_wrap, read_results, train_phases

GOAL_STEPS_RATIO = 0.99
GOAL_PHASE_MS = 0.05
GOAL_LOADER_RATIO = 0.98


def _carrier(fn, args: tuple) -> list:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(raw_wrap, args=(free_port(), 2, fn, (*args, tmp)), nprocs=2, start_method="fork")
        return read_results(tmp, 2)


def _preimport(impls) -> None:
    import torch._dynamo  # noqa: F401  (each worker would import it when its optimizer is built)

    import nblaunch.training  # noqa: F401
    if "accelerate" in impls:
        import accelerate  # noqa: F401


def run_training(quick: bool = False, size: str | None = None) -> dict:
    impls = [i for i in IMPLS_ALL if i != "accelerate" or have_accelerate()]
    _preimport(impls)
    samples = 2048 if size == "tiny" else 16384
    rounds = 1 if size == "tiny" else (2 if quick else 5)
    steps = 20 if size == "tiny" else (100 if quick else 200)
    x, y = make_data(samples)
    rows, notes = [], []
    for precision in ("no", "bf16"):
        label = "fp32" if precision == "no" else precision

        def one(impl, precision=precision):
            per_rank = _carrier(train_phases, (impl, x, y, 64, precision, 20, steps, 1))
            return {
                "steps_per_s": sum(r["steps_per_s"] for r in per_rank) / len(per_rank),
                "phase_ms": {k: sum(r["phase_ms"][k] for r in per_rank) / len(per_rank) for k in per_rank[0]["phase_ms"]},
            }

        res = interleave(rounds, {impl: (lambda impl=impl: one(impl)) for impl in impls})
        for impl, errs in res["_errors"].items():
            notes.append(f"DDP {label} {impl}: {len(errs)} failed: {errs[0]}")
        sps = {i: [None if r is None else r["steps_per_s"] for r in res[i]] for i in impls}
        for impl in impls:
            ratios = {"vs raw": pair_ratios(sps[impl], sps["raw"])} if impl != "raw" else None
            goal = met = None
            if impl == "nblaunch":
                goal = f">= {GOAL_STEPS_RATIO}x raw"
                met = ratios["vs raw"]["median"] is not None and ratios["vs raw"]["median"] >= GOAL_STEPS_RATIO
            rows.append(row(impl, f"DDP steps/s ({label})", "steps/s", sps[impl], goal=goal, met=met,
                            ratios=ratios, lower_is_better=False))
        for phase in ("data", "forward", "backward", "optimizer"):
            per = {i: [None if r is None else r["phase_ms"][phase] for r in res[i]] for i in impls}
            for impl in impls:
                ratios = None
                goal = met = None
                if impl != "raw":
                    diffs = [a - b for a, b in zip(per[impl], per["raw"]) if a is not None and b is not None]
                    from benchmarks.common import summary
                    ratios = {"minus raw (ms)": summary(diffs)}
                    if impl == "nblaunch":
                        goal = f"<= raw + {GOAL_PHASE_MS} ms"
                        met = bool(diffs) and summary(diffs)["median"] <= GOAL_PHASE_MS
                rows.append(row(impl, f"{label} phase: {phase}", "ms/step", per[impl], goal=goal, met=met, ratios=ratios))
    notes.append(f"MLP 256-512-512-10, {samples} samples, batch 64 per rank, SGD+momentum, 2 ranks x 1 thread; "
                 f"{rounds} interleaved rounds of 20 warm-up + {steps} timed steps")
    return {"rows": rows, "notes": notes}


def run_loader(quick: bool = False, size: str | None = None) -> dict:
    impls = [i for i in IMPLS_ALL if i != "accelerate" or have_accelerate()]
    _preimport(impls)
    impls.insert(1, "raw_synced")
    n = 8192 if size == "tiny" else 65536
    rounds = 1 if size == "tiny" else (3 if quick else 15)  # rounds vary by 15%: many of them
    epochs = 1 if size == "tiny" else 3

    def one(impl):
        per_rank = _carrier(loader_rate, (impl, n, 64, epochs))
        job_s = max(r["end"] for r in per_rank) - min(r["start"] for r in per_rank)
        return {"job": sum(r["batches"] for r in per_rank) / job_s,
                "rank": sum(r["batches_per_s"] for r in per_rank) / len(per_rank)}

    res = interleave(rounds, {impl: (lambda impl=impl: one(impl)) for impl in impls})
    rows, notes = [], [f"{impl}: {len(e)} failed: {e[0]}" for impl, e in res["_errors"].items()]
    for kind, metric in (("job", "prepared DataLoader batches/s, the job"),
                         ("rank", "prepared DataLoader batches/s, a rank's own")):
        rates = {i: [None if r is None else r[kind] for r in res[i]] for i in impls}
        for impl in impls:
            ratios = {"vs raw": pair_ratios(rates[impl], rates["raw"])} if impl != "raw" else None
            goal = met = None
            if impl == "nblaunch" and kind == "job":
                goal = f">= {GOAL_LOADER_RATIO}x raw"
                met = ratios["vs raw"]["median"] is not None and ratios["vs raw"]["median"] >= GOAL_LOADER_RATIO
            rows.append(row(impl, metric, "batches/s", rates[impl], goal=goal, met=met,
                            ratios=ratios, lower_is_better=False))
    notes.append(f"TensorDataset(arange({n})), batch 64, shuffled, 2 ranks; {rounds} interleaved rounds of {epochs} "
                 "epoch(s) after one warm-up epoch and a barrier (the common start line). The job: all ranks' "
                 "batches over the time from that line until the last rank is done, what an epoch costs a "
                 "training run. A rank's own: the mean of each rank's batches over its own time; raw's ranks "
                 "never wait for each other, while a prepared loader (nblaunch's and Accelerate's) agrees its "
                 "shuffling generator with rank 0 every epoch, so a rank that runs ahead waits there: on 2 "
                 "busy cores that wait is most of the gap in this row. raw_synced: raw with a barrier at every "
                 "epoch's start, the same wait")
    return {"rows": rows, "notes": notes}
