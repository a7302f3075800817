"""A launch from a terminal: its end as an exit status and at most a few lines on stderr.

Exit statuses: 0 every rank succeeded; 1 a rank failed (its traceback printed once, at the end);
2 bad input, before anything started; 124 ``--timeout`` ran out; 130 interrupted (Ctrl-C).

Example::

    results, status = launch_in_terminal("launch", run_script, ("train.py", [], False), num_processes=2)
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable

# Frames in nblaunch's own code only say how the script was started.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

__all__ = ["launch_in_terminal", "without_launch_frames", "FAILED", "USAGE", "TIMED_OUT", "INTERRUPTED"]

FAILED, USAGE, TIMED_OUT, INTERRUPTED = 1, 2, 124, 130


def launch_in_terminal(command: str, function: Callable, args: tuple, **options: Any) -> tuple[list | None, int]:
    """``notebook_launcher(function, args, display="text", **options)``; returns the results
    (None unless every rank succeeded) and the exit status. The text display has already shown
    each rank's lines and the launch's end; the root cause's traceback is printed once more."""
    from nblaunch import notebook_launcher
    from nblaunch.launch.errors import LaunchConfigError, LaunchTimeoutError, RankFailedError

    try:
        return notebook_launcher(function, args, display="text", **options), 0
    except LaunchConfigError as error:
        print(f"nblaunch {command}: {error}", file=sys.stderr)
        return None, USAGE
    except KeyboardInterrupt:
        return None, INTERRUPTED  # the display said what was stopped, and where the stacks are
    except LaunchTimeoutError:
        return None, TIMED_OUT
    except RankFailedError as error:
        failure = error.root_cause
        print(f"\nnblaunch {command}: rank {failure.rank} failed first; its traceback:\n"
              f"{without_launch_frames(failure.traceback or failure.reason).rstrip()}", file=sys.stderr)
        return None, FAILED
    except Exception as error:  # one process runs in this one: its own exception, as python would show it
        shown = "".join(traceback.format_exception(error))
        print(f"nblaunch {command}: the process failed; its traceback:\n{without_launch_frames(shown).rstrip()}",
              file=sys.stderr)
        return None, FAILED


def without_launch_frames(traceback: str) -> str:
    """The traceback without the frames that only say how the script was started (runpy's,
    nblaunch's own): it starts at the user's own code.

    Example::

        without_launch_frames('Traceback (most recent call last):\n  File "<frozen runpy>", line 88, in _run_code\n'
                              '  File "train.py", line 3, in <module>\n    boom()\nValueError: no')
        # 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n    boom()\nValueError: no'
    """
    kept, skipping = [], False
    for line in traceback.splitlines():
        if line.startswith('  File "'):
            skipping = line.startswith(('  File "<frozen runpy>"', f'  File "{_PACKAGE}'))
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)
