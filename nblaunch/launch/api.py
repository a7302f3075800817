"""``notebook_launcher`` and ``debug_launcher``: the public way to start a launch, and the
:class:`Launch` handle a non-blocking launch returns."""

from __future__ import annotations

import contextvars
import functools
import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable

import cloudpickle

from nblaunch.display import Fanout, make_display
from nblaunch.events import Display, Event, LaunchFinished, LaunchStarted, RankFinished, RankStarted, RankState
from nblaunch.launch import pickling, registry
from nblaunch.launch.errors import LaunchCancelledError, LaunchConfigError, LaunchTimeoutError, RankFailedError
from nblaunch.launch.logfiles import LogFiles, new_log_dir
from nblaunch.launch.plan import LaunchPlan, make_plan
from nblaunch.launch.preimport import import_for_ranks
from nblaunch.launch.supervisor import Supervisor
from nblaunch.launch.workers import WorkerProcess, start_forked, start_spawned, start_xla_host
from nblaunch.worker.bootstrap import WorkerSettings
from nblaunch.worker.inherited import forget_accelerate_state


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
    if not isinstance(block, bool):
        raise LaunchConfigError(f"block must be True or False, got {block!r}")
    plan = make_plan(
        function, args, num_processes, mixed_precision, use_port, master_addr,
        node_rank, num_nodes, start_method, timeout, display, force_cpu=False,
    )
    pickling.check_picklable(function, args)
    # One rank runs here, except on XLA: the runtime would start in this process and break
    # every later xmp.spawn (torch_xla's own nprocs=1 has that trap).
    if block and plan.num_processes == 1 and plan.num_nodes == 1 and plan.start_method != "xla":
        return [_run_in_process(plan, function, args)]
    launch = Launch(plan, function, args, timeout, display)
    if block:
        return launch._run()
    set_stop_handler = getattr(launch._display, "set_stop_handler", None)
    if set_stop_handler is not None:  # the widget's Stop button: it can only work when not blocking
        set_stop_handler(launch.cancel)
    launch._start_in_background()
    return launch


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
    pickling.check_picklable(function, args)
    return Launch(plan, function, args, None, "auto")._run()


class Launch:
    """A launch in progress or finished; ``notebook_launcher(..., block=False)`` returns one.

    Example::

        launch = notebook_launcher(train, num_processes=2, block=False)
        launch.status          # "running"
        launch.logs(1)[-200:]  # rank 1's log so far
        launch.cancel()        # or: results = launch.result()
    """

    def __init__(self, plan: LaunchPlan, function: Callable, args: tuple, timeout: float | None, display: Any):
        self.plan = plan
        self._function = function
        self._args = args
        self._timeout = timeout
        self._future: Future = Future()
        self._lock = threading.Lock()
        self._supervisor: Supervisor | None = None
        self._cancel_requested = False
        self._rank_states: dict[int, RankState] = {}
        self._status = "starting"
        for message in registry.stop_stale_ranks():
            print(f"nblaunch: {message}", file=sys.stderr)
        self.log_dir = new_log_dir()
        self._logs = LogFiles(self.log_dir, plan.num_processes)
        # Made here, on the caller's thread: a widget shows itself in the launching cell.
        self._display = make_display(display, plan.num_processes)
        self._sink = Fanout(self._logs, self._display)

    # ------------------------------------------------------------------ the handle
    @property
    def status(self) -> str:
        """starting, running, done, failed, timed out, cancelled or interrupted."""
        return self._status

    @property
    def ranks(self) -> dict[int, RankState]:
        """Each rank's state."""
        return dict(self._rank_states)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the launch (at most ``timeout`` seconds) and return each rank's result, or
        raise what the launch raised (RankFailedError, LaunchTimeoutError, ...)."""
        return self._future.result(timeout)

    def cancel(self) -> bool:
        """Show every rank's stack, stop every rank; ``result()`` then raises
        LaunchCancelledError. False if the launch had already finished."""
        with self._lock:
            if self._future.done():
                return False
            self._cancel_requested = True
            if self._supervisor is not None:
                self._supervisor.cancel()
        return True

    def logs(self, rank: int) -> str:
        """Rank ``rank``'s whole log so far (from disk)."""
        self._logs.flush()
        with open(self._logs.path(rank), encoding="utf-8", errors="replace") as log:
            return log.read()

    def __repr__(self) -> str:
        return f"<Launch {self.plan.function_name} on {self.plan.num_processes} processes: {self.status}>"

    # ------------------------------------------------------------------ running it
    def _start_in_background(self) -> None:
        # The thread forks the ranks and lives until they are reaped: PR_SET_PDEATHSIG fires when
        # the forking thread exits. A display that prints (text) runs in a copy of the caller's
        # context: ipykernel 7 keeps the launching cell there, so late lines land in that cell.
        # Widgets update through comm messages, which find their widget from any thread; tagging
        # them with a finished cell would make nbclient/papermill drop them.
        run = self._run_quietly
        if getattr(self._display, "prints_to_cell", False):
            run = functools.partial(contextvars.copy_context().run, self._run_quietly)
        thread = threading.Thread(target=run, name=f"nblaunch-{self.plan.function_name}", daemon=True)
        thread.start()

    def _run_quietly(self) -> None:
        try:
            self._run()
        except BaseException:
            pass  # kept in the future; result() raises it

    def _emit(self, event: Event) -> None:
        if isinstance(event, RankStarted):
            self._rank_states[event.rank] = RankState.RUNNING
            self._status = "running"
        elif isinstance(event, RankFinished):
            self._rank_states[event.rank] = event.state
        self._sink.on_event(event)

    def _run(self) -> list[Any]:
        plan = self.plan
        started = time.monotonic()
        self._emit(
            LaunchStarted(
                function_name=plan.function_name, num_processes=plan.num_processes, world_size=plan.world_size,
                node_rank=plan.node_rank, start_method=plan.start_method, start_reason=plan.start_reason,
                master_addr=plan.master_addr, master_port=plan.master_port, devices=plan.devices,
                log_dir=self.log_dir,
            )
        )
        record = None
        outcome: Any = None
        workers: list[WorkerProcess] = []
        try:
            workers = _start_workers(plan, self._function, self._args)
            record = registry.LaunchRecord(
                launch_id=uuid.uuid4().hex, launcher_pid=os.getpid(), port=plan.master_port,
                ranks=[(w.pid, registry.process_start_time(w.pid)) for w in workers],
            )
            record.save()
            with self._lock:
                self._supervisor = Supervisor(workers, self._emit, self._timeout)
                if self._cancel_requested:
                    self._supervisor.cancel()
            results = self._supervisor.run()
            elapsed = time.monotonic() - started
            self._status = "done"
            self._emit(
                LaunchFinished(
                    state=RankState.DONE, elapsed_s=elapsed, results=results,
                    summary=f"all {plan.num_processes} ranks done in {elapsed:.2f} s",
                )
            )
            outcome = results
            return results
        except BaseException as error:
            _kill_and_reap(workers)  # normally done by the supervisor; not if starting failed midway
            self._status, finished = _ending(error, time.monotonic() - started)
            self._emit(finished)
            outcome = error
            raise
        finally:
            if record is not None:
                record.remove()
            self._sink.close()
            # Last: whoever waits on result() finds the display closed and the logs complete.
            if isinstance(outcome, BaseException):
                self._future.set_exception(outcome)
            else:
                self._future.set_result(outcome)


