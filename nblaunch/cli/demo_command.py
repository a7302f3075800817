"""``nblaunch demo``: train a small CNN on scikit-learn's digits on several processes and say
how it went."""

from __future__ import annotations

import argparse
import importlib
import sys

from nblaunch.cli.args import at_least_one
from nblaunch.cli.outcome import FAILED, launch_in_terminal

_DESCRIPTION = ("Train a small CNN on scikit-learn's digits (shipped with scikit-learn: nothing is downloaded) "
                "on one process per GPU, or on 2 CPU processes where there is no GPU (or with --cpu). Needs the examples extra: "
                "pip install 'nblaunch[examples]'.")


def add_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="train a small CNN on scikit-learn's digits on several processes",
                               description=_DESCRIPTION)
    demo.add_argument("--num-processes", type=at_least_one, default=None, metavar="N",
                      help="processes to train on (default: one per GPU, or 2 on the CPU where there is none)")
    demo.add_argument("--cpu", action="store_true",
                      help="train on the CPU even where there are GPUs, on as many processes as --num-processes asks "
                           "(default: on the GPUs, where there are any)")
    demo.add_argument("--epochs", type=at_least_one, default=5, metavar="N",
                      help="passes over the training images (default: 5)")
    demo.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"],
                      help="train in lower precision (default: no)")
    demo.add_argument("--resume", action="store_true",
                      help="go on where Ctrl-C stopped the last demo, from the checkpoint it saved (default: from the start)")
    demo.add_argument("--start-method", default=None, choices=["fork", "spawn"],
                      help="how the processes start (default: fork where it is safe, else spawn)")


def run(options: argparse.Namespace) -> int:
    try:
        importlib.import_module("sklearn.datasets")  # here, once: the forked ranks inherit it
    except ImportError:
        print("nblaunch demo: the demo needs scikit-learn, which is not installed. "
              "Install it with: pip install 'nblaunch[examples]'", file=sys.stderr)
        return FAILED
    from nblaunch.demo import train_digits  # deferred: imports torch, which `nblaunch demo --help` needs not

    results, status = launch_in_terminal(
        "demo", train_digits, (options.epochs,), num_processes=options.num_processes,
        mixed_precision=options.mixed_precision, start_method=options.start_method, cpu=options.cpu,
        resume=options.resume)
    if results is None:
        return status
    first = results[0]
    accuracies = {r["test_accuracy"] for r in results}
    epochs = f"{options.epochs} epoch{'s' if options.epochs > 1 else ''}"
    losses = first["losses"]  # a resumed demo's: the steps it took
    print(f"test accuracy {first['test_accuracy']:.3f} after {epochs}"
          + (f"; training loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""))
    if len(results) > 1:
        if len(accuracies) > 1:
            print(f"the {len(results)} processes disagree on the test accuracy: {sorted(accuracies)}", file=sys.stderr)
            return FAILED
        print(f"all {len(results)} processes agree on the result")
    return 0
