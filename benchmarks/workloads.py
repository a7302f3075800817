"""Functions the workers run. Module-level, so every launcher (fork, spawn, elastic) can send them."""

from __future__ import annotations

import os
import time

IMPLS_ALL = ("raw", "nblaunch", "accelerate")


# ----------------------------------------------------------------------------- 1. launch latency
def rendezvous() -> int:
    """The trivial function: join the group (env://), one barrier, leave."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def make_an_accelerator(impl: str) -> int:
    """What a training function does first: make its library's Accelerator (it joins the group);
    raw torch joins the group itself, as its users' code does."""
    if impl == "raw":
        return rendezvous()
    if impl == "nblaunch":
        from nblaunch import Accelerator
    else:
        from accelerate import Accelerator
    return Accelerator(cpu=True).process_index


def raw_entry(local_rank: int, port: int, world: int, fn, args: tuple, out_dir: str | None) -> None:
    """What a user writes for torch.multiprocessing: set the rendezvous variables, then run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    result = fn(*args)
    if out_dir is not None:
        write_result(out_dir, local_rank, result)


def write_result(out_dir: str, rank: int, value) -> None:
    import json

    tmp = os.path.join(out_dir, f".r{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(out_dir, f"r{rank}.json"))


def read_results(out_dir: str, world: int) -> list:
    import json

    values = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"r{rank}.json")) as f:
            values.append(json.load(f))
    return values


def run_launch(impl: str, fn, args: tuple = (), nprocs: int = 2, **nblaunch_kwargs) -> list | None:
    """Launch ``fn(*args)`` on ``nprocs`` processes the way a user of ``impl`` would.
    nblaunch returns results; raw and Accelerate return nothing (results travel by files).
    ``start_method="spawn"`` starts raw's processes by spawn too."""
    if impl == "raw":
        import torch.multiprocessing as mp
        from benchmarks.common import free_port

        method = nblaunch_kwargs.get("start_method") or "fork"
        mp.start_processes(raw_entry, args=(free_port(), nprocs, fn, args, None), nprocs=nprocs, start_method=method)
        return None
    if impl == "nblaunch":
        from nblaunch import notebook_launcher

        nblaunch_kwargs.setdefault("display", "none")
        return notebook_launcher(fn, args=args, num_processes=nprocs, **nblaunch_kwargs)
    if impl == "accelerate":
        from accelerate import notebook_launcher as acc_launcher
        from benchmarks.common import free_port

        acc_launcher(fn, args=args, num_processes=nprocs, use_port=str(free_port()))
        return None
    raise ValueError(impl)


# ----------------------------------------------------------------------------- training
def make_mlp(width_in: int = 256, hidden: int = 512, classes: int = 10):
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(width_in, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


def make_data(samples: int, width_in: int = 256, classes: int = 10, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, width_in, generator=g), torch.randint(0, classes, (samples,), generator=g)


def setup_training(impl: str, x, y, batch: int, precision: str = "no", optimizer: str = "sgd"):
    """Build model, optimizer and loader as a user of ``impl`` would. Returns a dict of parts
    with ``backward(loss)`` and ``autocast()`` that behave like the implementation's own."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    dataset = TensorDataset(x, y)
    model = make_mlp(x.shape[1])
    opt_cls = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
               "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}[optimizer]
    if impl == "raw":
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer_ = opt_cls(model.parameters())
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
        if precision == "bf16":
            autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        else:
            autocast = contextlib.nullcontext
        return dict(model=model, optimizer=optimizer_, loader=loader, sampler=sampler,
                    backward=lambda loss: loss.backward(), autocast=autocast)
    if impl == "nblaunch":
        from nblaunch.training import Accelerator
    elif impl == "accelerate":
        from accelerate import Accelerator
    else:
        raise ValueError(impl)
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    optimizer_ = opt_cls(model.parameters())
    loader = DataLoader(dataset, batch_size=batch, shuffle=True)
    model, optimizer_, loader = accelerator.prepare(model, optimizer_, loader)
    # Accelerate's prepared model runs its forward under autocast itself; so does nblaunch's.
    return dict(model=model, optimizer=optimizer_, loader=loader, sampler=None, accelerator=accelerator,
                backward=accelerator.backward, autocast=contextlib.nullcontext)


def first_step(impl: str, t_call: float, x, y, out_dir: str | None = None):
    """Seconds from the launcher call (wall clock) to the end of the first optimizer step here."""
    import torch.nn.functional as F

    parts = setup_training(impl, x, y, batch=64, optimizer="adamw")
    xb, yb = next(iter(parts["loader"]))
    with parts["autocast"]():
        loss = F.cross_entropy(parts["model"](xb), yb)
    parts["backward"](loss)
    parts["optimizer"].step()
    parts["optimizer"].zero_grad()
    elapsed = time.time() - t_call
    rank = int(os.environ["RANK"])
    if out_dir is not None:
        write_result(out_dir, rank, elapsed)
    return elapsed


def raw_first_step(local_rank: int, port: int, world: int, t_call: float, x, y, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    first_step("raw", t_call, x, y, out_dir)


def train_phases(impl: str, x, y, batch: int, precision: str, warmup: int, steps: int, threads: int,
                 out_dir: str | None = None) -> dict:
    """Steps timed phase by phase inside the worker: data, forward, backward, optimizer."""
    import torch
    import torch.nn.functional as F

    parts = setup_training(impl, x, y, batch=batch, precision=precision)
    # After the setup: Accelerate's state sets its own thread count (2 per rank); the per-step
    # overhead is compared with the same threads everywhere.
    torch.set_num_threads(threads)
    model, optimizer, loader, backward, autocast = (parts[k] for k in ("model", "optimizer", "loader", "backward", "autocast"))
    clock = time.perf_counter
    phases = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    epoch, done, counted = 0, 0, 0
    t_start = None
    while counted < steps:
        if parts["sampler"] is not None:
            parts["sampler"].set_epoch(epoch)
        elif hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        iterator = iter(loader)
        while counted < steps:
            t0 = clock()
            try:
                xb, yb = next(iterator)
            except StopIteration:
                break
            t1 = clock()
            with autocast():
                loss = F.cross_entropy(model(xb), yb)
            t2 = clock()
            backward(loss)
            t3 = clock()
            optimizer.step()
            optimizer.zero_grad()
            t4 = clock()
            done += 1
            if done == warmup:
                t_start = clock()
            if done > warmup:
                counted += 1
                phases["data"] += t1 - t0
                phases["forward"] += t2 - t1
                phases["backward"] += t3 - t2
                phases["optimizer"] += t4 - t3
        epoch += 1
    total = clock() - t_start
    result = {"steps": counted, "steps_per_s": counted / total,
              "phase_ms": {k: 1000 * v / counted for k, v in phases.items()}, "loss": float(loss.detach())}
    if out_dir is not None:
        write_result(out_dir, int(os.environ["RANK"]), result)
    return result


def loader_rate(impl: str, n: int, batch: int, epochs: int, out_dir: str | None = None) -> dict:
    """Batches/s of the prepared loader over a trivial data set (no model): this rank's own rate,
    and its batches with the (monotonic, machine-wide) clock at a common start line and at its end,
    from which the caller computes the job's rate (every rank's batches over the time until the
    last rank is done)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)
    dataset = TensorDataset(torch.arange(n, dtype=torch.float32))
    if impl in ("raw", "raw_synced"):  # raw_synced: raw with a barrier where a prepared loader syncs
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    else:
        Accelerator = __import__("nblaunch.training" if impl == "nblaunch" else "accelerate", fromlist=["Accelerator"]).Accelerator
        accelerator = Accelerator(cpu=True)
        sampler = None
        loader = accelerator.prepare(DataLoader(dataset, batch_size=batch, shuffle=True))
    torch.set_num_threads(1)
    batches = 0
    for epoch in range(epochs + 1):  # epoch 0 warms up
        if epoch == 1:
            dist.barrier()  # the common start line (not timed)
            t0 = time.monotonic()
        if impl == "raw_synced":
            dist.barrier()
        if sampler is not None:
            sampler.set_epoch(epoch)
        elif hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for _ in loader:
            if epoch >= 1:
                batches += 1
    t_end = time.monotonic()
    result = {"batches_per_s": batches / (t_end - t0), "batches": batches, "start": t0, "end": t_end}
    if out_dir is not None:
        write_result(out_dir, int(os.environ["RANK"]), result)
    return result


