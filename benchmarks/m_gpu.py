"""10. On one CUDA GPU: the tutorial's loop re-run cell after cell, training steps/s, a launch from a
process that initialised CUDA, a failure.

(0) the tutorial's loop in a real kernel, launched four times 3 s apart (``gpu_tutorial``).

(a) steps/s of a small transformer (GPT-2 built from a config, nothing downloaded; bf16 autocast,
AdamW, batch 16 x 128 tokens), one rank on the GPU, measured inside the rank after warm-up steps:
nblaunch's ``notebook_launcher`` + Accelerator, hand-written DDP (``torch.multiprocessing`` fork,
NCCL, ``torch.autocast``), and Accelerate's ``notebook_launcher`` + Accelerator (with one GPU it
runs the function in the calling process: no rank is started).
(b) a launch from a process that already initialised CUDA (``torch.zeros(1, device="cuda")``, as a
notebook cell does): call to return of a function that uses the GPU in its rank, the process's
first launch and its second (a cell run again); nblaunch takes such ranks from its launch server
by itself (started by the first), raw torch must be told ``start_method="spawn"``; for reference
nblaunch from a process that never touched CUDA (fork).
(c) the failure path: the rank uses the GPU, then raises; seconds from its raise to the launcher's.
(d) fp8 against bf16, both compiled (part ``fp8``, when torchao is installed): ``gpu_fp8``.

Every sample runs in a fresh interpreter (a "carrier", as a notebook kernel would be), so no
implementation inherits another's CUDA state. Without a CUDA device the measurement says so and
measures nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks import gpu_fp8
from benchmarks import gpu_tutorial as tutorial
from benchmarks.common import free_port, have_accelerate, interleave, pair_ratios, row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("raw", "nblaunch", "accelerate")
CARRIER_LIMIT_S = 150
# tools/gpu_lane.sh gives the benchmark what is left of its 10 minutes: past this time (epoch
# seconds) the remaining samples are recorded as not taken, so the tables already measured are kept.
DEADLINE = float(os.environ.get("NBLAUNCH_BENCH_DEADLINE", "inf"))
LAUNCH_NOTES = {
    "raw": "CUDA initialised first; start_method='spawn' written by hand",
    "nblaunch": "CUDA initialised first; its ranks come from nblaunch's launch server (started by a first launch)",
    "accelerate": "CUDA initialised first; with one GPU it runs the function in the calling process, no rank",
    "nblaunch (fork, CUDA untouched)": "the calling process never touched CUDA: fork",
}


def no_cuda_reason() -> str | None:
    """Why nothing can be measured here, or None. Asked without initialising CUDA (NVML)."""
    import torch

    import nblaunch

    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is built without CUDA"
    if nblaunch.gpu_count() == 0:
        return "no CUDA device: NVML sees no NVIDIA GPU"
    return None


# ----------------------------------------------------------------------------- inside a rank
def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=4))


def train_steps(impl: str, warmup: int, steps: int, out: str | None = None) -> dict:
    """Build the model as a user of ``impl`` would, train, and time ``steps`` steps on the GPU."""
    import torch

    model = _model()
    config = model.config
    ids = torch.randint(0, config.vocab_size, ((warmup + steps) * 16, 128), generator=torch.Generator().manual_seed(0))
    dataset = torch.utils.data.TensorDataset(ids)
    if impl == "raw":
        import torch.distributed as dist

        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        model = torch.nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device.index])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False)
        loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)
        backward = torch.Tensor.backward

        def forward(batch):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(input_ids=batch.to(device, non_blocking=True), labels=batch.to(device)).loss
    else:
        Accelerator = (__import__("nblaunch", fromlist=["Accelerator"]) if impl == "nblaunch"
                       else __import__("accelerate", fromlist=["Accelerator"])).Accelerator
        accelerator = Accelerator(mixed_precision="bf16")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer, loader = accelerator.prepare(
            model, optimizer, torch.utils.data.DataLoader(dataset, batch_size=16))
        backward = accelerator.backward

        def forward(batch):
            return model(input_ids=batch, labels=batch).loss
    done, start = 0, None
    for (batch,) in loader:
        loss = forward(batch)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done += 1
        if done == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        if done == warmup + steps:
            break
    torch.cuda.synchronize()
    result = {"steps_per_s": steps / (time.perf_counter() - start), "loss": float(loss),
              "gpu": torch.cuda.get_device_name(0), "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
              "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in model.modules())}
    if out:
        with open(out, "w") as f:
            json.dump(result, f)
    return result


def on_the_gpu(out: str | None = None) -> float:
    import torch

    value = float(torch.ones(4, device="cuda").sum())
    if out:
        with open(out, "w") as f:
            f.write(repr(value))
    return value


def fail_on_the_gpu(stamp: str) -> None:
    import torch

    torch.ones(4, device="cuda").sum().item()
    with open(stamp, "w") as f:
        f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process here
    raise RuntimeError("the rank fails on purpose")


def _raw_entry(local_rank: int, port: int, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    fn(*args)


def _launch(impl: str, fn, args: tuple, start_method: str) -> None:
    """Start ``fn(*args)`` on one rank as a user of ``impl`` writes it."""
    if impl == "raw":
        import torch.multiprocessing as mp

        mp.start_processes(_raw_entry, args=(free_port(), fn, args), nprocs=1, start_method=start_method)
    elif impl == "nblaunch":
        from nblaunch import notebook_launcher

        notebook_launcher(fn, args=args, num_processes=1, display="none")  # it chooses fork or spawn
    else:
        from accelerate import notebook_launcher

        notebook_launcher(fn, args=args, num_processes=1, use_port=str(free_port()))


# ----------------------------------------------------------------------------- in a carrier
def carrier(job: str, impl: str, options: dict) -> dict:
    """What one fresh interpreter measures; prints one JSON line."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        if job == "train":
            import transformers  # noqa: F401  (imported before the call, as a notebook's first cell does)

            _launch(impl, train_steps, (impl, options["warmup"], options["steps"], out), "fork")
            with open(out) as f:
                return json.load(f)
        if job == "launch":  # a kernel's first launch, then its second (a cell run again)
            if options["cuda_first"]:
                torch.zeros(1, device="cuda")
            times = []
            for _ in range(2):
                started = time.perf_counter()
                _launch(impl, on_the_gpu, (out,), "spawn" if options["cuda_first"] else "fork")
                times.append(time.perf_counter() - started)
            return {"launch_s": times[0], "again_s": times[1], "ok": os.path.exists(out)}
        if job == "failure":
            error = None
            try:
                _launch(impl, fail_on_the_gpu, (out,), "fork")
            except BaseException as caught:  # noqa: BLE001  (each launcher raises its own type)
                error = caught
            raised = time.monotonic()
            with open(out) as f:
                failed_at = float(f.read())
            return {"raise_s": raised - failed_at, "raised": type(error).__name__ if error else None}
    raise ValueError(job)


