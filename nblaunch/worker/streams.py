"""A rank's output: fds 1/2 and ``sys.stdout``/``sys.stderr`` on the launcher's pipes.

stdout writes each line at once while a rank prints little, so a line printed just before a
crash (a segfault, the OOM killer) is never lost: that is how people find where a rank died.
When it prints a lot (more than ``CHATTY_BYTES`` in one ``FLUSH_EVERY_S``), a write per line
would cost it twice its printing (100k lines: 0.13 s against 0.05 s), so a thread of its own
switches stdout to a 64 KiB buffer and flushes it every ``FLUSH_EVERY_S``, then back to a line
at a time once the rank is quiet again. stderr stays line-buffered: tracebacks, warnings and
logging are few, and what a dying rank must leave behind.

Threads print in real training code (data loading, logging handlers, trackers' upload threads,
tqdm's monitor), and CPython's ``TextIOWrapper`` is not safe for that: a write that flushes
while another thread writes can drop the other's text (CPython gh-119506, fixed only in 3.12.4
and 3.13; 4 threads x 2000 lines lost 7% of them here). So every write, flush and reconfigure
of the rank's two streams holds one lock, and a line is handed on whole: ``print`` writes its
text and its newline in two calls, and what a thread wrote without a newline waits for the
rest of its line (or the next flush) instead of landing in the middle of another thread's.

A forked child of a Jupyter kernel inherits the kernel's stream objects (they write into the
kernel's sockets, where a child's output vanishes) and every ``logging`` handler that holds
them. Everything here must tolerate what libraries put into ``logging``: a handler that cannot
be re-pointed is reported in the rank's log, never allowed to stop the rank.
"""

from __future__ import annotations

import _thread
import ctypes
import functools
import io
import logging
import os
import sys
import threading
import time
from typing import TextIO

FLUSH_EVERY_S = 0.02
CHATTY_BYTES = 4096  # in one FLUSH_EVERY_S: ~200 KB/s, thousands of lines a second
_BUFFER_BYTES = 1 << 16


# Held by every write, flush and reconfigure of the rank's streams (see the module's docstring),
# by the flusher thread, and across any fork the rank makes: a child forked while another thread
# held it would find it held forever, and its first print would hang. Reentrant: a signal handler
# that prints while its thread is inside a write must not deadlock.
_writing = threading.RLock()


class _WholeLines(io.TextIOWrapper):
    """A ``TextIOWrapper`` that threads may share: one lock around it, each thread's line whole."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._partial: dict[int, str] = {}  # thread id -> what it wrote after its last newline

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            return super().write(text)  # TypeError, as a plain stream raises it
        with _writing:
            thread = threading.get_ident()
            held = self._partial.pop(thread, None)
            whole = text if held is None else held + text
            end = whole.rfind("\n") + 1
            if end < len(whole):
                self._partial[thread] = whole[end:]
            if end:
                super().write(whole[:end])
            return len(text)

    def flush(self) -> None:
        """Flush, with the calling thread's unfinished line (``print(..., end="", flush=True)``);
        another thread's stays until its newline comes, or it waits too long (``push_stale``)."""
        with _writing:
            held = self._partial.pop(threading.get_ident(), None)
            if held:
                super().write(held)
            super().flush()

    def flush_all(self) -> None:
        """Flush every thread's unfinished line too: before a fork, before the rank leaves."""
        with _writing:
            self._push(list(self._partial))
            super().flush()

    def push_stale(self, seen: dict[int, str]) -> dict[int, str]:
        """Write out the unfinished lines that have not changed since ``seen`` (the last call's
        answer, a flush period ago): a thread that writes part of a line and stops still shows
        it. Returns what is unfinished now."""
        with _writing:
            stale = [thread for thread, text in self._partial.items() if seen.get(thread) is text]
            self._push(stale)
            if stale:
                super().flush()
            return dict(self._partial)

    def _push(self, threads: list[int]) -> None:
        held = "".join(self._partial.pop(thread) for thread in threads)
        if held:
            super().write(held)

    def reconfigure(self, *args, **kwargs) -> None:
        with _writing:
            super().reconfigure(*args, **kwargs)