def raw_wrap(local_rank: int, port: int, world: int, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    fn(*args)


# ----------------------------------------------------------------------------- 4. memory
def touch_shard(data, t_call: float, out_dir: str | None = None) -> dict:
    """Read this rank's half of the parent's data set, then report this process's memory."""
    t_start = time.time()
    from benchmarks.common import smaps_rollup

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n = data.shape[0]
    lo, hi = rank * n // world, (rank + 1) * n // world
    total = 0.0
    step = max(1, (1 << 22) // max(1, data[0].numel()))
    for i in range(lo, hi, step):
        total += float(data[i:min(hi, i + step)].sum())
    result = {"start_s": t_start - t_call, "sum": total, **smaps_rollup()}
    if out_dir is not None:
        write_result(out_dir, rank, result)
    return result


# ----------------------------------------------------------------------------- 5. failures
def fail_in_collective(mode: str, out_dir: str) -> None:
    """Rank 1 raises (or is SIGKILLed) while rank 0 waits in an all_reduce."""
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    if rank == 1:
        time.sleep(0.2)  # rank 0 is in the all_reduce by now
        with open(os.path.join(out_dir, "failed_at"), "w") as f:
            f.write(repr(time.monotonic()))
        if mode == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))
    time.sleep(30)  # never reached in a working launcher's teardown


def stuck_in_recv(out_dir: str) -> None:
    """Both ranks wait in a C++ recv that nobody answers."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    with open(os.path.join(out_dir, f".pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out_dir, f".pid{rank}"), os.path.join(out_dir, f"pid{rank}"))
    dist.recv(torch.zeros(1), src=1 - rank)


# ----------------------------------------------------------------------------- 6. output
def chatty(lines: int, discard: bool) -> int:
    import sys

    if discard:  # the baseline: the same prints, to a line-buffered /dev/null
        sys.stdout = open(os.devnull, "w", buffering=1)
    rank = os.environ["RANK"]
    for i in range(lines):
        print(f"rank {rank} line {i} of the output benchmark, some words to make it typical")
    sys.stdout.flush()
    return lines


# ----------------------------------------------------------------------------- 7. warm ranks
def all_reduce_once() -> float:
    """The warm call: one all_reduce on the group earlier calls made."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    return float(tensor[0])


def group_and_all_reduce() -> float:
    """The same work for a launcher that starts ranks per call: rendezvous, one all_reduce, leave."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    dist.destroy_process_group()
    return float(tensor[0])


def rss_mb_after_all_reduce() -> float:
    """This rank's resident memory, in MB, once it has done one all_reduce in a group."""
    all_reduce_once()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sum_of(tensor) -> float:
    """A call that reads every byte of a big argument."""
    return float(tensor.sum())
