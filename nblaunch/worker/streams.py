"""A rank's output: fds 1/2 and ``sys.stdout``/``sys.stderr`` on the launcher's pipes.

stdout writes each line at once while a rank prints little, so a line printed just before a
crash (a segfault, the OOM killer) is never lost: that is how people find where a rank died.
When it prints a lot (more than ``CHATTY_BYTES`` in one ``FLUSH_EVERY_S``), a write per line
would cost it twice its printing (100k lines: 0.13 s against 0.05 s), so a thread of its own
switches stdout to a 64 KiB buffer and flushes it every ``FLUSH_EVERY_S``, then back to a line
at a time once the rank is quiet again. stderr stays line-buffered: tracebacks, warnings and
logging are few, and what a dying rank must leave behind.

Threads print in real training code (data loading, logging handlers, trackers' upload threads,
tqdm's monitor), and CPython's ``TextIOWrapper`` drops text under them (CPython gh-119506, fixed
in 3.12.4 and 3.13): a write that would take its pending text past ``_CHUNK_SIZE`` hands the
pending text to the buffer first, and if another thread writes while that hand-over waits (for
the buffer's lock, held by a flush), the first thread then replaces the other's text with its
own. 4 threads x 2000 lines lost 7% of them here. The rank's streams get a chunk size no write
reaches, so that branch never runs: pending text goes to the buffer only at a newline (a
line-buffered stream), at a flush (the flusher's, every 20 ms when buffered) or on the way out,
each of which takes the pending text atomically. As in any Python process, ``print``'s text and
its newline are two writes, and another thread's may come between them; nothing is lost.

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
_NEVER_REACHED = 1 << 40  # a TextIOWrapper chunk size: see the module's docstring
CHATTY_BYTES = 4096  # in one FLUSH_EVERY_S: ~200 KB/s, thousands of lines a second
_BUFFER_BYTES = 1 << 16


def line_stream(fd: int) -> TextIO:
    """A text stream on ``fd`` that flushes at every line: a rank that dies loses at most a
    partial line."""
    stream = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    stream._CHUNK_SIZE = _NEVER_REACHED
    return stream


def attach_streams(stdout_fd: int, stderr_fd: int,
                   handlers: list[tuple[logging.Handler, str]] | None = None) -> None:
    """Point fds 1/2, ``sys.stdout``/``sys.stderr`` and the logging handlers that wrote to the
    old streams at the launcher's pipes ``stdout_fd``/``stderr_fd``; stdin reads nothing.
    ``handlers``: those :func:`std_stream_handlers` found in the launcher before the fork (None:
    look at every logger here)."""
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
    for problem in _repoint_logging_handlers(replacement, std_stream_handlers() if handlers is None else handlers):
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
    stream = io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace", line_buffering=True)
    stream._CHUNK_SIZE = _NEVER_REACHED
    return stream, raw


# Held while the flusher writes and across any fork the rank makes: a child forked while the
# flusher held the buffer's lock would find it held forever, and its first print would hang.
_flushing = threading.Lock()


def _keep_flushing(stream: TextIO, raw: _CountingFile) -> None:
    """Buffer ``stream`` while the rank is chatty, flushing every ``FLUSH_EVERY_S``, from a
    thread; make forks safe and line-buffered."""

    def flush_forever() -> None:
        seen = 0
        while not stream.closed:
            time.sleep(FLUSH_EVERY_S)
            with _flushing:
                try:
                    if not stream.line_buffering:
                        stream.flush()
                    chatty = raw.written - seen > CHATTY_BYTES
                    if chatty == stream.line_buffering:
                        stream.reconfigure(line_buffering=not chatty)
                except (OSError, ValueError):
                    pass  # the launcher is gone, or the stream was closed under us
                seen = raw.written

    def before_fork() -> None:
        _flushing.acquire()
        try:
            stream.flush()  # else the child inherits the buffer and prints it a second time
        except (OSError, ValueError):
            pass

    def in_child() -> None:
        _flushing.release()
        try:  # no flusher thread there: a DataLoader worker's prints go out a line at a time
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass

    os.register_at_fork(before=before_fork, after_in_parent=_flushing.release, after_in_child=in_child)
    _thread.start_new_thread(flush_forever, ())  # bare: see bootstrap.serve


def std_stream_handlers() -> list[tuple[logging.Handler, str]]:
    """Every logging stream handler that writes to ``sys.stdout`` or ``sys.stderr`` (or their
    originals), with its logger's name. The launcher asks before it forks: there, reading every
    logger (a kernel with torch has over a hundred) costs nothing, while a forked rank that read
    them all would copy each page they sit on, 2 ms of every rank's start."""
    streams = {id(s) for s in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__)}
    found = []
    loggers = [logging.getLogger()] + [
        lg for lg in list(logging.Logger.manager.loggerDict.values()) if isinstance(lg, logging.Logger)
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            if not isinstance(handler, logging.StreamHandler):
                continue
            try:
                if id(handler.stream) in streams:
                    found.append((handler, logger.name))
            except Exception:
                continue  # a stream that cannot even be read is not one of ours
    return found


def _repoint_logging_handlers(replacement: dict[int, TextIO], handlers: list[tuple[logging.Handler, str]]) -> list[str]:
    """Give each of ``handlers`` that wrote to an old stream the new one; say which could not."""
    problems = []
    for handler, logger_name in handlers:
        try:
            stream = handler.stream
        except Exception:
            continue
        new = replacement.get(id(stream))
        if new is None:
            continue  # dill's _StderrHandler: its stream follows sys.stderr, already the new one
        try:
            handler.setStream(new)
        except Exception:
            pass
        try:
            repointed = handler.stream is new
        except Exception:
            repointed = False
        if not repointed:
            problems.append(
                f"the logging handler {type(handler).__name__} of logger {logger_name!r} could not be "
                "pointed at this rank's output; what it logs here is lost"
            )
    return problems


def flush_streams() -> None:
    """Flush Python's streams and C's stdio buffers (printf from extensions: NCCL_DEBUG,
    OpenMP), which ``os._exit`` would otherwise throw away."""
    with _flushing:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:
            _libc().fflush(None)
        except Exception:
            pass


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # looked up once; forked ranks inherit it
