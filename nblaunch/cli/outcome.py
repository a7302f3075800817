"""A launch from a terminal: its end as an exit status and at most a few lines on stderr.

Exit statuses: 0 every rank succeeded; 1 a rank failed (its traceback printed once, at the end);
2 bad input, before anything started; 124 ``--timeout`` ran out; 130 interrupted (Ctrl-C).

Example::

    results, status = launch_in_terminal("launch", Script("train.py", ["--lr", "3e-4"]), (), num_processes=2)
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from nblaunch.api import notebook_launcher
from nblaunch.launch.errors import LaunchConfigError, LaunchTimeoutError, RankFailedError

__all__ = ["launch_in_terminal", "outcome_in_terminal", "FAILED", "USAGE", "TIMED_OUT", "INTERRUPTED"]

FAILED, USAGE, TIMED_OUT, INTERRUPTED = 1, 2, 124, 130


def launch_in_terminal(command: str, function: Callable, args: tuple, **options: Any) -> tuple[list | None, int]:
    """``notebook_launcher(function, args, display="text", **options)``; returns the results
    (None unless every rank succeeded) and the exit status. The text display has already shown
    each rank's lines and the launch's end; the root cause's traceback is printed once more."""
    return outcome_in_terminal(command, lambda: notebook_launcher(function, args, display="text", **options))


def outcome_in_terminal(command: str, results: Callable[[], list]) -> tuple[list | None, int]:
    """``results()`` (a launch's, or a detached launch's ``result``) and the exit status for it."""
    try:
        return results(), 0
    except LaunchConfigError as error:
        print(f"nblaunch {command}: {error}", file=sys.stderr)
        return None, USAGE
    except KeyboardInterrupt:
        return None, INTERRUPTED  # the display said what was stopped, and where the stacks are
    except LaunchTimeoutError:
        return None, TIMED_OUT
    except RankFailedError as error:
        failure = error.root_cause
        # "first" where another rank failed on its own; a peer's lost connection is no rival (and
        # whether it arrived before that peer was stopped is a matter of milliseconds).
        first = " first" if any(not f.collateral for f in error.failures[1:]) else ""
        print(f"\nnblaunch {command}: rank {failure.rank} failed{first}; its traceback:\n"
              f"{(failure.traceback or failure.reason).rstrip()}", file=sys.stderr)
        return None, FAILED
