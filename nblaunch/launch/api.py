"""``notebook_launcher`` and ``debug_launcher``: the public way to start a launch."""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any, Callable

from nblaunch.display import Fanout, make_display
from nblaunch.events import Display, LaunchFinished, LaunchStarted, RankState
from nblaunch.launch import pickling, registry
from nblaunch.launch.errors import LaunchTimeoutError, RankFailedError
from nblaunch.launch.logfiles import LogFiles, new_log_dir
from nblaunch.launch.plan import LaunchPlan, make_plan
from nblaunch.launch.supervisor import Supervisor
from nblaunch.launch.workers import WorkerProcess, start_forked, start_spawned
from nblaunch.worker.bootstrap import WorkerSettings


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
) -> list[Any]:
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
        display: "auto", "widget", "text", "none", or an object with on_event/close.

    Raises:
        LaunchConfigError: bad input (nothing was started).
        RankFailedError: a rank failed; the root cause first, its exception chained.
        LaunchTimeoutError: ``timeout`` ran out.
        KeyboardInterrupt: interrupted; every rank's stack was shown and every rank stopped.

    Example::

        >>> def train(scale):
        ...     import os
        ...     return int(os.environ["RANK"]) * scale
        >>> notebook_launcher(train, args=(10,), num_processes=2, display="none")
        [0, 10]
    """
    plan = make_plan(
        function, args, num_processes, mixed_precision, use_port, master_addr,
        node_rank, num_nodes, start_method, timeout, display, force_cpu=False,
    )
    return _launch(plan, function, args, timeout, display)


def debug_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int = 2) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU processes (GPUs hidden), to debug
    distributed code on any machine. Each rank has its own RANK and LOCAL_RANK.

    Example::

        >>> debug_launcher(lambda: __import__("os").environ["RANK"], num_processes=2)  # doctest: +SKIP
        ['0', '1']
    """
    plan = make_plan(
        function, args, num_processes, "no", None, "127.0.0.1", 0, 1, None, None, "auto", force_cpu=True,
    )
    return _launch(plan, function, args, None, "auto")


def _launch(plan: LaunchPlan, function: Callable, args: tuple, timeout: float | None, display: Any) -> list[Any]:
    pickling.check_picklable(function, args)
    if plan.num_processes == 1 and plan.num_nodes == 1:
        return [_run_in_process(plan, function, args)]

    for message in registry.stop_stale_ranks():
        print(f"nblaunch: {message}", file=sys.stderr)
    log_dir = new_log_dir()
    sink = Fanout(LogFiles(log_dir, plan.num_processes), make_display(display))
    started = time.monotonic()
    sink.on_event(
        LaunchStarted(
            function_name=plan.function_name, num_processes=plan.num_processes, world_size=plan.world_size,
            node_rank=plan.node_rank, start_method=plan.start_method, start_reason=plan.start_reason,
            master_addr=plan.master_addr, master_port=plan.master_port, devices=plan.devices, log_dir=log_dir,
        )
    )
    record = None
    workers: list[WorkerProcess] = []
    try:
        workers = _start_workers(plan, function, args)
        record = registry.LaunchRecord(
            launch_id=uuid.uuid4().hex, launcher_pid=os.getpid(), port=plan.master_port,
            ranks=[(w.pid, registry.process_start_time(w.pid)) for w in workers],
        )
        record.save()
        results = Supervisor(workers, sink.on_event, timeout).run()
        elapsed = time.monotonic() - started
        sink.on_event(
            LaunchFinished(
                state=RankState.DONE, elapsed_s=elapsed, results=results,
                summary=f"all {plan.num_processes} ranks done in {elapsed:.2f} s",
            )
        )
        return results
    except BaseException as error:
        for w in workers:  # normally reaped by the supervisor; not if starting failed midway
            w.kill()
            w.wait()
            w.close()
        sink.on_event(_finished_event(error, started))
        raise
    finally:
        if record is not None:
            record.remove()
        sink.close()


def _finished_event(error: BaseException, started: float) -> LaunchFinished:
    elapsed = time.monotonic() - started
    if isinstance(error, RankFailedError):
        root = error.root_cause
        summary = f"rank {root.rank} failed after {elapsed:.2f} s: {root.reason}"
        return LaunchFinished(RankState.FAILED, elapsed, error=error, root_cause_rank=root.rank, summary=summary)
    if isinstance(error, LaunchTimeoutError):
        summary = f"timed out after {elapsed:.2f} s (timeout={error.timeout:g}); every rank was stopped"
    elif isinstance(error, KeyboardInterrupt):
        summary = f"interrupted after {elapsed:.2f} s; every rank was stopped"
    else:
        summary = f"the launch failed after {elapsed:.2f} s: {error!r}"
    return LaunchFinished(RankState.STOPPED, elapsed, error=error, summary=summary)


def _start_workers(plan: LaunchPlan, function: Callable, args: tuple) -> list[WorkerProcess]:
    workers = []
    packed = pickling.package(function, args) if plan.start_method == "spawn" else None
    for local_rank in range(plan.num_processes):
        settings = WorkerSettings(
            rank=local_rank,
            environ=plan.rank_environ(local_rank),
            threads=plan.threads,
            parent_pid=os.getpid(),
            sys_path=list(sys.path),
        )
        try:
            if packed is None:
                workers.append(start_forked(settings, function, args))
            else:
                environ = dict(os.environ, **settings.environ)
                workers.append(start_spawned(settings, packed, environ))
        except BaseException:
            for w in workers:
                w.kill()
                w.wait()
                w.close()
            raise
    return workers


def _run_in_process(plan: LaunchPlan, function: Callable, args: tuple) -> Any:
    """One process: run here, with the rank variables set only for the call."""
    environ = plan.rank_environ(0)
    saved = {name: os.environ.get(name) for name in environ}
    dist = sys.modules.get("torch.distributed")
    had_group = bool(dist is not None and dist.is_available() and dist.is_initialized())
    os.environ.update(environ)
    try:
        return function(*args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        state = sys.modules.get("nblaunch.training.state")
        if state is not None:
            state.reset_process_state()
        dist = sys.modules.get("torch.distributed")
        if not had_group and dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # the function's own group must not outlive the call
