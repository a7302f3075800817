"""1. Launch latency (trivial function, rendezvous included) and time to the first training step.

warm: interleaved launches in one process (after one discarded launch each).
cold: each sample is a fresh interpreter that imports torch and the launcher, as a notebook's
first cell does, then times its first launch.
spawn: the launch a kernel that initialised CUDA gets (``start_method="spawn"`` here, where no
GPU is): later launches in one process against a fork launch of the same function, and the first
one in a fresh interpreter; raw is ``torch.multiprocessing`` with ``start_method="spawn"``.
first step: a fresh interpreter imports torch, the launcher and the Accelerator class (a
notebook's first cell), then times from the call to the end of the first optimizer step inside
the workers (Accelerator + DDP + prepare + one AdamW step), for a first and a second launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import have_accelerate, interleave, pair_ratios, row
from benchmarks.workloads import IMPLS_ALL, read_results, rendezvous, run_launch

GOAL_RATIO_RAW = 1.1  # a trivial launch, warm (issue 60)
GOAL_RATIO_ACC = 0.4
GOAL_FIRST_STEP_S = 0.3
GOAL_IMPORT_ADDS_S = 0.3  # what importing the Accelerator may add to importing torch
GOAL_FIRST_LAUNCH_ADDS_S = 0.3  # a fresh kernel's first launch of ranks that make an Accelerator (issue 38)
GOAL_SPAWN_VS_FORK = 2.0  # a later spawn launch against a fork launch, in one process (issue 37)
GOAL_FIRST_SPAWN_VS_RAW = 1.0  # the first spawn launch: no slower than a fresh interpreter per rank


def _impls() -> list[str]:
    return [i for i in IMPLS_ALL if i != "accelerate" or have_accelerate()]


def _fresh(args: list[str], timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.m_launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"fresh interpreter failed ({proc.returncode}): {proc.stderr[-800:]}")
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------- in a fresh interpreter
def _cold_trivial(impl: str, start_method: str | None = None) -> dict:
    import torch  # noqa: F401  the notebook has torch
    import torch.distributed  # noqa: F401

    t0 = time.perf_counter()
    if impl == "nblaunch":
        import nblaunch  # noqa: F401
    elif impl == "accelerate":
        import accelerate  # noqa: F401
    else:
        import torch.multiprocessing  # noqa: F401
    t1 = time.perf_counter()
    run_launch(impl, rendezvous, start_method=start_method)
    t2 = time.perf_counter()
    return {"import_s": t1 - t0, "launch_s": t2 - t1}


def _cold_accelerator(impl: str) -> dict:
    """A notebook's first two cells: import torch and the launcher, then launch 2 ranks that each
    make an Accelerator (raw: join a gloo group). Timed from before the launcher's import."""
    import torch  # noqa: F401  the notebook has torch

    from benchmarks.workloads import make_an_accelerator

    t0 = time.perf_counter()
    if impl == "nblaunch":
        import nblaunch  # noqa: F401
    elif impl == "accelerate":
        import accelerate  # noqa: F401
    else:
        import torch.multiprocessing  # noqa: F401
    run_launch(impl, make_an_accelerator, (impl,))
    return {"launch_s": time.perf_counter() - t0}


def _first_steps(impl: str) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    if impl == "nblaunch":
        from nblaunch import Accelerator, notebook_launcher  # noqa: F401  (the notebook's first cell)
    elif impl == "accelerate":
        from accelerate import Accelerator, notebook_launcher  # noqa: F401
    out = {"import": time.perf_counter() - t0}

    from benchmarks.workloads import first_step, make_data, raw_first_step

    x, y = make_data(4096)
    for which in ("first", "second"):
        with tempfile.TemporaryDirectory() as tmp:
            t_call = time.time()
            if impl == "raw":
                import torch.multiprocessing as mp

                from benchmarks.common import free_port

                mp.start_processes(raw_first_step, args=(free_port(), 2, t_call, x, y, tmp), nprocs=2, start_method="fork")
            else:
                run_launch(impl, first_step, (impl, t_call, x, y, tmp))
            t_back = time.time() - t_call
            out[which] = max(read_results(tmp, 2))
            out[which + "_returned"] = t_back
    return out