def _carry(job: str, impl: str, **options) -> dict:
    if time.time() + 20 > DEADLINE:
        raise RuntimeError("not taken: the lane's time ran out")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.m_gpu", job, impl, json.dumps(options)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=CARRIER_LIMIT_S)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", f"timed out after {CARRIER_LIMIT_S} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the carrier's ranks too
        except ProcessLookupError:
            pass
        proc.wait()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{job} {impl}: no result ({stderr.strip()[-600:]})")
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------- the measurement
def run(quick: bool = False, size: str | None = None) -> dict:
    reason = no_cuda_reason()
    if reason:
        return {"rows": [], "notes": [f"nothing measured: {reason}"]}
    impls = [i for i in IMPLS if i != "accelerate" or have_accelerate()]
    rounds = 1 if quick or size == "tiny" else 2
    warmup, steps = (10, 40) if quick or size == "tiny" else (20, 100)
    launches = {i: (lambda i=i: _carry("launch", i, cuda_first=True)) for i in impls}
    launches["nblaunch (fork, CUDA untouched)"] = lambda: _carry("launch", "nblaunch", cuda_first=False)
    notes: list[str] = []
    wanted = set(filter(None, os.environ.get("NBLAUNCH_GPU_BENCH_PARTS", "tutorial,train,failure,launch").split(",")))
    # Issue 44's headline first, while the lane has time.
    tutorial_rows = tutorial.rows(DEADLINE, notes) if "tutorial" in wanted else []
    parts = {
        "train": {i: (lambda i=i: _carry("train", i, warmup=warmup, steps=steps)) for i in impls},
        "failure": {i: (lambda i=i: _carry("failure", i)) for i in impls},
        "launch": launches,
    }
    parts = {part: jobs for part, jobs in parts.items() if part in wanted}
    # Round by round across the three parts, so a lane short of time still has each part measured.
    res: dict[str, dict[str, list]] = {part: {name: [] for name in jobs} for part, jobs in parts.items()}
    for index in range(rounds):
        for part, jobs in parts.items():
            names = list(jobs)
            names = names[index % len(names):] + names[: index % len(names)]  # the order turns each round
            done = interleave(1, {name: jobs[name] for name in names})
            for name in names:
                res[part][name] += done[name]
            notes += [f"{part}, {name}: failed: {errors[0]}" for name, errors in done["_errors"].items()]
    rows = tutorial_rows + (_train_rows(res["train"], impls) if "train" in parts else [])
    rows += _failure_rows(res["failure"], impls) if "failure" in parts else []
    rows += gpu_fp8.rows(rounds) if "fp8" in wanted else []
    for key, which in (("launch_s", "a process's first"), ("again_s", "the second")):
        for impl in launches if "launch" in parts else ():
            values = [None if r is None or not r["ok"] else r[key] for r in res["launch"][impl]]
            raw = [None if r is None else r[key] for r in res["launch"]["raw"]]
            goal = "<= 1.0 s" if impl == "nblaunch" and key == "again_s" else None
            rows.append(row(impl, f"launch of one rank that uses the GPU, {which}: call -> return", "s", values,
                            ratios={"vs raw spawn": pair_ratios(values, raw)} if impl != "raw" else None, goal=goal,
                            met=(bool(values) and None not in values and max(values) <= 1.0) if goal else None,
                            note=LAUNCH_NOTES.get(impl)))
    gpus = {r["gpu"] for i in impls for r in res.get("train", {}).get(i, []) if r is not None}
    notes.append(f"GPU: {', '.join(sorted(gpus)) or '?'}; {rounds} round(s), each sample a fresh interpreter; "
                 f"training: {warmup} warm-up + {steps} timed steps, measured in the rank with CUDA synchronised")
    return {"rows": rows, "notes": notes}


