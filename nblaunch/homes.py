"""Which home a launch's ranks get: this machine, or the nodes of a Ray cluster.

The one place ``cluster=`` is read, for ``notebook_launcher`` and ``WarmRanks`` alike. It sits
above ``launch/`` and ``cluster/``, so the launch itself never depends on a cluster engine.

Example::

    plan, home = choose_home(LaunchRequest(train, num_processes=2), cluster=None)
    Launch(plan, train, (), None, "auto", home=home).run()
"""

from __future__ import annotations

from typing import Any

from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.homes import LocalHome, RanksHome
from nblaunch.launch.planning import pickling
from nblaunch.launch.planning.plan import LaunchPlan, LaunchRequest, make_plan

CLUSTER_CHOICES = (None, "ray")  # None: this machine


def choose_home(request: LaunchRequest, cluster: Any) -> tuple[LaunchPlan, RanksHome]:
    """Check ``request`` for the home ``cluster`` names and return the launch's plan and home.
    Raises LaunchConfigError, before anything starts or is placed."""
    if cluster not in CLUSTER_CHOICES:
        raise LaunchConfigError(f"cluster must be None (this machine) or 'ray', got {cluster!r}")
    if cluster == "ray":
        # Deferred: Ray is an optional extra, imported only for launches that ask for it.
        from nblaunch.cluster.ray_home import plan_ray_launch

        return plan_ray_launch(request)  # checks picklability before it connects to the cluster
    plan = make_plan(request)
    pickling.check_picklable(request.function, request.args)
    return plan, LocalHome()
