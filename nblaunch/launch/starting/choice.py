"""The :class:`~nblaunch.launch.starting.base.Starter` for each start method a plan names
(``planning/plan.start_method_for`` decides which, and says why).

Example::

    starter = starter_for(plan_here(request))   # plan.start_method "fork": a ForkStarter
"""

from __future__ import annotations

from typing import Callable

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting.base import Starter
from nblaunch.launch.starting.fork import ForkStarter
from nblaunch.launch.starting.server_starter import ServerStarter
from nblaunch.launch.starting.spawn import SpawnStarter


def _xla_host_starter() -> Starter:
    # Deferred: TPU hosts only; it loads the XLA host's worker code, which no other launch needs.
    from nblaunch.launch.starting.xla_host import XlaHostStarter

    return XlaHostStarter()


STARTERS: dict[str, Callable[[], Starter]] = {
    "fork": ForkStarter,  # forked from this process
    "server": ServerStarter,  # forked by the launch server (Linux)
    "spawn": SpawnStarter,  # a fresh interpreter each (elsewhere)
    "xla": _xla_host_starter,
}


def starter_for(plan: LaunchPlan) -> Starter:
    """The starter of ``plan``'s ranks."""
    return STARTERS[plan.start_method]()
