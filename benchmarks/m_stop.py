"""16. Stop and pick up again (issue 62): what an interrupt keeps, and what it costs.

A seeded one-pass DDP run on 2 ranks (a 256-2048-2048-10 MLP, 4.7M parameters, AdamW, batch 32
per rank, 120 steps, one intra-op thread per rank) is interrupted as Ctrl-C would: rank 0 sends
SIGINT to the launching script (a fresh interpreter) after step 30. For each launcher: the seconds
from the SIGINT to the call returning (nblaunch's include agreeing a step and saving there), the
steps the ranks had trained that no checkpoint keeps, the ranks alive 1 s after the call returned.
In the ranks: ``save_state`` and ``load_state`` of that run's state by hand (nblaunch's writes its
completeness record too), and the seconds a ``resume=True`` launch spends from its Accelerator to
the first batch in hand (the load happens there) against a fresh start's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.common import have_accelerate, interleave, pair_ratios, pid_alive, row, wait_gone
from benchmarks.workloads import IMPLS_ALL, make_data, make_mlp, run_launch
from nblaunch.proctree import kill_pids

STOP_AFTER = 30
STEPS = 120
BATCH = 32
HIDDEN = 2048


def _note(out_dir: str, name: str, value) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(value, f)


def _read(out_dir: str, name: str):
    try:
        with open(os.path.join(out_dir, name)) as f:
            return json.load(f)
    except (OSError, ValueError):  # not written yet, or cut short by the kill
        return None


def _parts(impl: str, project: str, hidden: int):
    """Model, optimizer, scheduler, loader and the Accelerator (None for raw), as a user of ``impl``
    writes them, with a project folder where the Accelerator saves."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)
    x, y = make_data(STEPS * BATCH * 2)
    dataset = TensorDataset(x, y)
    torch.manual_seed(0)
    model = make_mlp(hidden=hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.5)
    if impl == "raw":
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=True, seed=0))
        return model, optimizer, scheduler, loader, None
    if impl == "nblaunch":
        from nblaunch import Accelerator
        from nblaunch.utils import ProjectConfiguration
    else:
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True))
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    return model, optimizer, scheduler, loader, accelerator


def train(impl: str, out_dir: str, stop_after: int, hidden: int, most_steps: int = STEPS) -> dict:
    """In a rank: the one-pass loop. Each step's count goes to a file the driver reads; after
    ``stop_after`` steps rank 0 sends SIGINT to the driver. Returns the seconds from the start of
    setup to the first batch in hand (a resume loads there) and the steps trained."""
    import torch.nn.functional as F

    rank = int(os.environ["RANK"])
    _note(out_dir, f"pid{rank}", os.getpid())
    began = time.monotonic()
    model, optimizer, scheduler, loader, accelerator = _parts(impl, os.path.join(out_dir, "project"), hidden)
    counter = os.open(os.path.join(out_dir, f"steps{rank}"), os.O_WRONLY | os.O_CREAT)
    first_batch_s, steps = None, 0
    for inputs, targets in loader:
        if first_batch_s is None:
            first_batch_s = time.monotonic() - began
        loss = F.cross_entropy(model(inputs), targets)
        accelerator.backward(loss) if accelerator is not None else loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        steps += 1
        os.pwrite(counter, f"{steps:<8d}".encode(), 0)
        if steps == stop_after and rank == 0:
            _note(out_dir, "interrupted_at", time.monotonic())
            os.kill(_read(out_dir, "driver_pid"), signal.SIGINT)
        if steps == most_steps:
            break
    result = {"first_batch_s": first_batch_s, "steps": steps}
    if impl != "nblaunch":
        _note(out_dir, f"result{rank}", result)
    return result


