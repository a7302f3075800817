"""What runs inside every worker process, forked or spawned, before and after the user's function.

In order: join a process group of its own (the parent, not every rank at once, decides what an
interrupt does), die with the parent, write to plain file descriptors the parent reads (a forked
child of a Jupyter kernel would otherwise write into the kernel's stream objects, where output
vanishes), set the rank's environment, answer stack-dump requests, run the function, send back
its result or its exception, and leave with ``os._exit`` (never the parent's atexit hooks).
Whatever fails around the user's function is reported to the launcher too (``RankGuard``).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import pickle
import signal
import sys
import _thread
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

from nblaunch import proctree, wire
from nblaunch.machine.installed import installed_modules, loaded_since
from nblaunch.contract import variables as v
from nblaunch.contract.failure import Phase
from nblaunch.worker import calls, channel, compile_watch, lifeline, movement, payload, step_clock, step_stop
from nblaunch.worker.control import ControlSocket
from nblaunch.worker.starting.own_meeting_point import meet_at_the_launchers_store_only
from nblaunch.worker.starting.inherited import forget_accelerate_state, forget_half_imported, leave_interactive_session
from nblaunch.worker.progress import install_progress_hooks
from nblaunch.worker.reports import RankGuard, describe, send_failure
from nblaunch.worker.streams import attach_streams, flush_streams


@dataclass
class WorkerSettings:
    """Everything one rank needs to know; picklable, so spawn can send it."""

    rank: int  # local rank on this node
    environ: dict[str, str]  # RANK, WORLD_SIZE, MASTER_PORT, ... added to the rank's environment
    threads: int | None  # intra-op threads, or None to leave the user's choice alone
    parent_pid: int
    sys_path: list[str]
    # Forked ranks: modules the parent imported for the ranks that went stale since (installed
    # anew, or a variable their import read has changed): dropped, so the function imports them afresh.
    forget: tuple[str, ...] = ()


def run_forked(
    settings: WorkerSettings,
    function: Callable,
    args: tuple,
    *,
    stdout_fd: int,
    stderr_fd: int,
    event_fd: int,
    control_fd: int,
    std_handlers: list[tuple[logging.Handler, str]] | None = None,
) -> NoReturn:
    """Entry point in a freshly forked child. Never returns into the launcher's code.
    ``std_handlers``: the launcher's :func:`~nblaunch.worker.streams.std_stream_handlers`."""
    try:
        with RankGuard(event_fd, stderr_fd) as guard:
            guard.phase = Phase.JOINING
            settle_forked_child(settings.parent_pid)
            for name in settings.forget:
                sys.modules.pop(name, None)
            guard.phase = Phase.ATTACHING
            attach_streams(stdout_fd, stderr_fd, std_handlers)
            guard.stderr_fd = 2
            code = _run_rank(guard, settings, function, args, event_fd, ControlSocket(control_fd))
        os._exit(code)
    finally:
        os._exit(70)  # reached only if the guard itself could not end the rank


def settle_forked_child(parent_pid: int) -> None:
    """First steps of any process the launcher forks: a process group of its own (then SIGINT,
    blocked across the fork, may come in), and death with the launcher. The launcher's other
    descriptors were closed at the fork (``nblaunch.launch.processes.fdtable``)."""
    os.setpgid(0, 0)
    # Garbage the parent had not collected yet is not ours to collect: its finalizers may wait
    # for the parent's threads (Ray's GlobalStateAccessor joins a C++ thread, and a rank hung
    # for ever in the gc.collect() that Trainer calls). Frozen, it is never examined here.
    gc.freeze()
    forget_half_imported()  # another thread of the launcher was importing: none here will finish it
    # Forked from the launcher's forking thread, which is now this process's main thread: give it
    # the main thread's name back (stacks say "Thread MainThread"; some libraries check the name).
    threading.current_thread().name = "MainThread"
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    lifeline.die_with_parent(parent_pid)


