"""11. Several machines on Slurm: a real Slurm of 2 nodes on this machine (``tests/slurm/local_cluster``:
munged, slurmctld and one slurmd per node, 2 CPUs each), the measuring program inside an
allocation of both nodes (``salloc -N2 --ntasks-per-node=2``), as a kernel started by Open
OnDemand is.

Every launch runs 4 ranks (2 per node) that print a line, import torch, form a gloo group and
all_reduce once.

- nblaunch: ``notebook_launcher(all_reduce_4, cluster="slurm")``: one srun step of agents, each
  forking its node's ranks, results returned.
- srun + torchrun by hand: ``srun --overlap -N2 -n2 --ntasks-per-node=1 bash -c 'python -m
  torch.distributed.run --nnodes=2 --nproc-per-node=2 --node-rank=$SLURM_NODEID --master-addr=...
  --master-port=... script.py'``, what the user writes without nblaunch (no results come back:
  they would be files to read).

Measured: from the call to the first rank's first line, and to the end (results, or srun's exit);
the failure path (rank 3 raises while the others wait in an all_reduce: from its raise to the
call raising, or srun exiting).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import free_port, interleave, pair_ratios, row

GOAL_RATIO = 1.5
ROOT = Path(__file__).resolve().parents[1]

RANK_SCRIPT = """
import os, sys, time
print("first line from rank", os.environ["RANK"], flush=True)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if len(sys.argv) > 1 and dist.get_rank() == 3:
    time.sleep(0.2)
    open(sys.argv[1], "w").write(repr(time.time()))
    raise RuntimeError("rank 3 fails on purpose")
total = torch.ones(1)
dist.all_reduce(total)
if len(sys.argv) > 1:
    time.sleep(30)
"""


def all_reduce_4(fail_mark: str | None = None) -> float:
    """nblaunch's rank: the same work as RANK_SCRIPT."""
    import sys

    sys.argv = ["rank"] + ([fail_mark] if fail_mark else [])
    exec(compile(RANK_SCRIPT, "rank_script", "exec"), {"__name__": "rank"})
    return 4.0


class _FirstLine:
    """A display that notes when the first rank's first line arrived."""

    def __init__(self) -> None:
        self.first_line_at: float | None = None

    def on_event(self, event) -> None:
        if self.first_line_at is None and type(event).__name__ == "Output":
            self.first_line_at = time.perf_counter()

    def close(self) -> None:
        pass


def _nblaunch_once() -> tuple[float, float]:
    from nblaunch import notebook_launcher

    display = _FirstLine()
    started = time.perf_counter()
    results = notebook_launcher(all_reduce_4, cluster="slurm", display=display)
    ended = time.perf_counter()
    assert results == [4.0] * 4, results
    return display.first_line_at - started, ended - started


