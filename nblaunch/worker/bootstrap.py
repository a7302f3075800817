"""What runs inside every worker process, forked or spawned, before and after the user's function.

In order: join a process group of its own (the parent, not every rank at once, decides what an
interrupt does), die with the parent, write to plain file descriptors the parent reads (a forked
child of a Jupyter kernel would otherwise write into the kernel's stream objects, where output
vanishes), set the rank's environment, answer stack-dump requests, run the function, send back
its result or its exception, and leave with ``os._exit`` (never the parent's atexit hooks).
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import pickle
import signal
import sys
import _thread
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import cloudpickle

from nblaunch import wire
from nblaunch.worker import channel, lifeline
from nblaunch.worker.progress import install_tqdm_hook


@dataclass
class WorkerSettings:
    """Everything one rank needs to know; picklable, so spawn can send it."""

    rank: int  # local rank on this node
    environ: dict[str, str]  # RANK, WORLD_SIZE, MASTER_PORT, ... added to the rank's environment
    threads: int | None  # intra-op threads, or None to leave the user's choice alone
    parent_pid: int
    sys_path: list[str]


# Text in messages of errors that a rank gets because a peer died, not because of its own bug.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


def run_forked(
    settings: WorkerSettings,
    function: Callable,
    args: tuple,
    *,
    stdout_fd: int,
    stderr_fd: int,
    event_fd: int,
    control_fd: int,
    launcher_fds: list[int],
) -> NoReturn:
    """Entry point in a freshly forked child. Never returns into the launcher's code."""
    try:
        settle_forked_child(settings.parent_pid, launcher_fds)
        _attach_streams(stdout_fd, stderr_fd)
        _run(settings, function, args, event_fd, control_fd)
    finally:
        os._exit(70)


def settle_forked_child(parent_pid: int, launcher_fds: list[int]) -> None:
    """First steps of any process the launcher forks: a process group of its own, death with
    the launcher, and none of the launcher's pipe ends (holding them would hide EOFs)."""
    os.setpgid(0, 0)
    lifeline.die_with_parent(parent_pid)
    for fd in launcher_fds:
        try:
            os.close(fd)
        except OSError:
            pass


def line_stream(fd: int):
    """A text stream on ``fd`` that flushes at every line: a rank that dies loses at most a
    partial line."""
    return open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)


def main_spawned(argv: list[str]) -> NoReturn:
    """Entry point of ``python -m nblaunch.worker CONTROL_FD EVENT_FD PARENT_PID``."""
    try:
        control_fd, event_fd, parent_pid = (int(a) for a in argv)
        lifeline.die_with_parent(parent_pid)
        _attach_streams(1, 2)
        settings, packed = pickle.loads(_read_payload(control_fd))
        sys.path[:] = settings.sys_path  # so functions pickled by reference import as in the parent
        function, args = load_payload(packed)
        _run(settings, function, args, event_fd, control_fd)
    finally:
        os._exit(70)