def _train_rows(res: dict[str, list], impls: list[str]) -> list[dict]:
    sps = {i: [None if r is None else r["steps_per_s"] for r in res[i]] for i in impls}
    rows = []
    for impl in impls:
        ratios = {"vs raw": pair_ratios(sps[impl], sps["raw"])} if impl != "raw" else None
        met = None
        if impl == "nblaunch" and ratios["vs raw"]["median"] is not None:
            met = ratios["vs raw"]["median"] >= 0.98
        done = [r for r in res[impl] if r is not None]
        rows.append(row(impl, "GPT-2 (4 layers, 256 wide) bf16 steps/s, 1 GPU rank", "steps/s", sps[impl],
                        goal=">= 0.98x raw" if impl == "nblaunch" else None, met=met, ratios=ratios,
                        lower_is_better=False, note=f"peak {done[0]['peak_mib']:.0f} MiB" if done else None))
    return rows


def _failure_rows(res: dict[str, list], impls: list[str]) -> list[dict]:
    rows = []
    for impl in impls:
        values = [None if r is None else r["raise_s"] for r in res[impl]]
        raised = sorted({str(r["raised"]) for r in res[impl] if r})
        rows.append(row(impl, "the rank raises after using the GPU: raise -> launcher raises", "s", values,
                        goal="<= 0.1 s" if impl == "nblaunch" else None,
                        met=(bool(values) and None not in values and max(values) <= 0.1) if impl == "nblaunch" else None,
                        note="raised " + ", ".join(raised) if raised else None))
    return rows


if __name__ == "__main__" and len(sys.argv) == 4:
    # The module's own copy, not __main__'s: the ranks then find its functions by name.
    from benchmarks.m_gpu import carrier as _carrier

    print(json.dumps(_carrier(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))), flush=True)
