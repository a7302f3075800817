"""The floor that decides how a launch's ranks start: from its plan, and from what is warm.

``planning/plan_here`` says fork or spawn from what this machine and process are (the platform,
CUDA started here, the user's ``start_method``). Here that choice meets what is warm:

- **fork from the caller** (``fork.ForkStarter``): the ranks inherit what this process imported
  for them (``ahead/kernel_preload``); where something it loaded ahead is stale (installed anew,
  or it read a variable that has changed since), forked ranks would get it as it was, so the
  launch starts from the launch server instead, saying why;
- **the launch server** (``server_starter.ServerStarter``, "spawn" on Linux): ranks waiting on
  standby for the launch's shape first, the others forked by its best generation
  (``ahead/launch_server``); a fresh interpreter per rank elsewhere (``spawn.SpawnStarter``);
- **the XLA host** (``xla_host``) on TPUs.

Everything below (``processes/``, ``ahead/``) starts processes or readies them, and imports
nothing from here. Example::

    starter, plan = starter_for(plan_here(request))   # plan.start_reason says why, for the cell
    workers = starter.start(plan, starter.environ_for_ranks(plan))
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from nblaunch.launch.ahead.kernel_preload import kernel_preload
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting.base import Starter
from nblaunch.launch.starting.fork import ForkStarter
from nblaunch.launch.starting.server_starter import ServerStarter
from nblaunch.launch.starting.spawn import SpawnStarter


def _xla_host_starter() -> Starter:
    # Deferred: TPU hosts only; it loads the XLA host's worker code, which no other launch needs.
    from nblaunch.launch.starting.xla_host import XlaHostStarter

    return XlaHostStarter()


# Linux forks "spawn" ranks from the launch server (a fresh interpreter per rank elsewhere).
_STARTERS: dict[str, Callable[[], Starter]] = {
    "fork": ForkStarter,
    "spawn": ServerStarter if sys.platform.startswith("linux") else SpawnStarter,
    "xla": _xla_host_starter,
}


def starter_for(plan: LaunchPlan) -> tuple[Starter, LaunchPlan]:
    """The starter for ``plan``'s ranks, and the plan as they will start (see the module)."""
    if plan.start_method == "fork" and plan.request.start_method != "fork":
        stale = kernel_preload().stale_packages()
        if stale:
            package, why = next(iter(stale.items()))
            plan = dataclasses.replace(plan, start_method="spawn", start_reason=(
                f"{package} {why} since this process loaded it for earlier ranks, and forked ranks would get "
                "it as it was"))
    return _STARTERS[plan.start_method](), plan
