"""Command line: ``nblaunch demo`` (or ``python -m nblaunch demo``) trains the demo on several
processes and says how it went.

Exit status: 0 when the training ran, 1 when it failed (the failure is printed once, the details
are in the launch's log), 2 for a usage error, 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_DESCRIPTION = "nblaunch: start PyTorch training on several processes, from a notebook or a terminal."
_DEMO = ("Train a small CNN on scikit-learn's digits (shipped with scikit-learn: nothing is downloaded) "
         "on several processes, on the CPU when there is no GPU. Needs the examples extra: "
         "pip install 'nblaunch[examples]'.")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _program_name() -> str:
    # "python -m nblaunch" runs this file as __main__.py; the installed script is "nblaunch".
    return "python -m nblaunch" if os.path.basename(sys.argv[0]) == "__main__.py" else "nblaunch"


def build_parser() -> argparse.ArgumentParser:
    """The ``nblaunch`` command's arguments."""
    from nblaunch import __version__

    parser = argparse.ArgumentParser(prog=_program_name(), description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"nblaunch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo = commands.add_parser("demo", help="train a small CNN on scikit-learn's digits on several processes",
                               description=_DEMO)
    demo.add_argument("--num-processes", type=_at_least_one, default=2, metavar="N",
                      help="processes to train on (default: 2)")
    demo.add_argument("--epochs", type=_at_least_one, default=5, metavar="N",
                      help="passes over the training images (default: 5)")
    demo.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"],
                      help="train in lower precision (default: no)")
    demo.add_argument("--start-method", default=None, choices=["fork", "spawn"],
                      help="how the processes start (default: fork where it is safe, else spawn)")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        importlib.import_module("sklearn.datasets")  # here, once: the forked ranks inherit it
    except ImportError:
        print("nblaunch demo: the demo needs scikit-learn, which is not installed. "
              "Install it with: pip install 'nblaunch[examples]'", file=sys.stderr)
        return 1
    return _run_demo(options)


def _run_demo(options: argparse.Namespace) -> int:
    from nblaunch import notebook_launcher
    from nblaunch.demo import train_digits
    from nblaunch.launch.errors import LaunchConfigError, RankFailedError

    if options.num_processes == 1:  # runs in this process: no launch line from the launcher
        print("nblaunch: train_digits on 1 process, this one (nothing to start)")
    try:
        results = notebook_launcher(
            train_digits, args=(options.epochs,), num_processes=options.num_processes,
            mixed_precision=options.mixed_precision, start_method=options.start_method, display="text")
    except LaunchConfigError as error:  # e.g. more processes than GPUs
        print(f"nblaunch demo: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130  # the display has said what was stopped, and where the stacks are
    except RankFailedError as error:
        # The display printed each rank's first line; the root cause's traceback, once:
        failure = error.root_cause
        print(f"\n{failure.traceback or failure.reason}".rstrip(), file=sys.stderr)
        return 1
    first = results[0]
    accuracies = {r["test_accuracy"] for r in results}
    epochs = f"{options.epochs} epoch{'s' if options.epochs > 1 else ''}"
    print(f"test accuracy {first['test_accuracy']:.3f} after {epochs}; "
          f"training loss {first['losses'][0]:.3f} -> {first['losses'][-1]:.3f}")
    if len(results) > 1:
        if len(accuracies) > 1:
            print(f"the {len(results)} processes disagree on the test accuracy: {sorted(accuracies)}", file=sys.stderr)
            return 1
        print(f"all {len(results)} processes agree on the result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
