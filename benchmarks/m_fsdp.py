"""9. A model sharded over 2 ranks (FSDP2, DeepSpeed ZeRO-3) against the same model replicated (DDP).

Every implementation trains the same transformer (width 384, 6 layers: about 10.7M parameters,
43 MB in fp32) with AdamW on 2 forked CPU ranks, gloo, for a few steps, and reports per rank:

- what the rank holds of the parameters and the optimizer state (bytes of its tensors: exact);
- its peak resident memory over the training, and its resident memory after the last step, above
  what it had when the function started (each rank builds the whole model before sharding it);
- the median time of a training step after the first two.

Implementations: nblaunch's ``Accelerator`` with DDP (no plugin) and with
``FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")``; raw torch
(``fully_shard`` on each layer and the root, by hand, ranks from ``torch.multiprocessing``);
Accelerate's ``Accelerator(fsdp_plugin=...)`` with ``fsdp_version=2`` under its
``notebook_launcher`` (when installed). Beside FSDP's rows, ZeRO-3 (when DeepSpeed is installed):
nblaunch's ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))`` and DeepSpeed's own
API (``deepspeed.initialize``, ``engine.backward``/``engine.step``) in ranks from
``torch.multiprocessing``. Accelerate's DeepSpeed path does not run on CPU ranks (with
``ACCELERATE_USE_CPU`` it drops the plugin and trains DDP), so it has no row.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import time

from benchmarks.common import free_port, have_accelerate, interleave, pair_ratios, row

WIDTH, LAYERS, STEPS = 384, 6, 8


def _model():
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(WIDTH, 6, 4 * WIDTH, dropout=0.0, batch_first=True)
              for _ in range(LAYERS)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 16))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _held(model, optimizer) -> int:
    """Bytes of the parameters (a DTensor's local shard, a ZeRO-3 partition) and optimizer state
    (of the torch optimizer inside a prepared one and inside DeepSpeed's) this rank keeps."""
    import torch

    def size(t):
        t = t.ds_tensor if hasattr(t, "ds_tensor") else t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(size(p) for p in getattr(model, "module", model).parameters()) + sum(size(v) for v in states)


ZERO3 = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
         "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def _loop(model, optimizer, backward, start_rss: int) -> dict:
    import torch

    x = torch.randn(8, 64, WIDTH, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"held": _held(model, optimizer), "peak": max(0, peak - start_rss), "after": _rss() - start_rss,
            "step": sorted(times[2:])[len(times[2:]) // 2]}


def nblaunch_rank(shard: bool) -> dict:
    import torch

    from nblaunch import Accelerator
    from nblaunch.utils import FullyShardedDataParallelPlugin

    start = _rss()
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["TransformerEncoderLayer"]) if shard else None
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    return _loop(model, optimizer, accelerator.backward, start)


def nblaunch_zero3_rank() -> dict:
    import deepspeed  # noqa: F401  (before the start is read, as DeepSpeed's own rank does: its import is not the training's)
    import torch

    from nblaunch import Accelerator
    from nblaunch.utils import DeepSpeedPlugin

    start = _rss()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(ZERO3)))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    return _loop(model, optimizer, accelerator.backward, start)


def _deepspeed_rank(rank: int, port: int, out: str) -> None:
    import json

    import deepspeed
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    start = _rss()
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=dict(ZERO3))

    class Stepper:  # the loop's optimizer.step()/zero_grad(): the engine's step, which also zeroes
        optimizer = engine.optimizer

        @staticmethod
        def step():
            engine.step()

        @staticmethod
        def zero_grad():
            pass

    result = _loop(engine, Stepper, engine.backward, start)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def deepspeed_launch() -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_deepspeed_rank, args=(free_port(), out), nprocs=2, start_method="spawn")
        return _read_results(out)


