"""5. Failure teardown.

(a) rank 1 raises, (b) rank 1 is SIGKILLed, while rank 0 waits in an all_reduce: seconds from
the failure to the launcher raising, whether the error names rank 1, workers alive when the
launcher raised and 1 s later. (c) the launching process is SIGKILLed while both workers wait
in a recv nobody answers: seconds until both workers are gone, workers alive 1 s later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.common import have_accelerate, interleave, pid_alive, row, wait_gone
from benchmarks.workloads import IMPLS_ALL, fail_in_collective, run_launch, stuck_in_recv
from nblaunch.proctree import kill_pids

GOAL_S = 0.1


def _pids(tmp: str) -> list[int]:
    pids = []
    for rank in (0, 1):
        try:
            with open(os.path.join(tmp, f"pid{rank}")) as f:
                pids.append(int(f.read()))
        except (OSError, ValueError):
            pass
    return pids


def _stacks(pids: list[int]) -> str:
    """The workers' Python stacks (py-spy, if installed), to say where a hung launch was."""
    out = []
    for pid in pids:
        try:
            spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
            dump = subprocess.run([spy if os.path.exists(spy) else "py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=15)
            out.append(f"pid {pid}:\n{dump.stdout[-3000:]}{dump.stderr[-500:]}")
        except Exception as error:  # noqa: BLE001
            out.append(f"pid {pid}: no stack ({error})")
    return "\n".join(out)


def _blamed(impl: str, error: BaseException) -> int | None:
    if impl == "nblaunch":
        return getattr(getattr(error, "root_cause", None), "rank", None)
    if impl == "raw":
        return getattr(error, "error_index", None)
    first = getattr(error, "get_first_failure", None)  # torch elastic's ChildFailedError
    if first is not None:
        return first()[0]
    return None


HANG_S = 20.0  # a launcher that has not raised by then is recorded as hung; its workers are killed


def _fail_once(impl: str, mode: str) -> dict:
    import threading

    with tempfile.TemporaryDirectory() as tmp:
        error = None
        done = threading.Event()
        hung = []

        def watchdog():
            if not done.wait(HANG_S):
                hung.append(_stacks(_pids(tmp)))  # the evidence, before unblocking the run
                kill_pids(_pids(tmp))

        threading.Thread(target=watchdog, daemon=True).start()
        try:
            run_launch(impl, fail_in_collective, (mode, tmp))
        except BaseException as e:  # noqa: BLE001
            error = e
        raised = time.monotonic()
        done.set()
        if hung:
            return {"latency_s": None, "right_rank": False, "blamed": "hung", "left_at_raise": 2,
                    "left_after_1s": 2, "raised": None, "hung": True, "stacks": hung[0]}
        pids = _pids(tmp)
        left_at_raise = sum(pid_alive(p) for p in pids)
        with open(os.path.join(tmp, "failed_at")) as f:
            failed_at = float(f.read())
        gone_s, left = wait_gone(pids, 1.0)
        kill_pids(left)
        return {"latency_s": raised - failed_at, "right_rank": error is not None and _blamed(impl, error) == 1,
                "blamed": None if error is None else _blamed(impl, error), "left_at_raise": left_at_raise,
                "left_after_1s": len(left), "raised": type(error).__name__ if error else None}


def _orphan_once(impl: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        driver = subprocess.Popen([sys.executable, "-m", "benchmarks.m_failure", "driver", impl, tmp],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        deadline = time.monotonic() + 90
        while len(_pids(tmp)) < 2 and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.01)
        pids = _pids(tmp)
        if len(pids) < 2:
            driver.kill()
            driver.wait()
            raise RuntimeError("the workers did not reach the recv")
        time.sleep(0.2)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        gone_s, left = wait_gone(pids, 1.0)
        kill_pids(left)
        return {"gone_s": gone_s, "left_after_1s": len(left)}


def run(quick: bool = False, size: str | None = None) -> dict:
    impls = [i for i in IMPLS_ALL if i != "accelerate" or have_accelerate()]
    rounds = 2 if quick or size == "tiny" else 4
    orphan_rounds = 1 if quick or size == "tiny" else 2
    rows, notes = [], []
    for mode, label in (("raise", "rank 1 raises"), ("kill", "rank 1 SIGKILLed")):
        res = interleave(rounds, {impl: (lambda impl=impl: _fail_once(impl, mode)) for impl in impls})
        notes += [f"{label}, {impl}: {len(e)} failed: {e[0]}" for impl, e in res["_errors"].items()]
        for impl in impls:
            vals = [v for v in res[impl] if v is not None]
            nb = impl == "nblaunch"
            lat = [v["latency_s"] for v in vals]
            hangs = sum(1 for v in vals if v.get("hung"))
            rows.append(row(impl, f"{label}: failure -> launcher raises", "s", lat, goal=f"<= {GOAL_S} s" if nb else None,
                            met=(bool(lat) and None not in lat and max(lat) <= GOAL_S) if nb else None,
                            note=f"hung (no raise within {HANG_S:g} s) {hangs} of {len(vals)} times" if hangs else None))
            right = [1.0 if v["right_rank"] else 0.0 for v in vals]
            rows.append(row(impl, f"{label}: right rank blamed (fraction)", "", right,
                            goal="every time" if nb else None, met=(bool(right) and min(right) == 1.0) if nb else None,
                            note="blamed: " + ", ".join(str(v["blamed"]) for v in vals), lower_is_better=False))
            left = [v["left_after_1s"] for v in vals]
            rows.append(row(impl, f"{label}: workers alive 1 s after the raise", "", left,
                            goal="0" if nb else None, met=(bool(left) and max(left) == 0) if nb else None,
                            note="alive at the raise: " + ", ".join(str(v["left_at_raise"]) for v in vals)))
        for impl in impls:
            for v in res[impl]:
                if v is not None and v.get("stacks"):
                    notes.append(f"{label}, {impl} hung; workers' stacks:\n{v['stacks']}")
    res = interleave(orphan_rounds, {impl: (lambda impl=impl: _orphan_once(impl)) for impl in impls})
    notes += [f"parent killed, {impl}: {len(e)} failed: {e[0]}" for impl, e in res["_errors"].items()]
    for impl in impls:
        vals = [v for v in res[impl] if v is not None]
        nb = impl == "nblaunch"
        left = [v["left_after_1s"] for v in vals]
        rows.append(row(impl, "launcher SIGKILLed, ranks in recv: workers alive after 1 s", "", left,
                        goal="0 within 1 s" if nb else None, met=(bool(left) and max(left) == 0) if nb else None,
                        note="gone after (s): " + ", ".join("never" if v["gone_s"] is None else f"{v['gone_s']:.3f}" for v in vals)))
    notes.append(f"{rounds} interleaved rounds per failure mode, {orphan_rounds} per implementation for the killed launcher; "
                 "latency is from rank 1's last timestamp before the failure (CLOCK_MONOTONIC) to the raise in the launcher")
    return {"rows": rows, "notes": notes}


if __name__ == "__main__" and sys.argv[1] == "driver":
    impl, tmp = sys.argv[2], sys.argv[3]
    run_launch(impl, stuck_in_recv, (tmp,))