# ----------------------------------------------------------------------------- the measurement
def run(quick: bool = False, size: str | None = None) -> dict:
    impls = _impls()
    warm_rounds = 3 if quick else 20
    fresh_rounds = 1 if quick else 4
    rows, notes = [], []

    # warm: one discarded launch each, then interleaved rounds
    for impl in impls:
        run_launch(impl, rendezvous)

    def timed(impl):
        def one():
            t0 = time.perf_counter()
            run_launch(impl, rendezvous)
            return time.perf_counter() - t0
        return one

    warm = interleave(warm_rounds, {impl: timed(impl) for impl in impls})
    cold = interleave(fresh_rounds, {impl: (lambda impl=impl: _fresh(["cold", impl])) for impl in impls})
    first = interleave(fresh_rounds, {impl: (lambda impl=impl: _fresh(["first-step", impl], 240)) for impl in impls})
    made = interleave(fresh_rounds, {impl: (lambda impl=impl: _fresh(["cold-accelerator", impl])) for impl in impls})
    for kind, errors in (("warm", warm["_errors"]), ("cold", cold["_errors"]), ("first step", first["_errors"]),
                         ("cold accelerator", made["_errors"])):
        for impl, errs in errors.items():
            notes.append(f"{kind} {impl}: {len(errs)} failed: {errs[0]}")

    ms = lambda vals: [None if v is None else 1000 * v for v in vals]  # noqa: E731
    cold_ms = {i: ms([None if c is None else c["launch_s"] for c in cold[i]]) for i in impls}
    import_ms = {i: ms([None if c is None else c["import_s"] for c in cold[i]]) for i in impls}
    for label, data in (("warm launch", {i: ms(warm[i]) for i in impls}), ("cold launch", cold_ms)):
        for impl in impls:
            ratios = {f"vs {other}": pair_ratios(data[impl], data[other]) for other in impls if other != impl and impl == "nblaunch"}
            goal = met = None
            if impl == "nblaunch":
                vs_raw = ratios.get("vs raw", {}).get("median")
                vs_acc = ratios.get("vs accelerate", {}).get("median")
                goal = f"<= {GOAL_RATIO_RAW:.1f}x raw" + (f", <= {GOAL_RATIO_ACC:.1f}x accelerate" if "accelerate" in impls else "")
                met = vs_raw is not None and vs_raw <= GOAL_RATIO_RAW and (vs_acc is None or vs_acc <= GOAL_RATIO_ACC)
            rows.append(row(impl, label, "ms", data[impl], goal=goal, met=met, ratios=ratios))
    for impl in impls:
        goal = met = None
        if impl == "nblaunch":
            taken = [v for v in import_ms[impl] if v is not None]
            goal, met = f"<= {1000 * GOAL_IMPORT_ADDS_S:.0f} ms", bool(taken) and sorted(taken)[len(taken) // 2] <= 1000 * GOAL_IMPORT_ADDS_S
        rows.append(row(impl, "import of the launcher (fresh interpreter, torch already imported)", "ms", import_ms[impl],
                        goal=goal, met=met))
    made_s = {i: [None if m is None else m["launch_s"] for m in made[i]] for i in impls}
    for impl in impls:
        goal = met = ratios = None
        if impl == "nblaunch" and "raw" in impls:
            ratios = {f"vs {other}": pair_ratios(made_s[impl], made_s[other]) for other in impls if other != impl}
            added = [None if a is None or b is None else a - b for a, b in zip(made_s["nblaunch"], made_s["raw"])]
            goal = f"<= raw + {GOAL_FIRST_LAUNCH_ADDS_S} s"
            met = None not in added and bool(added) and sorted(added)[len(added) // 2] <= GOAL_FIRST_LAUNCH_ADDS_S
        rows.append(row(impl, "import + first launch of 2 ranks that make an Accelerator (fresh interpreter; raw: "
                        "join a gloo group)", "s", made_s[impl], goal=goal, met=met, ratios=ratios))
    imports = {i: [None if f is None else f["import"] for f in first[i]] for i in impls}
    for impl in impls:
        goal = met = None
        if impl == "nblaunch" and "raw" in impls:
            added = [None if a is None or b is None else a - b for a, b in zip(imports["nblaunch"], imports["raw"])]
            goal = f"<= torch + {GOAL_IMPORT_ADDS_S} s"
            met = None not in added and bool(added) and sorted(added)[len(added) // 2] <= GOAL_IMPORT_ADDS_S
        rows.append(row(impl, "import torch and the Accelerator class (fresh interpreter; raw: torch alone)", "s",
                        imports[impl], goal=goal, met=met))
    for which, label in (("first", "call -> first step, first launch"), ("second", "call -> first step, second launch")):
        data = {i: [None if f is None else f[which] for f in first[i]] for i in impls}
        for impl in impls:
            ratios = {f"vs {other}": pair_ratios(data[impl], data[other]) for other in impls if other != impl and impl == "nblaunch"}
            goal = met = None
            if impl == "nblaunch":
                goal = f"<= {GOAL_FIRST_STEP_S} s"
                met = bool(data[impl]) and None not in data[impl] and max(data[impl]) <= GOAL_FIRST_STEP_S
            rows.append(row(impl, label, "s", data[impl], goal=goal, met=met, ratios=ratios))
    total = {i: [None if f is None else f["import"] + f["first"] for f in first[i]] for i in impls}
    for impl in impls:
        rows.append(row(impl, "fresh interpreter -> first step (the two above together)", "s", total[impl]))
    rows += _spawn_rows(warm_rounds, fresh_rounds, notes)
    notes.append("import: torch._dynamo (about 1 s) is imported by a first optimizer; nblaunch imports it in the "
                 "launcher before its first fork launch that trains, so forked ranks inherit it: in this fresh "
                 "interpreter that second is part of the first launch, not of the import")
    notes.append(f"warm: {warm_rounds} interleaved rounds after one discarded launch each; cold and first step: "
                 f"{fresh_rounds} fresh interpreter(s) per implementation, interleaved")
    return {"rows": rows, "notes": notes}


def _spawn_rows(warm_rounds: int, fresh_rounds: int, notes: list[str]) -> list[dict]:
    """Launches that cannot fork from the kernel: later ones in one process, and the first."""
    launches = {"nblaunch spawn": lambda: run_launch("nblaunch", rendezvous, start_method="spawn"),
                "nblaunch fork": lambda: run_launch("nblaunch", rendezvous),
                "raw spawn": lambda: run_launch("raw", rendezvous, start_method="spawn")}
    for launch in launches.values():
        launch()  # nblaunch's spawn: its launch server starts here, once per process

    def timed(launch):
        def one():
            t0 = time.perf_counter()
            launch()
            return 1000 * (time.perf_counter() - t0)
        return one

    later = interleave(warm_rounds, {name: timed(launch) for name, launch in launches.items()})
    first = interleave(fresh_rounds, {name: (lambda impl=impl: _fresh(["cold-spawn", impl]))
                                      for name, impl in (("nblaunch spawn", "nblaunch"), ("raw spawn", "raw"))})
    for kind, errors in (("spawn later", later["_errors"]), ("spawn first", first["_errors"])):
        for name, errs in errors.items():
            notes.append(f"{kind} {name}: {len(errs)} failed: {errs[0]}")
    rows = []
    metric = "spawn launch, second and later in one process"
    for name in launches:
        ratios = goal = met = None
        if name == "nblaunch spawn":
            ratios = {"vs nblaunch fork": pair_ratios(later[name], later["nblaunch fork"]),
                      "vs raw spawn": pair_ratios(later[name], later["raw spawn"])}
            goal = f"<= {GOAL_SPAWN_VS_FORK:.1f}x nblaunch fork"
            median = ratios["vs nblaunch fork"].get("median")
            met = median is not None and median <= GOAL_SPAWN_VS_FORK
        rows.append(row(name, metric, "ms", later[name], goal=goal, met=met, ratios=ratios))
    firsts = {name: [None if f is None else 1000 * f["launch_s"] for f in first[name]] for name in first if name != "_errors"}
    for name, samples in firsts.items():
        ratios = goal = met = None
        if name == "nblaunch spawn":
            ratios = {"vs raw spawn": pair_ratios(samples, firsts["raw spawn"])}
            goal = f"<= {GOAL_FIRST_SPAWN_VS_RAW:.1f}x raw spawn"
            median = ratios["vs raw spawn"].get("median")
            met = median is not None and median <= GOAL_FIRST_SPAWN_VS_RAW
        rows.append(row(name, "spawn launch, the first in a fresh interpreter", "ms", samples, goal=goal, met=met,
                        ratios=ratios))
    notes.append("spawn: nblaunch forks spawn ranks from its launch server (started by a process's first such launch, "
                 "then reused); raw spawn starts a fresh interpreter per rank at every launch")
    return rows


if __name__ == "__main__":
    kind, impl = sys.argv[1], sys.argv[2]
    if kind == "cold-spawn":
        result = _cold_trivial(impl, start_method="spawn")
    elif kind == "cold-accelerator":
        result = _cold_accelerator(impl)
    else:
        result = _cold_trivial(impl) if kind == "cold" else _first_steps(impl)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