def _by_hand_once(script: str, fail_mark: str | None = None) -> tuple[float, float]:
    port = free_port()
    torchrun = (f"exec {sys.executable} -m torch.distributed.run --nnodes=2 --nproc-per-node=2 "
                f"--node-rank=$SLURM_NODEID --master-addr=127.0.0.1 --master-port={port} {script}"
                + (f" {fail_mark}" if fail_mark else ""))
    started = time.perf_counter()
    srun = subprocess.Popen(["srun", "--overlap", "-N2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                             "bash", "-c", torchrun], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    for line in srun.stdout:
        if first is None and "first line from rank" in line:
            first = time.perf_counter() - started
    srun.wait()
    return first, time.perf_counter() - started


def _failure_nblaunch() -> dict:
    from nblaunch import RankFailedError, notebook_launcher

    with tempfile.TemporaryDirectory() as tmp:
        mark = os.path.join(tmp, "failed_at")
        try:
            notebook_launcher(all_reduce_4, args=(mark,), cluster="slurm", display="none")
            return {"latency_s": None, "right_rank": False}
        except RankFailedError as error:
            raised = time.time()
            return {"latency_s": raised - float(Path(mark).read_text()), "right_rank": error.root_cause.rank == 3}


def _failure_by_hand(script: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mark = os.path.join(tmp, "failed_at")
        _by_hand_once(script, mark)
        ended = time.time()
        return {"latency_s": ended - float(Path(mark).read_text()), "right_rank": None}


def inside(rounds: int, out: str) -> None:
    """In the allocation: every measurement, its samples written to ``out`` as JSON."""
    script = os.path.join(tempfile.mkdtemp(), "rank_script.py")
    Path(script).write_text(RANK_SCRIPT)
    _nblaunch_once()  # the first launch of a process pays its imports: not a Slurm cost
    samples = interleave(rounds, {"nblaunch": _nblaunch_once, "by hand": lambda: _by_hand_once(script)})
    failures = interleave(max(2, rounds // 2), {"nblaunch": _failure_nblaunch,
                                                "by hand": lambda: _failure_by_hand(script)})
    Path(out).write_text(json.dumps({"samples": samples, "failures": failures}))


def run(quick: bool = False, size: str | None = None) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.slurm.local_cluster import LocalSlurm, missing_daemons

    rounds = 3 if quick else 8
    if missing_daemons():
        return {"rows": [], "notes": [f"Slurm is not installed ({', '.join(missing_daemons())} missing): "
                                      "bash .ci/slurm-setup.sh"]}
    with LocalSlurm(nodes=2, cpus=2) as slurm, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.json")
        environ = slurm.environ()
        environ["PYTHONPATH"] = str(ROOT)
        started = time.perf_counter()
        done = subprocess.run(["salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-c",
                               f"from benchmarks.m_slurm import inside; inside({rounds}, {out!r})"],
                              env=environ, capture_output=True, text=True, cwd=ROOT, timeout=900)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"the measurement in the allocation failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        measured = json.loads(Path(out).read_text())
        left = slurm.jobs() + [(step, name, "") for step, name in slurm.steps()]
    samples, failures = measured["samples"], measured["failures"]
    notes = [f"{impl}: {len(errs)} failed: {errs[0]}" for impl, errs in {**samples["_errors"],
                                                                         **failures["_errors"]}.items()]
    first = {impl: [s[0] if s else None for s in samples[impl]] for impl in ("nblaunch", "by hand")}
    whole = {impl: [s[1] if s else None for s in samples[impl]] for impl in ("nblaunch", "by hand")}
    ratio = pair_ratios(whole["nblaunch"], whole["by hand"])
    met = ratio.get("median") is not None and ratio["median"] <= GOAL_RATIO
    latency = {impl: [f["latency_s"] if f else None for f in failures[impl]] for impl in ("nblaunch", "by hand")}
    right = [f["right_rank"] for f in failures["nblaunch"] if f]
    rows = [
        row("by hand", "call -> first rank's first line", "s", first["by hand"]),
        row("nblaunch", "call -> first rank's first line", "s", first["nblaunch"],
            ratios={"vs srun + torchrun": pair_ratios(first["nblaunch"], first["by hand"])}),
        row("by hand", "call -> results, 4 ranks on 2 nodes of a running allocation", "s", whole["by hand"]),
        row("nblaunch", "call -> results, 4 ranks on 2 nodes of a running allocation", "s", whole["nblaunch"],
            ratios={"vs srun + torchrun": ratio}, goal=f"<= {GOAL_RATIO}x srun + torchrun", met=met),
        row("by hand", "rank 3 raises -> srun exits", "s", latency["by hand"]),
        row("nblaunch", "rank 3 raises -> the call raises", "s", latency["nblaunch"],
            note=f"names rank 3 first: {sum(right)} of {len(right)}"),
    ]
    notes.append(f"whole measurement in the allocation: {time.perf_counter() - started:.0f} s; "
                 f"left in Slurm after it: {left or 'nothing'}")
    return {"rows": rows, "notes": notes}
