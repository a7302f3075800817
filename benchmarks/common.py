"""Helpers shared by the measurements: statistics, rows, ports, process memory, interleaving."""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Callable, Iterable


def free_port() -> int:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summary(samples: Iterable[float]) -> dict[str, Any]:
    values = [float(v) for v in samples if v is not None]
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def pair_ratios(a: list[float | None], b: list[float | None]) -> dict[str, Any]:
    """Per-pair ratios a[i]/b[i] (the i-th rounds of an interleaved run) and their summary."""
    ratios = [x / y for x, y in zip(a, b) if x is not None and y not in (None, 0)]
    return summary(ratios)


def row(impl: str, metric: str, unit: str, samples: list, *, goal: str | None = None, met: bool | None = None,
        ratios: dict[str, dict] | None = None, note: str | None = None, lower_is_better: bool = True) -> dict:
    """One line of a result table. ``samples`` are kept so the JSON can be re-analysed."""
    out = {"impl": impl, "metric": metric, "unit": unit, **summary(samples), "samples": [
        round(s, 6) if isinstance(s, float) else s for s in samples]}
    out["lower_is_better"] = lower_is_better
    if ratios:
        out["ratios"] = ratios
    if goal is not None:
        out["goal"] = goal
        out["met"] = met
    if note:
        out["note"] = note
    return out


def interleave(rounds: int, impls: dict[str, Callable[[], Any]], on_error: str = "record") -> dict[str, list]:
    """Run each implementation once per round, in a rotating order (A B C, B C A, ...), so drift
    of the machine (thermal, page cache, other load) hits every implementation alike.
    Returns {impl: [result or None per round]}; errors become None and are kept in ``errors``."""
    names = list(impls)
    results: dict[str, list] = {name: [] for name in names}
    errors: dict[str, list[str]] = {}
    for i in range(rounds):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            try:
                results[name].append(impls[name]())
            except Exception as error:  # one failing implementation must not poison the others
                if on_error == "raise":
                    raise
                results[name].append(None)
                errors.setdefault(name, []).append(f"{type(error).__name__}: {str(error)[:300]}")
    results["_errors"] = errors  # type: ignore[assignment]
    return results


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Bytes: rss, pss, uss (private clean + dirty), swap; Linux only."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {
        "rss": fields.get("Rss", 0),
        "pss": fields.get("Pss", 0),
        "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        "swap": fields.get("Swap", 0),
    }


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def wait_gone(pids: list[int], budget: float) -> tuple[float | None, list[int]]:
    """Seconds until every pid is gone (None if not within ``budget``) and those still alive."""
    start = time.monotonic()
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return time.monotonic() - start, []
        if time.monotonic() - start > budget:
            return None, alive
        time.sleep(0.002)




def have_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
        return True
    except Exception:
        return False
