"""The step split of the launch or warm-rank call that ended last in this process.

A blocking ``notebook_launcher`` returns its ranks' results and nothing else; its report stays
here, for the next cell to read (``nblaunch.last_steps()``). A launch with ``block=False`` has its
own (``launch.steps``), and so do warm ranks (``ranks.steps``: their last call's).

Example::

    notebook_launcher(train, num_processes=2)
    steps = nblaunch.last_steps()
    steps.straggler, steps[1].data      # the rank that held the others up; its wait for data
"""

from __future__ import annotations

import threading

from nblaunch.step_split.launch_steps import LaunchSteps

_lock = threading.Lock()
_latest = [LaunchSteps()]


def remember(steps: LaunchSteps) -> None:
    """A launch or a call ended with ``steps`` (a launch with ``block=False`` ends on its own thread)."""
    with _lock:
        _latest[0] = steps


def last_steps() -> LaunchSteps:
    """The training steps of the launch (or warm-rank call) that ended last in this process,
    split into their parts; empty before any ended, or where none trained through nblaunch's
    Accelerator.

    Example::

        >>> notebook_launcher(train, num_processes=2, display="none")
        >>> print(nblaunch.last_steps())     # each rank's split, what the ranks buy, what to do
    """
    with _lock:
        return _latest[0]
