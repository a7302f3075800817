"""Command line: ``python -m nblaunch demo`` trains the demo on several processes."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nblaunch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small CNN on scikit-learn's digits on several processes")
    demo.add_argument("--num-processes", type=int, default=2)
    demo.add_argument("--epochs", type=int, default=5)
    demo.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    demo.add_argument("--start-method", default=None, choices=["fork", "spawn"])
    options = parser.parse_args(argv)

    from nblaunch import notebook_launcher
    from nblaunch.demo import train_digits

    results = notebook_launcher(
        train_digits,
        args=(options.epochs,),
        num_processes=options.num_processes,
        mixed_precision=options.mixed_precision,
        start_method=options.start_method,
        display="text",
    )
    accuracy = results[0]["test_accuracy"]
    first, last = results[0]["losses"][0], results[0]["losses"][-1]
    print(f"test accuracy {accuracy:.3f}; loss {first:.3f} -> {last:.3f}; {len(results)} ranks agree: "
          f"{len({r['test_accuracy'] for r in results}) == 1}")
    return 0 if accuracy > 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