def accelerate_rank(out: str) -> None:
    """Accelerate's notebook_launcher returns nothing: each rank writes its result to a file."""
    import json

    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    start = _rss()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["TransformerEncoderLayer"])
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    result = _loop(model, optimizer, accelerator.backward, start)
    with open(f"{out}.{accelerator.process_index}", "w") as f:
        json.dump(result, f)


def _read_results(out: str) -> list[dict]:
    import json

    results = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            results.append(json.load(f))
    return results


def accelerate_launch() -> list[dict]:
    import tempfile

    from accelerate import notebook_launcher

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        notebook_launcher(accelerate_rank, (out,), num_processes=2)
        return _read_results(out)


def _raw_rank(rank: int, port: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    start = _rss()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = _model()
    for layer in model[:LAYERS]:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    result = _loop(model, optimizer, lambda loss: loss.backward(), start)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def raw_launch() -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_raw_rank, args=(free_port(), out), nprocs=2, start_method="fork")
        return _read_results(out)


def run(quick: bool = False, size: str | None = None) -> dict:
    from nblaunch import notebook_launcher

    rounds = 2 if quick else 3
    impls = {
        "nblaunch DDP": lambda: notebook_launcher(nblaunch_rank, (False,), num_processes=2, display="none"),
        "nblaunch FSDP": lambda: notebook_launcher(nblaunch_rank, (True,), num_processes=2, display="none"),
        "raw torch FSDP2": raw_launch,
    }
    if have_accelerate():
        impls["Accelerate FSDP2"] = accelerate_launch
    if importlib.util.find_spec("deepspeed") is not None:
        impls["nblaunch ZeRO-3"] = lambda: notebook_launcher(nblaunch_zero3_rank, num_processes=2, display="none")
        impls["DeepSpeed ZeRO-3 (own API)"] = deepspeed_launch
    samples = interleave(rounds, impls)
    notes = [f"{impl}: {len(errs)} failed: {errs[0]}" for impl, errs in samples.pop("_errors").items()]

    def per_rank(impl: str, key: str) -> list:
        return [r[key] for results in samples[impl] if results for r in results]

    rows = []
    ddp_held = per_rank("nblaunch DDP", "held")
    for impl in impls:
        held = per_rank(impl, "held")
        if not held:
            continue
        ratio = {"vs nblaunch DDP": pair_ratios(held, ddp_held)} if impl != "nblaunch DDP" else None
        met = None
        goal = None
        if impl in ("nblaunch FSDP", "nblaunch ZeRO-3"):
            goal, met = "about half of DDP's", all(0.4 < h / d < 0.6 for h, d in zip(held, ddp_held))
        rows.append(row(impl, "parameters + optimizer state a rank holds", "MB",
                        [h / 1e6 for h in held], ratios=ratio, goal=goal, met=met))
    ddp_peak = per_rank("nblaunch DDP", "peak")
    for impl in impls:
        peak = per_rank(impl, "peak")
        if peak:
            rows.append(row(impl, "a rank's peak resident memory above its start", "MB", [p / 1e6 for p in peak],
                            ratios={"vs nblaunch DDP": pair_ratios(peak, ddp_peak)} if impl != "nblaunch DDP" else None))
    ddp_after = per_rank("nblaunch DDP", "after")
    for impl in impls:
        after = per_rank(impl, "after")
        if after:
            rows.append(row(impl, "a rank's resident memory after the steps, above its start", "MB",
                            [a / 1e6 for a in after],
                            ratios={"vs nblaunch DDP": pair_ratios(after, ddp_after)} if impl != "nblaunch DDP" else None))
    raw_step = per_rank("raw torch FSDP2", "step")
    for impl in impls:
        step = per_rank(impl, "step")
        if step:
            rows.append(row(impl, "a training step, median after 2", "ms", [s * 1e3 for s in step],
                            ratios={"vs raw torch FSDP2": pair_ratios(step, raw_step)} if impl != "raw torch FSDP2" else None))
    return {"rows": rows, "notes": notes}
