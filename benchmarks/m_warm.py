"""7. Warm ranks: a call on ranks kept up between calls, against starting them per call.

The work is one all_reduce on 2 ranks. nblaunch warm: ``WarmRanks.run`` on a pool whose group
an earlier call made. The others start ranks and form a group for each call, as a launcher must:
a fresh nblaunch launch, raw ``torch.multiprocessing`` fork + rendezvous, Accelerate's
``notebook_launcher``. Memory: a warm rank's resident memory after 200 calls against a fresh
rank's, both right after the same all_reduce. Big arguments: a call that sums a 200 MB tensor
passed to it (memfds mapped copy-on-write; the launchers that start ranks per call fork them,
so the tensor is already in their memory).
"""

from __future__ import annotations

import time

from benchmarks.common import have_accelerate, interleave, pair_ratios, row
from benchmarks.workloads import all_reduce_once, group_and_all_reduce, rss_mb_after_all_reduce, run_launch, sum_of

GOAL_WARM_MS = 10.0
GOAL_RSS_MB = 5.0  # "within a few MB of a fresh rank"
BIG_ARGUMENT_MB = 200


def run(quick: bool = False, size: str | None = None) -> dict:
    from nblaunch import WarmRanks, notebook_launcher

    rounds = 5 if quick else 20
    warm_calls = 50 if quick else 200
    impls = ["raw", "nblaunch launch"] + (["accelerate"] if have_accelerate() else [])
    rows, notes = [], []
    # Before any big tensor exists here: a forked rank's RSS counts the pages it inherits.
    fresh_rss = notebook_launcher(rss_mb_after_all_reduce, num_processes=2, display="none")
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
        big = _big_argument_samples(ranks, 3 if quick else 7)

    ms = lambda values: [None if v is None else 1000 * v for v in values]  # noqa: E731
    for impl, errs in [*samples["_errors"].items(), *big["_errors"].items()]:
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
    big_warm = ms(big["nblaunch warm"])
    per_call_big = ["nblaunch launch", "nblaunch spawn launch"]
    rows.append(row("nblaunch warm", f"call: sum a {BIG_ARGUMENT_MB} MB tensor argument on 2 ranks", "ms", big_warm,
                    ratios={f"vs {impl}": pair_ratios(big_warm, ms(big[impl])) for impl in per_call_big}))
    for impl in per_call_big:
        rows.append(row(impl, f"start ranks, sum a {BIG_ARGUMENT_MB} MB tensor argument", "ms", ms(big[impl])))
    notes.append("big argument: raw torch.multiprocessing (fork) and Accelerate's notebook_launcher are not timed: "
                 "their ranks deadlock in the first parallel op (libgomp after fork; the parent used OpenMP "
                 "threads making the tensor; nblaunch forks from a thread that never ran OpenMP). Before warm calls sent big "
                 "arguments by memfd they were pickled into the frame: 1.94 s for this call (fork pool, 5 calls)")
    extra = [w - f for w, f in zip(sorted(warm_rss), sorted(fresh_rss))]
    rows.append(row("nblaunch warm", f"rank RSS after {warm_calls + rounds + 2} calls minus a fresh rank's", "MB", extra,
                    goal=f"<= {GOAL_RSS_MB:g} MB", met=max(extra) <= GOAL_RSS_MB))
    notes.append(f"{rounds} interleaved rounds after one discarded start each, then {warm_calls} warm calls in a row; "
                 f"RSS: warm {', '.join(f'{v:.1f}' for v in warm_rss)} MB, fresh {', '.join(f'{v:.1f}' for v in fresh_rss)} MB")
    return {"rows": rows, "notes": notes}


def _big_argument_samples(ranks, rounds: int) -> dict:
    import torch

    tensor = torch.ones(BIG_ARGUMENT_MB * 2**20 // 4)

    def timed(call):
        def one():
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0
        return one

    # Only nblaunch starts ranks per call here: raw torch.multiprocessing fork and Accelerate's
    # notebook_launcher deadlock in the ranks' first parallel op (libgomp after a fork of a
    # process that has used OpenMP threads, as making this tensor did); see the notes.
    return interleave(rounds, {
        "nblaunch warm": timed(lambda: ranks.run(sum_of, tensor)),
        "nblaunch launch": timed(lambda: run_launch("nblaunch", sum_of, (tensor,))),
        "nblaunch spawn launch": timed(lambda: run_launch("nblaunch", sum_of, (tensor,), start_method="spawn")),
    })
