"""fp8 that pays off (issue 54), part ``fp8`` of ``benchmarks gpu``: a 4-layer MLP 4096 wide,
batch 4096, AdamW, one GPU rank, compiled (Inductor) in every column: nblaunch bf16
(``dynamo_backend="inductor"``), nblaunch fp8 (``mixed_precision="fp8"``, which compiles by
itself on a GPU with fp8 units), Accelerate bf16 and fp8 with its ``dynamo_backend="inductor"``.
Steps/s over 30 steps after 10, measured in the rank with CUDA synchronised; the compile time of
the first step (first step - a later one); and nblaunch fp8 launched a second time in the same
interpreter, whose compile reads the first launch's cache (goal: <= 25% of the first's).

Accelerate's fp8 is given ``Float8LinearConfig(enable_fsdp_float8_all_gather=False)``: its
default config gives the converted layers new Parameters and its AO path leaves an optimizer made
before ``prepare`` on the old ones (without FSDP its fp8 layers do not train; nblaunch points the
optimizer at them, docs/accelerator.md).
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
WIDTH, BATCH, LAYERS = 4096, 4096, 4
WARMUP, STEPS = 10, 30
GOAL_SPEEDUP = 1.15
GOAL_SECOND_COMPILE = 0.25
JOBS = {"nblaunch bf16": ("nblaunch", "bf16"), "nblaunch fp8": ("nblaunch", "fp8"),
        "accelerate bf16": ("accelerate", "bf16"), "accelerate fp8": ("accelerate", "fp8")}


def mlp_steps(impl: str, precision: str, out: str) -> None:
    """One rank: build, prepare, compile (on the first step), time; the result goes to ``out``."""
    import torch

    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS - 1) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if impl == "nblaunch":
        from nblaunch import Accelerator
        from nblaunch.utils import AORecipeKwargs
        handlers = [AORecipeKwargs()] if precision == "fp8" else []
        # fp8 compiles by itself; bf16 is told to, so both columns are compiled
        accelerator = Accelerator(mixed_precision=precision, kwargs_handlers=handlers,
                                  dynamo_backend=None if precision == "fp8" else "inductor")
    else:
        from accelerate import Accelerator
        from accelerate.utils import AORecipeKwargs
        from torchao.float8 import Float8LinearConfig
        handlers = [AORecipeKwargs(config=Float8LinearConfig(enable_fsdp_float8_all_gather=False))] \
            if precision == "fp8" else []
        accelerator = Accelerator(mixed_precision=precision, kwargs_handlers=handlers, dynamo_backend="inductor")
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator).to(accelerator.device)
    y = torch.randint(0, 16, (BATCH,), generator=generator).to(accelerator.device)
    took, start = [], None
    for step in range(WARMUP + STEPS):
        began = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - began)
        if step + 1 == WARMUP:
            start = time.perf_counter()
    result = {"steps_per_s": STEPS / (time.perf_counter() - start), "compile_s": took[0] - took[-1],
              "loss": float(loss), "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
              "gpu": torch.cuda.get_device_name(0)}
    with open(out, "w") as f:
        json.dump(result, f)


def sample(name: str, launches: int = 1) -> list[dict]:
    """``launches`` launches of one job in a fresh interpreter, with a fresh compile cache."""
    impl, precision = JOBS[name]
    with tempfile.TemporaryDirectory() as scratch:
        outs = [os.path.join(scratch, f"r{i}.json") for i in range(launches)]
        code = (f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom benchmarks.gpu_fp8 import mlp_steps\n"
                "from benchmarks.workloads import run_launch\n"
                + "".join(f"run_launch({impl!r}, mlp_steps, ({impl!r}, {precision!r}, {out!r}), nprocs=1)\n"
                          for out in outs))
        env = dict(os.environ)  # a fresh cache: nblaunch's folder, torch's own for Accelerate
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        env["NBLAUNCH_COMPILE_CACHE" if impl == "nblaunch" else "TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "cache")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
        if done.returncode:
            raise RuntimeError(done.stderr[-800:])
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
        return results


def rows(rounds: int) -> list[dict]:
    """The part's rows, ``rounds`` samples of each job, interleaved."""
    names = [n for n in JOBS if n.startswith("nblaunch") or have_accelerate()]
    done = interleave(rounds, {n: (lambda n=n: sample(n, 2 if n == "nblaunch fp8" else 1)) for n in names})
    sps = {n: [s[0]["steps_per_s"] if s else None for s in done[n]] for n in names}
    out = []
    for name in names:
        firsts = [s[0] for s in done[name] if s]
        base = "nblaunch bf16" if name.startswith("nblaunch") else "accelerate bf16"
        ratios = {f"vs {base}": pair_ratios(sps[name], sps[base])} if name.endswith("fp8") and base in sps else None
        goal = met = None
        if name == "nblaunch fp8" and ratios and ratios[f"vs {base}"]["median"] is not None:
            goal, met = f">= {GOAL_SPEEDUP}x nblaunch bf16", ratios[f"vs {base}"]["min"] >= GOAL_SPEEDUP
        note = (f"{firsts[0]['float8_layers']} Float8Linear, loss {firsts[0]['loss']:.3f}, {firsts[0]['gpu']}"
                if firsts else None)
        out.append(row(name, f"MLP ({LAYERS} x {WIDTH}, batch {BATCH}) compiled steps/s, 1 GPU rank", "steps/s",
                       sps[name], ratios=ratios, goal=goal, met=met, lower_is_better=False, note=note))
        out.append(row(name, "compile time of the first step", "s", [f["compile_s"] for f in firsts]))
        if name == "nblaunch fp8":
            share = [s[1]["compile_s"] / s[0]["compile_s"] for s in done[name] if s and s[0]["compile_s"] > 0]
            out.append(row(name, "second launch's compile time / the first's", "x", share,
                           goal=f"<= {GOAL_SECOND_COMPILE:.0%}", met=bool(share) and max(share) <= GOAL_SECOND_COMPILE))
    return out
