"""``nblaunch ls``, ``nblaunch attach [ID]`` and ``nblaunch stop ID``: this user's detached
launches (``notebook_launcher(..., detach=True)``) from a terminal.

``attach`` shows a launch as text (what it printed so far, then live) and ends with it, with the
exit status ``nblaunch launch`` would give; Ctrl-C stops watching and leaves the launch running.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from nblaunch.cli.outcome import FAILED, INTERRUPTED, outcome_in_terminal
from nblaunch.api import attach, find, launches
from nblaunch.detached.detached_launch import LaunchLostError

__all__ = ["LIST", "ATTACH", "STOP"]


@dataclass(frozen=True)
class _Command:
    """One sub-command: its parser and what it runs (the interface cli/ modules have)."""

    add_parser: Callable[[argparse._SubParsersAction], None]
    run: Callable[[argparse.Namespace], int]


def _add_list(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("ls", help="list your detached launches and warm ranks",
                        description="This user's detached launches and detached warm ranks on this machine: "
                                    "id, state, start, function, ranks, log folder.")


def _list(options: argparse.Namespace) -> int:
    print(repr(launches()))
    return 0


def _add_attach(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("attach", help="watch a detached launch (Ctrl-C stops watching, not the launch)",
                                 description="Show a detached launch as text, what it printed so far and then "
                                             "live, until it ends. Ctrl-C stops watching; the launch goes on.")
    parser.add_argument("launch_id", nargs="?", default=None, metavar="ID",
                        help="the launch (a unique start of its id); default: the latest")


def _attach(options: argparse.Namespace) -> int:
    launch = None
    try:
        launch = attach(options.launch_id, display="none")  # found first: Ctrl-C from here on detaches
        launch.watch("text")
        _, status = outcome_in_terminal("attach", launch.result)
    except LookupError as error:
        print(f"nblaunch attach: {error}", file=sys.stderr)
        return FAILED
    except LaunchLostError as error:
        print(f"nblaunch attach: {error}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:  # Ctrl-C before the watching had begun
        status = INTERRUPTED
    if status == INTERRUPTED:
        if launch is None:
            return INTERRUPTED
        launch.detach()
        print(f"nblaunch: stopped watching; launch {launch.launch_id} goes on ({launch.status}). "
              f"nblaunch attach {launch.launch_id} shows it again, nblaunch stop {launch.launch_id} stops it.",
              file=sys.stderr)
        return 0
    return status


def _add_stop(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("stop", help="stop a detached launch or detached warm ranks",
                                 description="Stop every rank of a detached launch (their stacks go to their "
                                             "logs), or close detached warm ranks.")
    parser.add_argument("launch_id", metavar="ID", help="the launch (a unique start of its id)")


def _stop(options: argparse.Namespace) -> int:
    try:
        launch = find(options.launch_id, kinds=("launch", "pool"))
    except LookupError as error:
        print(f"nblaunch stop: {error}", file=sys.stderr)
        return FAILED
    if launch.cancel():
        print(f"nblaunch: stopping launch {launch.launch_id}")
        return 0
    print(f"nblaunch stop: launch {launch.launch_id} has already ended ({launch.status})", file=sys.stderr)
    return FAILED


LIST = _Command(_add_list, _list)
ATTACH = _Command(_add_attach, _attach)
STOP = _Command(_add_stop, _stop)