def _ending(error: BaseException, elapsed: float) -> tuple[str, LaunchFinished]:
    """How a launch that raised ``error`` ended: its ``Launch.status`` and its last event."""
    if isinstance(error, RankFailedError):
        root = error.root_cause
        summary = f"rank {root.rank} failed after {elapsed:.2f} s: {root.reason}"
        return "failed", LaunchFinished(
            RankState.FAILED, elapsed, error=error, root_cause_rank=root.rank, summary=summary
        )
    if isinstance(error, LaunchTimeoutError):
        status = "timed out"
        summary = f"timed out after {elapsed:.2f} s (timeout={error.timeout:g}); every rank was stopped"
    elif isinstance(error, KeyboardInterrupt):
        status, summary = "interrupted", f"interrupted after {elapsed:.2f} s; every rank was stopped"
    elif isinstance(error, LaunchCancelledError):
        status, summary = "cancelled", f"cancelled after {elapsed:.2f} s; every rank was stopped"
    else:
        status, summary = "failed", f"the launch failed after {elapsed:.2f} s: {error!r}"
    return status, LaunchFinished(RankState.STOPPED, elapsed, error=error, summary=summary)


def _kill_and_reap(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        worker.kill()
        worker.wait()
        worker.close()


def _start_workers(plan: LaunchPlan, function: Callable, args: tuple) -> list[WorkerProcess]:
    if plan.start_method == "xla":
        # torch_xla pickles the function for its process pool (even with fork): cloudpickle it
        # first, so a function defined in a notebook cell travels by value.
        packed = cloudpickle.dumps((function, args))
        return [start_xla_host(plan.xla_environ, packed, plan.num_processes)]
    workers = []
    inherited = _environ_for_forked_ranks() if plan.start_method == "fork" else {}
    packed = pickling.package(function, args) if plan.start_method == "spawn" else None
    for local_rank in range(plan.num_processes):
        settings = WorkerSettings(
            rank=local_rank,
            environ=dict(inherited, **plan.rank_environ(local_rank)),
            threads=plan.threads,
            parent_pid=os.getpid(),
            sys_path=list(sys.path),
        )
        try:
            if packed is None:
                workers.append(start_forked(settings, function, args))
            else:
                workers.append(start_spawned(settings, packed, dict(os.environ, **settings.environ)))
        except BaseException:
            _kill_and_reap(workers)
            raise
    return workers


# Building the first optimizer (or DDP) imports torch._dynamo: ~1 s of CPU in every process that
# does it, 2-3 s when two ranks do it at once on 2 cores, at every launch. Imported here once,
# every forked rank inherits it. Only when a training library is loaded (the launch will train),
# so a launch that does not train pays nothing.
_TRAINING_MODULES = ("nblaunch.training", "accelerate")


def _environ_for_forked_ranks() -> dict[str, str]:
    """Pre-import what forked ranks would each import; return the variables it sets for them."""
    if "torch" not in sys.modules or not any(name in sys.modules for name in _TRAINING_MODULES):
        return {}
    try:
        return import_for_ranks("torch._dynamo")
    except Exception:  # an optimisation only: the ranks import it themselves if it fails here
        return {}


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
        forget_accelerate_state()  # as ours: the next launch starts from a clean state
        dist = sys.modules.get("torch.distributed")
        if not had_group and dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # the function's own group must not outlive the call