def main_spawned(argv: list[str]) -> NoReturn:
    """Entry point of ``python -m nblaunch.worker CONTROL_FD EVENT_FD PARENT_PID``, and of a rank
    the launch server forked (``launch/starting/server_process``), its stdout and stderr on 1 and 2."""
    try:
        with RankGuard(None, 2) as guard:
            guard.phase = Phase.JOINING
            control_fd, event_fd, parent_pid = (int(a) for a in argv)
            guard.event_fd = event_fd
            lifeline.die_with_parent(parent_pid)
            guard.phase = Phase.ATTACHING
            attach_streams(1, 2)
            guard.phase = Phase.LOADING
            control = ControlSocket(control_fd)
            settings, data, buffers, local_fd = payload.read(control)
            sys.path[:] = settings.sys_path  # so functions pickled by reference import as in the parent
            function, args = payload.load(data, buffers, local_fd)
            code = _run_rank(guard, settings, function, args, event_fd, control)
        os._exit(code)
    finally:
        os._exit(70)


def _run_rank(guard: RankGuard, settings: WorkerSettings, function: Callable, args: tuple,
              event_fd: int, control: ControlSocket) -> int:
    """What forked and spawned ranks do alike once they can run: set up, serve, clean up."""
    guard.phase = Phase.SETTING_UP
    _set_up_rank(settings, event_fd)
    guard.phase = Phase.REPORTING
    code = serve(function, args, control, event_fd)
    leave_cleanly(event_fd)
    return code


def _set_up_rank(settings: WorkerSettings, event_fd: int) -> None:
    os.environ.update(settings.environ)
    if v.TORCHELASTIC_USE_AGENT_STORE in settings.environ:
        meet_at_the_launchers_store_only(settings.environ[v.MASTER_PORT])
    lifeline.set_process_name(str(settings.rank))
    lifeline.become_subreaper()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if settings.threads is not None:
        os.environ[v.OMP_NUM_THREADS] = str(settings.threads)
        torch = sys.modules.get("torch")  # forked from a parent that imported torch
        if torch is not None:
            torch.set_num_threads(settings.threads)
    channel.open_channel(event_fd)
    forget_accelerate_state()  # forked from a kernel where Accelerate ran: start afresh
    prepare_process()


def leave_cleanly(event_fd: int) -> None:
    """Before the process exits: stop every process it started (a helper in a session of its own
    would outlive it), tell the launcher so (it then needs no search), flush what is buffered."""
    proctree.kill_descendants(os.getpid())
    try:
        channel.send(wire.CLEANED, b"", fd=event_fd)  # under the channel's lock: frames never interleave
    except OSError:
        pass  # the launcher is gone
    flush_streams()


def prepare_process() -> None:
    """What every process hosting ranks needs once, whatever started it."""
    leave_interactive_session()  # forked from a kernel: a worker, not an interactive session
    install_progress_hooks()  # tqdm and rich bars become progress events, drawn by the launcher
    # A C-level dump for ranks whose Python threads cannot answer (the GIL held by C code).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def serve(function: Callable, args: tuple, control: ControlSocket, event_fd: int) -> int:
    """Run one rank's function and send back its result or failure; returns an exit code. At
    its end the rank tells the installed libraries it imported (``wire.IMPORTED``): the next
    launch of the function imports them before forking its ranks. The channel must already point
    at ``event_fd`` for the calling thread.
    """
    before = len(sys.modules)
    try:
        return _run_function(function, args, control, event_fd)
    finally:
        _tell_imported(before)


def _tell_imported(before: int) -> None:
    """Tell the launcher the installed modules imported (to their end) since ``sys.modules``
    held ``before`` of them."""
    try:
        new = [n for n in installed_modules(loaded_since(before)) if not _being_imported(n)]
        if new:
            channel.send(wire.IMPORTED, pickle.dumps(new))
    except Exception:  # noqa: BLE001  only an optimisation of the next launch: never this rank's
        pass


def _being_imported(name: str) -> bool:
    return bool(getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False))


