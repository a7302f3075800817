"""Argument types shared by the sub-commands: their errors read as usage errors (exit 2)."""

from __future__ import annotations

import argparse

from nblaunch.contract.precision import parse_precision


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def at_least_one(text: str) -> int:
    """A whole number >= 1: ``--num-processes 2``."""
    return _whole_number(text, 1)


def at_least_zero(text: str) -> int:
    """A whole number >= 0: ``--node-rank 0``, ``--max-restarts 0``."""
    return _whole_number(text, 0)


def processes(text: str) -> int | None:
    """``--num-processes``: a whole number >= 1, or torchrun's ``gpu``/``auto`` (one per GPU:
    the default, None)."""
    if text in ("gpu", "auto"):
        return None
    if text == "cpu":
        raise argparse.ArgumentTypeError("one process per CPU core is not supported: give a number, e.g. 2")
    return _whole_number(text, 1)


def seconds(text: str) -> float:
    """A positive number of seconds: ``--timeout 600``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def precision(text: str) -> str:
    """``--mixed-precision``: the words ``notebook_launcher`` and the Accelerator take."""
    try:
        return parse_precision(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).replace("mixed_precision ", "", 1)) from None