def line_stream(fd: int) -> TextIO:
    """A text stream on ``fd`` that writes at every line: a rank that dies loses at most a
    partial line."""
    raw = io.FileIO(fd, "w", closefd=False)
    return _WholeLines(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace", line_buffering=True)


def attach_streams(stdout_fd: int, stderr_fd: int) -> None:
    """Point fds 1/2, ``sys.stdout``/``sys.stderr`` and the logging handlers that wrote to the
    old streams at the launcher's pipes ``stdout_fd``/``stderr_fd``; stdin reads nothing."""
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    (new_out, counted), new_err = _adaptive_stream(1), line_stream(2)
    _keep_flushing(new_out, counted)
    replacement = {
        id(sys.stdout): new_out, id(sys.__stdout__): new_out,
        id(sys.stderr): new_err, id(sys.__stderr__): new_err,
    }
    sys.stdin = open(os.devnull)
    sys.stdout = sys.__stdout__ = new_out
    sys.stderr = sys.__stderr__ = new_err
    for problem in _repoint_logging_handlers(replacement):
        new_err.write(f"nblaunch: {problem}\n")


class _CountingFile(io.FileIO):
    """The file under the rank's stdout, counting what reaches it: called once per line while
    line-buffered, once per 64 KiB or flush when not, so the count costs chatty ranks nothing."""

    written = 0

    def write(self, data) -> int:
        count = super().write(data) or 0
        self.written += count
        return count


def _adaptive_stream(fd: int) -> tuple[TextIO, _CountingFile]:
    raw = _CountingFile(fd, "w", closefd=False)
    buffered = io.BufferedWriter(raw, _BUFFER_BYTES)
    stream = _WholeLines(buffered, encoding="utf-8", errors="backslashreplace", line_buffering=True)
    return stream, raw


def _keep_flushing(stream: TextIO, raw: _CountingFile) -> None:
    """Buffer ``stream`` while the rank is chatty, flushing every ``FLUSH_EVERY_S``, from a
    thread; make forks safe and line-buffered."""

    def flush_forever() -> None:
        seen, unfinished = 0, {}
        while not stream.closed:
            time.sleep(FLUSH_EVERY_S)
            with _writing:
                try:
                    unfinished = stream.push_stale(unfinished)
                    if not stream.line_buffering:
                        super(_WholeLines, stream).flush()  # the buffer, not another thread's half line
                    chatty = raw.written - seen > CHATTY_BYTES
                    if chatty == stream.line_buffering:
                        stream.reconfigure(line_buffering=not chatty)
                except (OSError, ValueError):
                    pass  # the launcher is gone, or the stream was closed under us
                seen = raw.written

    def before_fork() -> None:
        _writing.acquire()
        try:
            stream.flush_all()  # else the child inherits the buffer and prints it a second time
        except (OSError, ValueError):
            pass

    def in_child() -> None:
        _writing.release()
        try:  # no flusher thread there: a DataLoader worker's prints go out a line at a time
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass

    os.register_at_fork(before=before_fork, after_in_parent=_writing.release, after_in_child=in_child)
    _thread.start_new_thread(flush_forever, ())  # bare: see bootstrap.serve


def _repoint_logging_handlers(replacement: dict[int, TextIO]) -> list[str]:
    """Give every stream handler that wrote to an old stream the new one; say which could not."""
    problems = []
    loggers = [logging.getLogger()] + [
        lg for lg in list(logging.Logger.manager.loggerDict.values()) if isinstance(lg, logging.Logger)
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            if not isinstance(handler, logging.StreamHandler):
                continue
            try:
                stream = handler.stream
            except Exception:
                continue  # a stream that cannot even be read is not one of ours
            new = replacement.get(id(stream))
            if new is None:
                continue
            try:
                handler.setStream(new)
            except Exception:
                pass  # e.g. logging._StderrHandler (dill installs one): its stream follows sys.stderr
            try:
                repointed = handler.stream is new
            except Exception:
                repointed = False
            if not repointed:
                problems.append(
                    f"the logging handler {type(handler).__name__} of logger {logger.name!r} could not be "
                    "pointed at this rank's output; what it logs here is lost"
                )
    return problems


def flush_streams() -> None:
    """Flush Python's streams and C's stdio buffers (printf from extensions: NCCL_DEBUG,
    OpenMP), which ``os._exit`` would otherwise throw away."""
    with _writing:
        for stream in (sys.stdout, sys.stderr):
            try:
                getattr(stream, "flush_all", stream.flush)()
            except Exception:
                pass
        try:
            _libc().fflush(None)
        except Exception:
            pass


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # looked up once; forked ranks inherit it