def _run_function(function: Callable, args: tuple, control: ControlSocket, event_fd: int) -> int:
    # A bare thread: threading.Thread.start() waits until the new thread runs, which on busy
    # cores is a millisecond of every launch spent before the user's function starts.
    _thread.start_new_thread(_watch_launcher, (control, event_fd))
    movement.watch_main_thread()
    compile_watch.watch_compiles()  # torch._dynamo is usually loaded ahead: its compiles show from the first
    if function is not calls.serve_calls:  # a warm rank's calls begin and end their own
        step_stop.begin_call(0, keeps_work=True)  # an interrupt stops every rank at one step and saves there
    try:
        try:
            result = function(*args)
        finally:
            step_stop.end_call()
            step_clock.flush()  # the last steps, before the result or the failure
    except step_stop.RunStopped as stopped:  # as the launcher asked: the work is in the checkpoint
        channel.send(wire.STOPPED, pickle.dumps((stopped.steps, stopped.checkpoint)))
        return 0
    except SystemExit as exit_request:  # sys.exit(0) is a clean finish with no result
        if exit_request.code in (None, 0):
            _send_result(None)
            return 0
        send_failure(exit_request, f"called sys.exit({exit_request.code!r})")
        return 1
    except BaseException as error:
        send_failure(error)
        return 1
    try:
        _send_result(result)
    except Exception as error:
        send_failure(error, f"returned a {type(result).__name__} that cannot be sent back: {describe(error)}")
        return 1
    return 0


def _send_result(result: Any) -> None:
    channel.send(wire.RESULT, channel.pickle_value(result))


def _watch_launcher(control: ControlSocket, event_fd: int) -> None:
    """Answer stack-dump requests, pass calls on to a warm rank's loop; exit when the
    launcher's end of the socket closes. If this thread breaks, the rank reports it and leaves:
    without it no call would ever arrive, and the launcher would wait for nothing."""
    try:
        shared = None  # the memfds of the next call
        while True:
            for kind, body in control.next_frames():
                if kind == wire.DUMP_STACKS:
                    flush_streams()  # what it printed up to here comes before where it is
                    counted = step_clock.counts()
                    if counted:  # first: the stall report reads them with the stack
                        channel.send(wire.COLLECTIVES, pickle.dumps(counted), fd=event_fd)
                    channel.send(wire.STACKS, format_stacks().encode(), fd=event_fd)
                elif kind == wire.SHARED:
                    shared = control.shared_memory(body)
                elif kind in (wire.CALL, wire.CLOSE):
                    calls.deliver(kind, body, shared)
                    shared = None
                elif kind in (wire.INTERRUPT, wire.RELEASE):
                    calls.control(kind, body)
    except BaseException as error:
        send_failure(error, f"nblaunch's control thread in this rank broke: {describe(error)}", phase=Phase.WATCHING,
                     fd=event_fd)
        os._exit(1)


_WORKER_DIR = os.path.dirname(os.path.abspath(__file__))
# The worker code that calls the user's function; frames of other worker modules (channel,
# progress, streams) are called *by* the user's code.
_ENTRY_FILES = {os.path.join(_WORKER_DIR, name) for name in ("bootstrap.py", "calls.py", "xla_ranks.py")}


def _users_code_starts(summary: traceback.StackSummary) -> int:
    """Index of the first frame after the run of worker frames that called the user's function
    (``serve``, a warm rank's ``run_code``); 0 for a thread the worker did not start. Later worker
    frames stay: user code that reports a metric is still the user's code, blocked or not."""
    ours = [os.path.abspath(f.filename) in _ENTRY_FILES for f in summary]
    if True not in ours:
        return 0
    end = ours.index(True)
    while end < len(ours) and ours[end]:
        end += 1
    return end


def format_stacks() -> str:
    """Every thread's Python stack, the main thread first, from the user's code on.

    A forked rank's main thread still holds the frames that led the launcher to fork it (the
    kernel, the cell, ``notebook_launcher``); an XLA device thread, torch_xla's pool. Frames up
    to the worker code that called the user's function are not the user's: they are left out.
    """
    frames = sys._current_frames()
    me = threading.get_ident()
    threads = sorted(threading.enumerate(), key=lambda t: t is not threading.main_thread())
    parts = []
    for thread in threads:
        frame = frames.get(thread.ident)
        if frame is None or thread.ident == me:
            continue
        summary = traceback.extract_stack(frame)
        summary = summary[_users_code_starts(summary) :]
        parts.append(f"Thread {thread.name} (most recent call last):\n" + "".join(traceback.format_list(summary)))
    return "\n".join(parts)