def save_and_load(impl: str, out_dir: str, hidden: int) -> dict:
    """In a rank: 5 steps, then ``save_state`` and ``load_state`` of it by hand, each timed on rank 0."""
    import torch.nn.functional as F

    model, optimizer, scheduler, loader, accelerator = _parts(impl, os.path.join(out_dir, "project"), hidden)
    for step, (inputs, targets) in enumerate(loader):
        accelerator.backward(F.cross_entropy(model(inputs), targets))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step == 4:
            break
    accelerator.wait_for_everyone()
    began = time.monotonic()
    folder = accelerator.save_state()  # project/checkpoints/checkpoint_0, as both name it
    accelerator.wait_for_everyone()
    saved = time.monotonic()
    accelerator.load_state(folder)
    accelerator.wait_for_everyone()
    result = {"save_s": saved - began, "load_s": time.monotonic() - saved,
              "mb": sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20}
    if impl != "nblaunch" and accelerator.is_main_process:
        _note(out_dir, "result0", result)
    return result


def _driver(impl: str, out_dir: str, hidden: int) -> None:
    """The launching script: launch, take the SIGINT as a user's script would, say what was left."""
    _note(out_dir, "driver_pid", os.getpid())
    error = None
    try:
        run_launch(impl, train, (impl, out_dir, STOP_AFTER, hidden))
    except BaseException as caught:  # noqa: BLE001 - KeyboardInterrupt is what is measured
        error = caught
    returned = time.monotonic()
    trained = [_read(out_dir, f"steps{rank}") for rank in (0, 1)]
    kept = getattr(error, "kept", None)
    pids = [pid for pid in (_read(out_dir, "pid0"), _read(out_dir, "pid1")) if pid]
    alive = sum(pid_alive(pid) for pid in pids)
    _, left = wait_gone(pids, 1.0)
    kill_pids(left)
    _note(out_dir, "driver", {"returned": returned, "raised": type(error).__name__ if error else None,
                              "trained": trained, "kept": kept.steps if kept else 0,
                              "checkpoint": kept.checkpoint if kept else None,
                              "alive_at_return": alive, "alive_after_1s": len(left)})
    os._exit(0)  # raw's ranks are not daemons: the interpreter's exit would wait for them


