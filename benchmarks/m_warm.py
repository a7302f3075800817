"""7. Warm ranks: a call on ranks kept up between calls, against starting them per call.

The work is one all_reduce on 2 ranks. nblaunch warm: ``WarmRanks.run`` on a pool whose group
an earlier call made. The others start ranks and form a group for each call, as a launcher must:
a fresh nblaunch launch, raw ``torch.multiprocessing`` fork + rendezvous, Accelerate's
``notebook_launcher``. Memory: a warm rank's resident memory after 200 calls against a fresh
rank's, both right after the same all_reduce.
"""

from __future__ import annotations

import time

from benchmarks.common import have_accelerate, interleave, pair_ratios, row
from benchmarks.workloads import all_reduce_once, group_and_all_reduce, rss_mb_after_all_reduce, run_launch

GOAL_WARM_MS = 10.0
GOAL_RSS_MB = 5.0  # "within a few MB of a fresh rank"


def run(quick: bool = False, size: str | None = None) -> dict:
    from nblaunch import WarmRanks, notebook_launcher

    rounds = 5 if quick else 20
    warm_calls = 50 if quick else 200
    impls = ["raw", "nblaunch launch"] + (["accelerate"] if have_accelerate() else [])
    rows, notes = [], []
    with WarmRanks(num_processes=2, display="none") as ranks:
        ranks.run(all_reduce_once)  # the pool starts and the group forms: not part of a warm call

        def warm_call():
            t0 = time.perf_counter()
            ranks.run(all_reduce_once)
            return time.perf_counter() - t0

        def per_call(impl):
            def one():
                t0 = time.perf_counter()
                run_launch("nblaunch" if impl == "nblaunch launch" else impl, group_and_all_reduce)
                return time.perf_counter() - t0
            return one

        for impl in impls:  # one discarded start each
            per_call(impl)()
        samples = interleave(rounds, {"nblaunch warm": warm_call, **{i: per_call(i) for i in impls}})
        # The warm call's own distribution, over many calls in a row.
        many = [warm_call() for _ in range(warm_calls)]
        warm_rss = ranks.run(rss_mb_after_all_reduce)
    fresh_rss = notebook_launcher(rss_mb_after_all_reduce, num_processes=2, display="none")

    ms = lambda values: [None if v is None else 1000 * v for v in values]  # noqa: E731
    for impl, errs in samples["_errors"].items():
        notes.append(f"{impl}: {len(errs)} failed: {errs[0]}")
    warm_ms = ms(samples["nblaunch warm"])
    ratios = {f"vs {impl}": pair_ratios(warm_ms, ms(samples[impl])) for impl in impls}
    median_many = sorted(ms(many))[len(many) // 2]
    rows.append(row("nblaunch warm", "call: one all_reduce on 2 ranks (interleaved rounds)", "ms", warm_ms,
                    goal=f"<= {GOAL_WARM_MS:g} ms", met=median_many <= GOAL_WARM_MS, ratios=ratios))
    rows.append(row("nblaunch warm", f"call: one all_reduce on 2 ranks ({warm_calls} calls in a row)", "ms", ms(many),
                    goal=f"<= {GOAL_WARM_MS:g} ms", met=median_many <= GOAL_WARM_MS))
    for impl in impls:
        rows.append(row(impl, "start ranks, form the group, one all_reduce", "ms", ms(samples[impl])))
    extra = [w - f for w, f in zip(sorted(warm_rss), sorted(fresh_rss))]
    rows.append(row("nblaunch warm", f"rank RSS after {warm_calls + rounds + 2} calls minus a fresh rank's", "MB", extra,
                    goal=f"<= {GOAL_RSS_MB:g} MB", met=max(extra) <= GOAL_RSS_MB))
    notes.append(f"{rounds} interleaved rounds after one discarded start each, then {warm_calls} warm calls in a row; "
                 f"RSS: warm {', '.join(f'{v:.1f}' for v in warm_rss)} MB, fresh {', '.join(f'{v:.1f}' for v in fresh_rss)} MB")
    return {"rows": rows, "notes": notes}