class _PayloadUnpickler(pickle.Unpickler):
    """Unpickles a spawn payload; storages the launcher put in shared memory are mapped, not
    copied (see ``nblaunch.launch.pickling.package``)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self._storages: dict[tuple[int, int], Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        tag, owner, fd, size, dtype = pid
        if tag != wire.SHARED_STORAGE:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        untyped = self._storages.get((owner, fd))
        if untyped is None:
            import torch

            # The launcher's descriptor, opened anew: the same shared pages, mapped here.
            local = os.open(f"/proc/{owner}/fd/{fd}", os.O_RDWR)
            try:
                untyped = torch.UntypedStorage._new_shared_fd_cpu(local, size)
            finally:
                os.close(local)
            self._storages[(owner, fd)] = untyped
        if dtype is None:
            return untyped
        import torch

        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def load_payload(packed: bytes) -> tuple[Callable, tuple]:
    """(function, args) from the bytes ``nblaunch.launch.pickling.package`` made."""
    return _PayloadUnpickler(packed).load()


def _read_payload(control_fd: int) -> bytes:
    reader = wire.FrameReader()
    while True:
        chunk = os.read(control_fd, 1 << 20)
        if not chunk:
            os._exit(1)  # the launcher went away before sending the work
        for kind, body in reader.feed(chunk):
            if kind == wire.PAYLOAD:
                return body


def _attach_streams(stdout_fd: int, stderr_fd: int) -> None:
    """Point fds 1/2 and sys.stdout/stderr (and logging handlers using them) at the parent's pipes."""
    if stdout_fd != 1:
        os.dup2(stdout_fd, 1)
        os.close(stdout_fd)
    if stderr_fd != 2:
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    new_out, new_err = line_stream(1), line_stream(2)
    replacement = {
        id(sys.stdout): new_out, id(sys.__stdout__): new_out,
        id(sys.stderr): new_err, id(sys.__stderr__): new_err,
    }
    for logger in [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in replacement:
                handler.setStream(replacement[id(stream)])
    sys.stdin = open(os.devnull)
    sys.stdout = sys.__stdout__ = new_out
    sys.stderr = sys.__stderr__ = new_err


def _run(settings: WorkerSettings, function: Callable, args: tuple, event_fd: int, control_fd: int) -> NoReturn:
    os.environ.update(settings.environ)
    lifeline.set_process_name(str(settings.rank))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if settings.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(settings.threads)
        torch = sys.modules.get("torch")  # forked from a parent that imported torch
        if torch is not None:
            torch.set_num_threads(settings.threads)
    channel.open_channel(event_fd, settings.rank)
    prepare_process()
    code = serve(function, args, control_fd, event_fd)
    flush_streams()
    os._exit(code)


def prepare_process() -> None:
    """What every process hosting ranks needs once, whatever started it."""
    install_tqdm_hook()  # tqdm bars become progress events, drawn by the launcher
    # A C-level dump for ranks whose Python threads cannot answer (the GIL held by C code).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def serve(function: Callable, args: tuple, control_fd: int, event_fd: int) -> int:
    """Run one rank's function and send back its result or failure; returns an exit code.

    The channel must already point at ``event_fd`` for the calling thread.
    """
    # A bare thread: threading.Thread.start() waits until the new thread runs, which on busy
    # cores is a millisecond of every launch spent before the user's function starts.
    _thread.start_new_thread(_watch_launcher, (control_fd, event_fd))
    try:
        result = function(*args)
    except SystemExit as exit_request:  # sys.exit(0) is a clean finish with no result
        if exit_request.code in (None, 0):
            _send_result(None)
            return 0
        _send_failure(exit_request, f"called sys.exit({exit_request.code!r})")
        return 1
    except BaseException as error:
        _send_failure(error)
        return 1
    try:
        _send_result(result)
    except Exception as error:
        _send_failure(error, f"returned a {type(result).__name__} that cannot be sent back: {error}")
        return 1
    return 0


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _send_result(result: Any) -> None:
    try:
        body = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # classes and lambdas defined in a notebook need pickling by value
        body = cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    channel.send(wire.RESULT, body)


def _send_failure(error: BaseException, reason: str | None = None) -> None:
    """Report a failure in two frames: what and when at once, then the traceback.

    Formatting a traceback reads source files (linecache) and pickling runs arbitrary code;
    either can stall (a disk under load was seen to). The first frame lets the launcher stop
    the other ranks at once; it then waits a moment for the second.
    """
    report = {
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "reason": reason or f"{type(error).__name__}: {error}",
        "traceback": "",
        "exception": None,
        "time": time.monotonic(),  # system-wide clock: the launcher orders failures of all ranks by it
        "collateral": _caused_by_peer(error),
        "final": False,
    }
    channel.send(wire.ERROR, pickle.dumps(report))
    report["traceback"] = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        pickled = cloudpickle.dumps(error)
        pickle.loads(pickled)  # an exception that pickles but cannot be rebuilt is no use
        report["exception"] = pickled
    except Exception:
        pass
    report["final"] = True
    channel.send(wire.ERROR, pickle.dumps(report))


def _caused_by_peer(error: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if dist_error is not None and isinstance(error, dist_error):
        return True
    message = str(error)
    return any(marker in message for marker in _PEER_GONE)


def _watch_launcher(control_fd: int, event_fd: int) -> None:
    """Answer stack-dump requests; exit when the launcher's end of the pipe closes."""
    reader = wire.FrameReader()
    while True:
        try:
            chunk = os.read(control_fd, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            os._exit(1)  # the launcher is gone; on Linux PR_SET_PDEATHSIG has usually acted first
        for kind, _ in reader.feed(chunk):
            if kind == wire.DUMP_STACKS:
                channel.send(wire.STACKS, format_stacks().encode(), fd=event_fd)


_WORKER_DIR = os.path.dirname(os.path.abspath(__file__))


def format_stacks() -> str:
    """Every thread's Python stack, the main thread first, from the user's code on.

    A forked rank's main thread still holds the frames that led the launcher to fork it (the
    kernel, the cell, ``notebook_launcher``); an XLA device thread, torch_xla's pool. Frames up
    to the last one of nblaunch's worker code are not the user's: they are left out.
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
        ours = [i for i, f in enumerate(summary) if os.path.dirname(os.path.abspath(f.filename)) == _WORKER_DIR]
        if ours:
            summary = summary[ours[-1] + 1 :]
        parts.append(f"Thread {thread.name} (most recent call last):\n" + "".join(traceback.format_list(summary)))
    return "\n".join(parts)