def _interrupt_once(impl: str, out_dir: str, hidden: int) -> dict:
    driver = subprocess.Popen([sys.executable, "-m", "benchmarks.m_stop", "driver", impl, out_dir, str(hidden)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        driver.wait(timeout=180)
    finally:
        driver.kill()
        driver.wait()
        kill_pids([pid for pid in (_read(out_dir, "pid0"), _read(out_dir, "pid1")) if pid])
    said, sent = _read(out_dir, "driver"), _read(out_dir, "interrupted_at")
    if said is None or sent is None:
        raise RuntimeError(f"the {impl} run was not interrupted as planned (exit code {driver.returncode})")
    lost = max(steps or 0 for steps in said["trained"]) - said["kept"]
    return dict(said, latency_s=said["returned"] - sent, lost=lost)


def _in_ranks(impl: str, function, args: tuple, **options) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        results = run_launch(impl, function, (impl, out_dir, *args), **options)
        return results or [_read(out_dir, "result0")]


def _nblaunch_round(hidden: int) -> dict:
    """Interrupt nblaunch's run, then resume it in this process; a fresh start beside it."""
    with tempfile.TemporaryDirectory() as out_dir:
        stopped = _interrupt_once("nblaunch", out_dir, hidden)
        resumed = run_launch("nblaunch", train, ("nblaunch", out_dir, -1, hidden), resume=True)
        size = sum(os.path.getsize(os.path.join(top, name)) for top, _, names in os.walk(stopped["checkpoint"])
                   for name in names) / 2**20
    fresh = _in_ranks("nblaunch", train, (-1, hidden, 5))
    return dict(stopped, resumed_steps=resumed[0]["steps"], checkpoint_mb=size,
                resumed_first_batch_s=max(r["first_batch_s"] for r in resumed),
                fresh_first_batch_s=max(r["first_batch_s"] for r in fresh))


def _other_round(impl: str, hidden: int) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        return _interrupt_once(impl, out_dir, hidden)


def run(quick: bool = False, size: str | None = None) -> dict:
    impls = [i for i in IMPLS_ALL if i != "accelerate" or have_accelerate()]
    rounds = 1 if quick or size == "tiny" else 3
    hidden = 256 if size == "tiny" else HIDDEN
    _in_ranks("nblaunch", train, (-1, hidden, 2))  # this process's first launch pays its own start
    stops = interleave(rounds, {impl: (lambda impl=impl: _nblaunch_round(hidden) if impl == "nblaunch"
                                       else _other_round(impl, hidden)) for impl in impls})
    by_hand_impls = [i for i in impls if i != "raw"]
    by_hand = interleave(rounds + 2, {impl: (lambda impl=impl: _in_ranks(impl, save_and_load, (hidden,))[0])
                                  for impl in by_hand_impls})
    notes = [f"{label}, {impl}: {len(e)} failed: {e[0]}" for label, res in (("interrupt", stops), ("by hand", by_hand))
             for impl, e in res["_errors"].items()]
    rows = []
    for impl in impls:
        vals = [v for v in stops[impl] if v is not None]
        nb = impl == "nblaunch"
        rows.append(row(impl, f"SIGINT after step {STOP_AFTER} -> the call returns", "s", [v["latency_s"] for v in vals],
                        note=("agrees a step, saves there, says where" if nb else "saves nothing") +
                        "; raised: " + ", ".join(str(v["raised"]) for v in vals)))
        lost = [v["lost"] for v in vals]
        rows.append(row(impl, "steps trained that no checkpoint keeps", "", lost, goal="0" if nb else None,
                        met=(bool(lost) and max(lost) == 0) if nb else None,
                        note="trained / kept: " + ", ".join(f"{max(v['trained'])}/{v['kept']}" for v in vals)))
        left = [v["alive_after_1s"] for v in vals]
        rows.append(row(impl, "ranks alive 1 s after the call returned", "", left, goal="0" if nb else None,
                        met=(bool(left) and max(left) == 0) if nb else None,
                        note="alive when it returned: " + ", ".join(str(v["alive_at_return"]) for v in vals)))
        if nb and vals:
            rows.append(row(impl, "resume=True: Accelerator -> first batch in hand (the load included)", "s",
                            [v["resumed_first_batch_s"] for v in vals],
                            ratios={"vs a fresh start": pair_ratios([v["resumed_first_batch_s"] for v in vals],
                                                                    [v["fresh_first_batch_s"] for v in vals])},
                            note="steps kept + steps the resumed launch ran: " + ", ".join(
                                f"{v['kept']} + {v['resumed_steps']}" for v in vals) + f" (of {STEPS}); checkpoint "
                            f"{vals[0]['checkpoint_mb']:.0f} MiB"))
            rows.append(row(impl, "a fresh start: Accelerator -> first batch in hand", "s",
                            [v["fresh_first_batch_s"] for v in vals]))
    for impl in by_hand_impls:
        vals = [v for v in by_hand[impl] if v is not None]

        def against_accelerate(key: str) -> dict | None:  # the i-th rounds of both, paired
            if impl != "nblaunch" or "accelerate" not in by_hand:
                return None
            return {"vs Accelerate": pair_ratios([v and v[key] for v in by_hand[impl]],
                                                 [v and v[key] for v in by_hand["accelerate"]])}

        rows.append(row(impl, "save_state by hand (rank 0, both ranks done)", "s", [v["save_s"] for v in vals],
                        ratios=against_accelerate("save_s"), note=f"{vals[0]['mb']:.0f} MiB" if vals else None))
        rows.append(row(impl, "load_state by hand", "s", [v["load_s"] for v in vals],
                        ratios=against_accelerate("load_s")))
    notes.append(f"{rounds} interleaved rounds ({rounds + 2} by hand: a save's time is the page cache's); a 256-{hidden}-{hidden}-10 MLP, AdamW, StepLR, 2 ranks, batch {BATCH} "
                 f"each, {STEPS} steps; latency from rank 0's CLOCK_MONOTONIC before its os.kill to the driver's "
                 "return from the call; raw torch and Accelerate are interrupted in the same loop, which saves nothing")
    return {"rows": rows, "notes": notes}


if __name__ == "__main__" and sys.argv[1] == "driver":
    _driver(sys.argv[2], sys.argv[3], int(sys.argv[4]))
