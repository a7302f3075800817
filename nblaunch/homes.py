"""Which home a launch's ranks get: the one place ``cluster=`` is read.

``notebook_launcher``, ``WarmRanks``, ``nblaunch launch`` and ``launches()``/``attach()`` all
ask here. It sits above ``launch/`` and ``cluster/``, so a launch never depends on a cluster
engine. A new home is one module implementing ``launch/ranks_home.RanksHome`` and its entry in
:data:`HOMES` (a function that imports it when first asked for).

Example::

    home = open_home(LaunchRequest(train, num_processes=2))   # this machine's home: checked, planned
    Launch(home).run()
"""

from __future__ import annotations

from typing import Callable

from nblaunch.detached.kept_launch import KeptLaunch
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.local_home import LocalHome
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.ranks_home import RanksHome


def _ray_home() -> type[RanksHome]:
    # Deferred: a cluster's home is loaded when a launch asks for it (``import nblaunch`` stays
    # lean: its modules cost about 15 ms); Ray itself only when the home is made.
    from nblaunch.cluster.ray_home import RayHome

    return RayHome


def _slurm_home() -> type[RanksHome]:
    from nblaunch.cluster.slurm_home import SlurmHome  # deferred, as the Ray home

    return SlurmHome


# Every home, by the name cluster= gives it (None: this machine), loaded on first use.
HOMES: dict[str | None, Callable[[], type[RanksHome]]] = {
    None: lambda: LocalHome,
    "ray": _ray_home,
    "slurm": _slurm_home,
}


def home_class(request: LaunchRequest) -> type[RanksHome]:
    """The home ``request.cluster`` names (what it can do is asked of the class before any is made)."""
    if request.cluster not in HOMES:
        names = ", ".join(repr(name) for name in HOMES if name is not None)
        raise LaunchConfigError(f"cluster must be None (this machine) or one of {names}, got "
                                f"{request.cluster!r}")
    return HOMES[request.cluster]()


def open_home(request: LaunchRequest) -> RanksHome:
    """The home of ``request``: checked for it and planned, nothing started or placed yet.
    Raises LaunchConfigError."""
    return home_class(request)(request)


def all_kept(kinds: tuple[str, ...] = ("launch",)) -> list[KeptLaunch]:
    """This user's detached launches (of ``kinds``) in every home: those kept on this machine,
    then those kept by a cluster this process is connected to."""
    return [place for home in HOMES.values() for place in home().kept(kinds)]
