"""6. Output: many lines per rank through the launcher, against raw torch and Accelerate.

Variants: display="text" with the launcher's stdout going to a file (the lines are counted
there), display="none" (lines counted in the on-disk logs), the same detached (``detach=True``:
every event also journaled on disk, the supervisor's start counted), the widget display built with
show=False when it exists, the same prints to /dev/null in the workers, and side by side the
same function under raw ``torch.multiprocessing`` (fork) and Accelerate's ``notebook_launcher``,
whose ranks print into the same kind of file (their stdout is the launcher's).
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import time

from benchmarks.common import have_accelerate, interleave, pair_ratios, row
from benchmarks.workloads import chatty, run_launch

GOAL_RATIO = 1.2  # against the same prints discarded
GOAL_RATIO_RAW = 1.5  # display="text" against raw torch printing to the same kind of file


def _private_tmp() -> None:
    """Log folders in a temporary directory of this measurement's own: other launches on the
    machine (a test run beside us) share /tmp/nblaunch-<uid>/logs and prune it to 20 folders."""
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="nblaunch-bench-")
    tempfile.tempdir = None


def _count_logs(since: float) -> int:
    root = os.path.join(tempfile.gettempdir(), f"nblaunch-{os.getuid()}", "logs")
    dirs = [d for d in glob.glob(os.path.join(root, "*")) if os.path.getmtime(d) >= since - 1]
    newest = max(dirs, key=os.path.getctime)
    count = 0
    for path in glob.glob(os.path.join(newest, "rank*.log")):
        with open(path, "rb") as f:
            count += sum(1 for line in f if b" of the output benchmark" in line)
    return count


def _widget_display():
    try:
        from nblaunch.display.widget import WidgetDisplay
    except Exception:
        return None
    try:
        return WidgetDisplay(show=False)
    except Exception:
        return None


def _one(variant: str, lines: int) -> dict:
    from nblaunch import notebook_launcher

    if variant in ("raw", "accelerate"):
        return _theirs(variant, lines)
    if variant == "detached":
        return _detached(lines)
    if variant == "detached_silent":  # the supervisor's start and the collection alone
        return dict(_detached(0), lost=0)

    display = {"discarded": "none", "text": "text", "none": "none"}.get(variant)
    if variant == "widget":
        display = _widget_display()
    saved = sys.stdout
    with tempfile.NamedTemporaryFile("w+", suffix=".out", delete=True) as out:
        if variant == "text":
            sys.stdout = out
        since = time.time()
        t0 = time.perf_counter()
        try:
            notebook_launcher(chatty, args=(lines, variant == "discarded"), num_processes=2, display=display)
        finally:
            sys.stdout = saved
        elapsed = time.perf_counter() - t0
        if variant == "text":
            out.flush()
            out.seek(0)
            seen = sum(1 for line in out if line.startswith("[rank ") and " of the output benchmark" in line)
        elif variant == "discarded":
            seen = 2 * lines
        else:
            seen = _count_logs(since)
    return {"s": elapsed, "lost": 2 * lines - seen}


def _detached(lines: int) -> dict:
    """detach=True: a supervisor started outside this process runs the launch and journals every
    event; timed from the call to the results in hand (the supervisor's start included)."""
    from nblaunch import notebook_launcher

    t0 = time.perf_counter()
    launch = notebook_launcher(chatty, args=(lines, False), num_processes=2, display="none", detach=True)
    launch.result()
    elapsed = time.perf_counter() - t0
    seen = 0
    for rank in (0, 1):
        seen += sum(1 for line in launch.logs(rank).splitlines() if " of the output benchmark" in line)
    return {"s": elapsed, "lost": 2 * lines - seen}


def _median(values: list) -> float | None:
    kept = sorted(v for v in values if v is not None)
    return kept[len(kept) // 2] if kept else None


def _theirs(impl: str, lines: int) -> dict:
    """Raw torch or Accelerate: the ranks inherit the launcher's stdout, a file here."""
    saved = sys.stdout
    with tempfile.NamedTemporaryFile("w+", suffix=".out", delete=True) as out:
        sys.stdout = out
        t0 = time.perf_counter()
        try:
            run_launch(impl, chatty, (lines, False))
        finally:
            sys.stdout = saved
        elapsed = time.perf_counter() - t0
        out.flush()
        out.seek(0)
        seen = sum(1 for line in out if " of the output benchmark" in line)
    return {"s": elapsed, "lost": 2 * lines - seen}


def run(quick: bool = False, size: str | None = None) -> dict:
    _private_tmp()
    os.environ["NBLAUNCH_STATE_DIR"] = os.path.join(tempfile.gettempdir(), "state")  # detached launches' own
    lines = {"tiny": 2000}.get(size or "", 20000 if quick else 100000)
    rounds = 1 if size == "tiny" else (2 if quick else 3)
    variants = ["discarded", "text", "none", "detached", "detached_silent", "raw"]
    if _widget_display() is not None:
        variants.append("widget")
    if have_accelerate():
        variants.append("accelerate")
    for v in variants:  # one discarded run each
        _one(v, min(lines, 2000))
    res = interleave(rounds, {v: (lambda v=v: _one(v, lines)) for v in variants})
    rows, notes = [], [f"{v}: {len(e)} failed: {e[0]}" for v, e in res["_errors"].items()]
    secs = {v: [None if r is None else r["s"] for r in res[v]] for v in variants}
    names = {"discarded": "nblaunch, prints to /dev/null in the workers", "text": 'nblaunch display="text" (stdout to a file)',
             "none": 'nblaunch display="none"', "widget": "nblaunch WidgetDisplay(show=False)",
             "detached": 'nblaunch detach=True, display="none" (journaled; supervisor start included)',
             "detached_silent": "nblaunch detach=True, no lines (the supervisor's start and collection alone)",
             "raw": "raw torch.multiprocessing fork (stdout to a file)",
             "accelerate": "Accelerate notebook_launcher (stdout to a file)"}
    for v in variants:
        ratios, goal, met = None, None, None
        lost = [x["lost"] for x in res[v] if x is not None]
        if v.startswith(("text", "none", "widget")):
            ratios = {"vs discarded": pair_ratios(secs[v], secs["discarded"]),
                      "vs raw": pair_ratios(secs[v], secs["raw"])}
            if v == "text":
                r = ratios["vs raw"]["median"]
                goal = f"<= {GOAL_RATIO_RAW}x raw, 0 lost"
            else:
                r = ratios["vs discarded"]["median"]
                goal = f"<= {GOAL_RATIO}x discarded, 0 lost"
            met = r is not None and r <= (GOAL_RATIO_RAW if v == "text" else GOAL_RATIO) and bool(lost) and max(lost) == 0
        elif v == "accelerate":
            ratios = {"vs raw": pair_ratios(secs[v], secs["raw"])}
        elif v == "detached":
            ratios = {"vs attached": pair_ratios(secs[v], secs["none"]), "vs raw": pair_ratios(secs[v], secs["raw"])}
        what = "no lines, wall time" if v == "detached_silent" else f"{lines} lines per rank, wall time"
        rows.append(row(names[v], what, "s", secs[v], goal=goal, met=met, ratios=ratios))
        if v not in ("discarded", "detached_silent"):
            rows.append(row(names[v], "lines lost", "", [None if r is None else r["lost"] for r in res[v]]))
    notes.append(f"2 ranks x {lines} lines; {rounds} interleaved round(s) after one short discarded launch each")
    detached, silent, attached = (_median(secs[v]) for v in ("detached", "detached_silent", "none"))
    if None not in (detached, silent, attached):
        notes.append(f"the journal's cost: detach=True minus its start ({detached - silent:.3f} s) against attached "
                     f"({attached:.3f} s) for the same lines: {(detached - silent) / attached:.2f}x")
    return {"rows": rows, "notes": notes}
