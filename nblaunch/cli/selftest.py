"""``nblaunch test``: is this machine ready? Ranks start, a process group forms, a collective
and a small DDP step agree across ranks, and the display shows every rank's lines.

Prints one line per check and exits 0, or names the first check that failed and what to look at.
"""

from __future__ import annotations

import argparse
import sys
import time

from nblaunch.cli.args import at_least_one
from nblaunch.cli.outcome import FAILED, launch_in_terminal


def add_parser(commands: argparse._SubParsersAction) -> None:
    test = commands.add_parser("test", help="check that this machine can run distributed training",
                               description="A short self-check: ranks start, a process group forms (gloo on "
                                           "the CPU, NCCL on GPUs), an all_reduce and one DDP step agree on "
                                           "every rank, and their output reaches this terminal.")
    test.add_argument("--num-processes", type=at_least_one, default=2, metavar="N",
                      help="processes to check with (default: 2)")
    test.add_argument("--cpu", action="store_true", help="check the CPU path even where there are GPUs")


def check_rank(cpu: bool) -> dict:
    """One rank's part: the group, a collective, one DDP step; returns what it saw."""
    # Deferred to the ranks: torch and the training side cost `nblaunch test --help` seconds.
    import torch
    import torch.distributed as dist

    from nblaunch import Accelerator

    started = time.perf_counter()
    accelerator = Accelerator(cpu=cpu)
    formed = time.perf_counter() - started
    rank, world = accelerator.process_index, accelerator.num_processes
    total = torch.tensor([float(rank + 1)], device=accelerator.device)
    dist.all_reduce(total)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.full((4, 8), float(rank + 1), device=accelerator.device)  # different data per rank
    accelerator.backward(model(x).sum())
    optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = accelerator.gather(weights.unsqueeze(0))
    print(f"rank {rank} of {world} on {accelerator.device}: ready", flush=True)
    return {"backend": dist.get_backend(), "device": str(accelerator.device), "formed_s": formed,
            "sum": total.item(), "expected_sum": world * (world + 1) / 2,
            "ddp_agree": bool((gathered - gathered[0]).abs().max() == 0)}


def run(options: argparse.Namespace) -> int:
    started = time.perf_counter()
    results, status = launch_in_terminal("test", check_rank, (options.cpu,), num_processes=options.num_processes)
    if results is None:
        print("nblaunch test: FAILED: the ranks did not get through the check (above: which rank, and where). "
              "A rank that hangs in forming the group points at the network: MASTER_ADDR, a firewall, or "
              "NCCL (NCCL_DEBUG=INFO says more).", file=sys.stderr)
        return status
    first = results[0]
    checks = [
        (f"{len(results)} ranks started and reported back", True),
        (f"a {first['backend']} process group formed on {first['device']} "
         f"(slowest rank: {max(r['formed_s'] for r in results) * 1000:.0f} ms)", True),
        ("all_reduce gave every rank the same, right sum",
         all(r["sum"] == r["expected_sum"] for r in results)),
        ("one DDP step left every rank with the same weights", all(r["ddp_agree"] for r in results)),
    ]
    for text, ok in checks:
        print(f"{'ok ' if ok else 'FAILED'}  {text}")
    if not all(ok for _, ok in checks):
        print("nblaunch test: FAILED: the ranks disagree; report it with the output of: nblaunch env",
              file=sys.stderr)
        return FAILED
    print(f"nblaunch test: this machine is ready ({time.perf_counter() - started:.1f} s)")
    return 0
