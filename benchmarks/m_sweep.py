"""13. A sweep (issues 52, 60): 5 launches back to back of the function of ``m_rerun``
(scikit-learn imported inside, a small CNN with DDP and AdamW, 8 steps), 2 ranks, as a
learning-rate sweep runs them: in a script (a fresh interpreter that imports torch and the
launcher, then loops), through fork and through the launch server, and in one cell of a real
Jupyter kernel. Each launch is timed from the call to its return. Raw ``torch.multiprocessing``
(fork) and Accelerate's ``notebook_launcher`` run the same loop in a script.

And a script with one launch of it (issue 60): when the call returns after its ranks' function
returned (each rank writes the moment down), when the process exits after the call returned, and
the whole script, from start to exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import have_accelerate, interleave, pair_ratios, row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHES = 5
GOAL_LATER_S = 0.25
GOAL_FIRST_ADDS_S = 0.3  # a fresh interpreter's first launch, over raw torch's (issue 60)
GOAL_RETURNED_ADDS_S = 0.1  # a script's one launch returns after its ranks, over raw torch's
GOAL_EXIT_ADDS_S = 0.3  # ... and the script exits after it, over raw torch's
IMPLS = {"nblaunch fork, script": ("nblaunch", None), "nblaunch server, script": ("nblaunch", "spawn"),
         "raw, script": ("raw", None), "accelerate, script": ("accelerate", None),
         "nblaunch fork, one cell": ("nblaunch", None)}


def _loop(name: str) -> str:
    impl, method = IMPLS[name]
    options = f", start_method={method!r}" if method else ""
    return (f"import sys, time, json\nsys.path.insert(0, {ROOT!r})\nimport torch\n"
            + ("import nblaunch\n" if impl == "nblaunch" else "")
            + "from benchmarks.m_rerun import small_cnn_step\nfrom benchmarks.workloads import run_launch\n"
            f"taken = []\nfor _ in range({LAUNCHES}):\n    began = time.perf_counter()\n"
            f"    run_launch({impl!r}, small_cnn_step{options})\n    taken.append(time.perf_counter() - began)\n"
            "print('SWEEP ' + json.dumps(taken))\n")


def _one_launch(name: str) -> dict:
    """A fresh interpreter that launches the function once, then ends (see the module)."""
    impl, method = IMPLS[name]
    options = f", start_method={method!r}" if method else ""
    source = (f"import sys, time\nsys.path.insert(0, {ROOT!r})\nimport torch\n"
              + ("import nblaunch\n" if impl == "nblaunch" else "")
              + "from benchmarks.m_rerun import small_cnn_step\nfrom benchmarks.workloads import run_launch\n"
              f"run_launch({impl!r}, small_cnn_step{options})\nprint('RETURNED', repr(time.time()), flush=True)\n")
    with tempfile.TemporaryDirectory() as ends:
        began = time.time()
        done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env=dict(os.environ, NBLAUNCH_BENCH_ENDS=ends))
        exited = time.time()
        returned = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("RETURNED ")]
        ranks_ended = [float(open(os.path.join(ends, f)).read()) for f in os.listdir(ends) if not f.endswith(".tmp")]
    if not returned or len(ranks_ended) != 2:
        raise RuntimeError(f"no result: {done.stderr[-500:]}")
    return {"returned_after_ranks_s": returned[0] - max(ranks_ended), "exited_after_return_s": exited - returned[0],
            "whole_s": exited - began}


def _script(name: str) -> list[float]:
    done = subprocess.run([sys.executable, "-c", _loop(name)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    return _taken(done.stdout, done.stderr)


def _one_cell(name: str) -> list[float]:
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(_loop(name))])
    NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": ROOT}}).execute()
    outputs = notebook.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    return _taken(text, errors[0] if errors else "")


def _taken(stdout: str, stderr: str) -> list[float]:
    for line in stdout.splitlines():
        if line.startswith("SWEEP "):
            return json.loads(line[len("SWEEP "):])
    raise RuntimeError(f"no result: {stderr[-500:]}")


def run(quick: bool = False, size: str | None = None) -> dict:
    names = [n for n in IMPLS if not n.startswith("accelerate") or have_accelerate()]
    rounds = 1 if quick else 2
    done = interleave(rounds, {n: (lambda n=n: _one_cell(n) if n.endswith("one cell") else _script(n)) for n in names})
    notes = [f"{name}: {len(errors)} failed: {errors[0]}" for name, errors in done["_errors"].items()]
    rows = []
    per_round = {name: [s if s else None for s in done[name]] for name in names}

    def versus(name: str, pick) -> dict | None:  # each nblaunch round against raw's same round
        if not name.startswith("nblaunch") or "raw, script" not in per_round:
            return None
        mine, raw = ([pick(s) if s else None for s in per_round[n]] for n in (name, "raw, script"))
        return {"vs raw": pair_ratios(mine, raw)}

    for name in names:
        samples = [s for s in per_round[name] if s]
        first = [s[0] for s in samples]
        goal = met = None
        # The default path's (fork); the launch server's first launch also starts the server (its
        # own import of torch), as raw spawn would in every rank.
        if name == "nblaunch fork, script" and "raw, script" in per_round:
            raw_first = [s[0] for s in per_round["raw, script"] if s]
            goal = f"<= raw + {GOAL_FIRST_ADDS_S} s"
            met = bool(first) and bool(raw_first) and sorted(first)[len(first) // 2] - sorted(raw_first)[
                len(raw_first) // 2] <= GOAL_FIRST_ADDS_S
        rows.append(row(name, "the first launch of the sweep (a fresh interpreter's first)", "s", first, goal=goal,
                        met=met, ratios=versus(name, lambda s: s[0])))
        later = [max(s[1:]) for s in samples]
        goal = met = None
        if name.startswith("nblaunch"):
            goal, met = f"<= {GOAL_LATER_S} s", bool(later) and max(later) <= GOAL_LATER_S
        rows.append(row(name, f"the slowest of launches 2-{LAUNCHES}", "s", later, goal=goal, met=met,
                        ratios=versus(name, lambda s: max(s[1:]))))
        rows.append(row(name, f"all {LAUNCHES} launches", "s", [sum(s) for s in samples], ratios=versus(name, sum)))
    notes.append(f"{rounds} fresh interpreter(s) or kernel(s) per implementation, interleaved; 2 ranks; each launch "
                 "timed from the call to its return")
    scripts = [n for n in names if n.endswith("script")]
    once = interleave(rounds + 1, {n: (lambda n=n: _one_launch(n)) for n in scripts})
    notes += [f"one launch, {name}: {len(errors)} failed: {errors[0]}" for name, errors in once["_errors"].items()]
    for key, label, goal_s in (("returned_after_ranks_s", "a script's one launch: the call returns, after its ranks' "
                                "function returned", GOAL_RETURNED_ADDS_S),
                               ("exited_after_return_s", "the same script exits, after the call returned", GOAL_EXIT_ADDS_S),
                               ("whole_s", "the same script, from start to exit", None)):
        taken = {name: [s[key] if s else None for s in once[name]] for name in scripts}
        for name in scripts:
            goal = met = ratios = None
            if name.startswith("nblaunch") and "raw, script" in taken:
                ratios = {"vs raw": pair_ratios(taken[name], taken["raw, script"])}
                if goal_s is not None:
                    added = [a - b for a, b in zip(taken[name], taken["raw, script"]) if a is not None and b is not None]
                    goal = f"<= raw + {goal_s} s"
                    met = bool(added) and sorted(added)[len(added) // 2] <= goal_s
            rows.append(row(name, label, "s", taken[name], goal=goal, met=met, ratios=ratios))
    return {"rows": rows, "notes": notes}
