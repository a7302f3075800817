"""The public way to start a launch (``notebook_launcher``, ``debug_launcher``) and to find
detached ones again (``launches``, ``attach``, ``find``).

The top of the house: it may use every other part (the launch, its clusters, warm ranks).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import time
from typing import Any, Callable

from nblaunch.detached import store
from nblaunch.detached.detached_launch import DetachedLaunch
from nblaunch.events import Display
from nblaunch.clusters import all_kept, open_cluster
from nblaunch.launch import ipython_errors
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.handle import Launch
from nblaunch.launch.planning.request import STALL_AFTER_S, LaunchRequest
from nblaunch.launch.starting.report import PreloadReport, preloaded_here
from nblaunch.step_split import last_steps  # noqa: F401  (a public name: nblaunch.last_steps)
from nblaunch.launch.post_mortem import debug  # noqa: F401  (a public name: nblaunch.debug)
from nblaunch.warm.detached_pool import DetachedWarmRanks
from nblaunch.warm.ranks import WarmRanks


def preloaded() -> PreloadReport:
    """What the next launch's ranks will find ready where they come from (this process, the
    launch server, the Ray nodes kept from the last launch on a cluster), and what is left to the
    ranks and why; ``.release()`` lets the server and the kept nodes go. See README's
    "Re-running a cell".

    Example::

        >>> nblaunch.preloaded().here    # ('sklearn', 'torch')
        >>> nblaunch.preloaded().release()
    """
    report = preloaded_here()
    ray_nodes = sys.modules.get("nblaunch.cluster.ray_nodes")  # only where a Ray launch ran: Ray is never loaded to look
    if ray_nodes is not None:
        kept = ray_nodes.kept_nodes()
        report = dataclasses.replace(report, ray_nodes=tuple(
            f"{n.request.describe()}, agents up since the last launch" for n in kept.held()),
            releasers=report.releasers + (kept.release_all,))
    return report


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int | None = None,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    start_method: str | None = None,
    timeout: float | None = None,
    display: str | Display = "auto",
    block: bool = True,
    ranks: "WarmRanks | None" = None,
    cluster: str | None = None,
    resources: dict[str, Any] | None = None,
    cpu: bool = False,
    detach: bool = False,
    stall_after: float | None = STALL_AFTER_S,
    resume: bool | str = False,
) -> list[Any] | "Launch" | DetachedLaunch:
    """Run ``function(*args)`` in ``num_processes`` worker processes and return their results.

    The parameters shared with Hugging Face Accelerate's ``notebook_launcher`` mean the same
    (``use_port=None``, the default here, picks a free port). Each rank's output appears in the
    cell tagged with its rank; the call returns ``[result of rank 0, result of rank 1, ...]``.

    Args:
        function: the training function; defined anywhere, a notebook cell included.
        args: positional arguments for it (a tuple).
        num_processes: ranks on this machine; None means one per GPU, or 2 CPU ranks where
            there is no GPU (or with ``cpu=True``). One rank is a launch like any other: a
            process of its own, the same dashboard, logs and errors.
        mixed_precision: "no", "fp16", "bf16" or "fp8" (fp8: Accelerate's own Accelerator
            with an fp8 backend, on GPUs), in any case, handed to every rank's Accelerator;
            "bfloat16", "float16", "half", "fp32" and "none" are read as those, as the
            Accelerator reads them.
        use_port: the rendezvous port; None picks a free one.
        master_addr, node_rank, num_nodes: for several machines (each runs this same call);
            with a ``cluster``, ``num_nodes`` is how many of its nodes to use.
        start_method: None (fork where safe, spawn where not), "fork" or "spawn".
        timeout: seconds; past it every rank's stack is shown, the ranks are stopped and
            LaunchTimeoutError is raised.
        display: "auto" (widgets in a notebook, text elsewhere), "widget", "text", "none", or an
            object with ``on_event``/``close``.
        block: False returns a :class:`Launch` at once; the launch goes on while other cells run.
        max_restarts: after a rank fails, stop every rank and start them all again, up to this
            many times (each restart is shown in the cell). The ranks see torchrun's
            ``TORCHELASTIC_RESTART_COUNT`` and can resume from their checkpoint
            (``accelerator.load_state``). ``timeout`` covers all starts together.
        ranks: a :class:`~nblaunch.WarmRanks` to run on: the call reuses its processes and
            process group (milliseconds instead of a start), and what earlier calls left in
            them. ``num_processes`` must then be None or its size; ``block=False``,
            ``max_restarts`` and multi-node settings do not apply.
        cluster: None runs the ranks on this machine; "ray" places ``num_nodes`` nodes of
            ``num_processes`` ranks each on the Ray cluster this process is connected to
            (``ray.init()``'s defaults if it is not): all nodes or none, node 0 hosting the
            rendezvous, every rank's output, progress and result in this cell as on one machine.
            "slurm" runs on the nodes of a Slurm allocation: inside one (a kernel in a Slurm
            job), every node of it by default (``num_nodes`` narrows), one rank per GPU it
            gives each node (or ``num_processes``); outside one, ``resources=`` says what to
            ask for, and the cell shows the job waiting in the queue until it starts.
        resources: with ``cluster="slurm"`` outside an allocation, what to ask Slurm for, as
            sbatch names it: ``partition``, ``account``, ``time``, ``qos``, ``reservation``,
            ``constraint``, ``mem``, ``gpus_per_node``, ``cpus_per_node``; the nodes are
            ``num_nodes``. Your ``SBATCH_PARTITION``/``SBATCH_ACCOUNT``/... fill what it leaves
            out. Example: ``resources={"partition": "gpu", "time": "1:00:00", "gpus_per_node": 4}``.
        cpu: True runs every rank on the CPU with the GPUs hidden (as Accelerate's
            ``cpu=True``): as many ranks as you like on a one-GPU machine, to try or debug
            distributed code.
        detach: True runs the launch under a supervisor of its own, outside this kernel, and
            returns a :class:`~nblaunch.detached.detached_launch.DetachedLaunch` at once, its dashboard
            live in this cell: a kernel restart, or a closed notebook, does not stop it.
            ``nblaunch.launches()`` lists such launches and ``nblaunch.attach()`` shows one
            again (from any kernel of yours), with ``result()`` and ``cancel()``. With
            ``cluster="ray"`` a detached actor of the cluster keeps it, for any driver
            connected to the cluster.
        stall_after: seconds without progress (no line, bar, metric, and no rank's code moving)
            after which the cell shows, without stopping anything, each rank's stack and which
            ranks wait in which collective for which rank; cleared when progress resumes.
            None never looks.
        resume: True starts the ranks so that their ``Accelerator`` loads the latest complete
            checkpoint before the first step (the one an interrupted launch of this function
            saved, or the latest under its ``project_dir``): prepared DataLoaders skip what was
            used, the scheduler and random states go on. A folder loads that checkpoint. A
            half-written checkpoint, or one saved by another number of processes, is refused
            before any step. (An interrupt, ``timeout`` or ``cancel()`` during a launch that
            trains through nblaunch's Accelerator stops every rank at one common step and saves
            there; the cell names the folder.)
        rdzv_endpoint: Accelerate's ``"host:port"`` of the rendezvous: the same as
            ``master_addr`` and ``use_port`` (refused where they disagree).
        rdzv_id: the job's name, ``TORCHELASTIC_RUN_ID`` in every rank as under torchrun.
        monitor_interval, rdzv_backend: Accelerate's elastic-launch arguments, accepted for
            its callers (by position too); nblaunch watches its ranks without polling and knows
            every rank up front, so they change nothing ("static" or "c10d").
        rdzv_conf, log_line_prefix_template: refused when given: the first configures a
            dynamic rendezvous nblaunch does not use, the second a line prefix nblaunch sets
            itself ("[rank 1] ...").

    Raises:
        LaunchConfigError: bad input (nothing was started).
        RankFailedError: a rank failed; the root cause first, its exception chained.
        LaunchTimeoutError: ``timeout`` ran out.
        LaunchInterrupted: interrupted (a KeyboardInterrupt); every rank was stopped, and where
            each one was is shown.

    Example::

        >>> def train(scale):
        ...     import os
        ...     return int(os.environ["RANK"]) * scale
        >>> notebook_launcher(train, args=(10,), num_processes=2, display="none")
        [0, 10]
    """
    __tracebackhide__ = True  # IPython leaves this frame out of the tracebacks it shows
    if not isinstance(block, bool):
        raise LaunchConfigError(f"block must be True or False, got {block!r}")
    if not isinstance(detach, bool):
        raise LaunchConfigError(f"detach must be True or False, got {detach!r}")
    if detach and ranks is not None:
        raise LaunchConfigError("detach=True starts ranks of its own: leave ranks= out (for warm ranks that "
                                "outlive the kernel, make them with WarmRanks(..., detach=True))")
    if ranks is not None:
        _refuse_launch_options_on_warm_ranks(locals())
        return _run_on_warm_ranks(ranks, function, args, num_processes, block, num_nodes, timeout, display)
    request = LaunchRequest.from_call(
        function, args, num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
        master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes, start_method=start_method,
        timeout=timeout, display=display, cpu=cpu, max_restarts=max_restarts, cluster=cluster, resources=resources,
        stall_after=stall_after, resume=resume,
        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, rdzv_id=rdzv_id,
        monitor_interval=monitor_interval, log_line_prefix_template=log_line_prefix_template)
    opened = open_cluster(request)
    ipython_errors.install()
    if detach:  # checked here, then kept by a supervisor (or on Ray, an actor) of its own
        detached = DetachedLaunch(opened.keep())
        detached.watch(display)
        return detached
    launch = Launch(opened)
    if not block:
        launch.start()
        return launch
    try:
        return launch.run()
    except BaseException as error:
        # What went wrong is in the error (the rank's own traceback is chained to it); the
        # launcher's frames it passed through would only bury that.
        raise error.with_traceback(None)


# How the ranks start: decided when a WarmRanks is made, so not for ranks= to change.
_DECIDED_BY_THE_POOL = ("mixed_precision", "use_port", "master_addr", "node_rank", "start_method", "max_restarts",
                        "monitor_interval", "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "rdzv_id",
                        "log_line_prefix_template", "cluster", "cpu", "stall_after", "resume")


def _refuse_launch_options_on_warm_ranks(given: dict[str, Any]) -> None:
    """With ``ranks=``, an option that would change how the ranks start (one not at its
    default) must not be dropped without a word."""
    defaults = inspect.signature(notebook_launcher).parameters
    changed = [name for name in _DECIDED_BY_THE_POOL if given[name] != defaults[name].default]
    if changed:
        raise LaunchConfigError(
            f"{', '.join(changed)} cannot apply with ranks=: the warm ranks were started with their own settings. "
            f"Pass {'it' if len(changed) == 1 else 'them'} to WarmRanks(...) when you make it, or launch without ranks=."
        )


def _run_on_warm_ranks(ranks: WarmRanks | DetachedWarmRanks, function: Callable, args: tuple, num_processes: Any, block: bool,
                       num_nodes: int | None, timeout: float | None, display: Any) -> list[Any]:
    __tracebackhide__ = True
    if not isinstance(ranks, (WarmRanks, DetachedWarmRanks)):
        raise LaunchConfigError(f"ranks must be a WarmRanks, got {type(ranks).__name__}")
    if num_processes is not None and num_processes != ranks.num_processes:
        raise LaunchConfigError(f"num_processes={num_processes!r}, but the warm ranks are {ranks.num_processes}: "
                                "leave num_processes out, or make a WarmRanks of that size")
    if not block or num_nodes not in (None, 1):
        raise LaunchConfigError("block=False and num_nodes do not apply to warm ranks: "
                                "leave them out, or launch without ranks=")
    if not isinstance(args, tuple):
        raise LaunchConfigError(f"args must be a tuple, got {type(args).__name__}")
    return ranks.run(function, *args, timeout=timeout, display=display)


def debug_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int = 2) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU processes (GPUs hidden), to debug
    distributed code on any machine. Each rank has its own RANK and LOCAL_RANK.

    Example::

        >>> debug_launcher(lambda: __import__("os").environ["RANK"], num_processes=2)  # doctest: +SKIP
        ['0', '1']
    """
    return Launch(open_cluster(LaunchRequest(function, args, num_processes, cpu=True))).run()


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """One detached launch, as :func:`launches` lists it."""

    id: str
    function: str
    status: str
    started: str
    ranks: int
    log_dir: str
    kind: str = "launch"  # or "pool": detached warm ranks (WarmRanks.attach() runs on them)

    def __repr__(self) -> str:
        what = f"warm ranks, {self.ranks} processes" if self.kind == "pool" else f"{self.function} on {self.ranks} ranks"
        return f"{self.id}  {self.status:<11} {self.started}  {what}  logs: {self.log_dir}"


class _Listing(list):
    def __repr__(self) -> str:
        return "\n".join(map(repr, self)) if self else "no detached launches"


def launches() -> list[LaunchInfo]:
    """This user's detached launches (and detached warm ranks), oldest first. Finished ones are
    kept a day after ``result()`` collected them, a week otherwise."""
    store.prune()
    listing = _Listing()
    for place in all_kept(kinds=("launch", "pool")):
        launch = DetachedLaunch(place)
        state = launch.state()
        listing.append(LaunchInfo(state["id"], state["function"], launch.status,
                                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state["started"])),
                                  state["num_processes"], state.get("log_dir", ""), state.get("kind", "launch")))
    return listing


def attach(launch_id: str | None = None, display: Any = "auto") -> DetachedLaunch:
    """The detached launch ``launch_id`` (or the latest; a unique prefix will do), its dashboard
    replayed in this cell and then live. Watching never changes the launch: stop watching with
    ``detach()``, stop the launch with ``cancel()``."""
    launch = find(launch_id)
    launch.watch(display)
    return launch


def find(launch_id: str | None, kinds: tuple[str, ...] = ("launch",)) -> DetachedLaunch:
    """The detached launch (or, with "pool" in ``kinds``, warm ranks) ``launch_id`` (a unique
    start of its id; None: the latest), not watched."""
    every = all_kept(kinds)
    places = every
    if launch_id is not None:
        places = [place for place in every if place.launch_id.startswith(launch_id)]
        if len(places) != 1:
            known = ", ".join(place.launch_id for place in every) or "none"
            what = "no" if not places else "more than one"
            raise LookupError(f"{what} detached launch of this user has an id starting with {launch_id!r} "
                              f"(launches(): {known})")
    elif not places:
        raise LookupError("no detached launch to attach to: notebook_launcher(..., detach=True) starts one")
    return DetachedLaunch(places[-1])
