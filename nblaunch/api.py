"""``notebook_launcher`` and ``debug_launcher``: the public way to start a launch.

The top of the house: it may use every other part (the launch, its homes, warm ranks).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from nblaunch.events import Display
from nblaunch.homes import choose_home
from nblaunch.launch import ipython_errors
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.handle import Launch
from nblaunch.launch.planning.plan import LaunchPlan, LaunchRequest
from nblaunch.warm.ranks import WarmRanks
from nblaunch.worker.inherited import restore_accelerate_state, save_accelerate_state


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    *,
    start_method: str | None = None,
    timeout: float | None = None,
    display: str | Display = "auto",
    block: bool = True,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    rdzv_backend: str = "static",
    ranks: "WarmRanks | None" = None,
    cluster: str | None = None,
) -> list[Any] | "Launch":
    """Run ``function(*args)`` in ``num_processes`` worker processes and return their results.

    The parameters shared with Hugging Face Accelerate's ``notebook_launcher`` mean the same
    (``use_port=None``, the default here, picks a free port). Each rank's output appears in the
    cell tagged with its rank; the call returns ``[result of rank 0, result of rank 1, ...]``.

    Args:
        function: the training function; defined anywhere, a notebook cell included.
        args: positional arguments for it (a tuple).
        num_processes: ranks on this machine; None means one per GPU (with at least two).
        mixed_precision: "no", "fp16", "bf16" or "fp8", handed to every rank's Accelerator.
        use_port: the rendezvous port; None picks a free one.
        master_addr, node_rank, num_nodes: for several machines (each runs this same call).
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
        monitor_interval, rdzv_backend: Accelerate's elastic-launch arguments, accepted for
            its callers; nblaunch watches its ranks without polling and knows every rank up
            front, so they change nothing ("static" or "c10d").

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
    if ranks is not None:
        return _run_on_warm_ranks(ranks, function, args, num_processes, block, max_restarts, num_nodes, timeout, display)
    request = LaunchRequest(function, args, num_processes, mixed_precision, use_port, master_addr, node_rank,
                            num_nodes, start_method, timeout, display, max_restarts=max_restarts,
                            monitor_interval=monitor_interval, rdzv_backend=rdzv_backend)
    plan, home = choose_home(request, cluster)
    ipython_errors.install()
    # One rank runs here, except on XLA: the runtime would start in this process and break
    # every later xmp.spawn (torch_xla's own nprocs=1 has that trap). A timeout needs a rank
    # that can be stopped, a restart one that can be started again: then even one rank runs in
    # a process of its own.
    if (block and cluster is None and plan.num_processes == 1 and plan.num_nodes == 1
            and plan.start_method != "xla" and timeout is None and not plan.max_restarts):
        return [_run_in_this_process(plan, function, args)]
    launch = Launch(plan, function, args, timeout, display, home=home)
    if not block:
        launch.start()
        return launch
    try:
        return launch.run()
    except BaseException as error:
        # What went wrong is in the error (the rank's own traceback is chained to it); the
        # launcher's frames it passed through would only bury that.
        raise error.with_traceback(None)


def _run_on_warm_ranks(ranks: WarmRanks, function: Callable, args: tuple, num_processes: Any, block: bool,
                       max_restarts: int, num_nodes: int, timeout: float | None, display: Any) -> list[Any]:
    __tracebackhide__ = True
    if not isinstance(ranks, WarmRanks):
        raise LaunchConfigError(f"ranks must be a WarmRanks, got {type(ranks).__name__}")
    if num_processes is not None and num_processes != ranks.num_processes:
        raise LaunchConfigError(f"num_processes={num_processes!r}, but the warm ranks are {ranks.num_processes}: "
                                "leave num_processes out, or make a WarmRanks of that size")
    if not block or max_restarts or num_nodes != 1:
        raise LaunchConfigError("block=False, max_restarts and num_nodes do not apply to warm ranks: "
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
    plan, home = choose_home(LaunchRequest(function, args, num_processes, force_cpu=True), cluster=None)
    return Launch(plan, function, args, None, "auto", home=home).run()


def _run_in_this_process(plan: LaunchPlan, function: Callable, args: tuple) -> Any:
    """One process: run here, with the rank variables set only for the call; the kernel's own
    process state (an Accelerator made in a cell before, a process group) is as it was after."""
    environ = plan.rank_environ(0)
    saved = {name: os.environ.get(name) for name in environ}
    dist = sys.modules.get("torch.distributed")
    had_group = bool(dist is not None and dist.is_available() and dist.is_initialized())
    kept = _training_state().save_process_state() if _training_loaded() else {}
    accelerates = save_accelerate_state()
    os.environ.update(environ)
    try:
        return function(*args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if _training_loaded():  # loaded before, or by the function
            _training_state().restore_process_state(kept)
        restore_accelerate_state(accelerates)
        dist = sys.modules.get("torch.distributed")
        if not had_group and dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # the function's own group must not outlive the call


def _training_loaded() -> bool:
    return "nblaunch.training" in sys.modules


def _training_state() -> Any:
    # Deferred: only once the training side is loaded; importing it for a launch that does not
    # train would cost the kernel a second.
    from nblaunch.training.runtime import state

    return state
