"""A rank's output: fds 1/2 and ``sys.stdout``/``sys.stderr`` on the launcher's pipes.

A forked child of a Jupyter kernel inherits the kernel's stream objects (they write into the
kernel's sockets, where a child's output vanishes) and every ``logging`` handler that holds
them. Everything here must tolerate what libraries put into ``logging``: a handler that cannot
be re-pointed is reported in the rank's log, never allowed to stop the rank.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from typing import TextIO


def line_stream(fd: int) -> TextIO:
    """A text stream on ``fd`` that flushes at every line: a rank that dies loses at most a
    partial line."""
    return open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)


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
    new_out, new_err = line_stream(1), line_stream(2)
    replacement = {
        id(sys.stdout): new_out, id(sys.__stdout__): new_out,
        id(sys.stderr): new_err, id(sys.__stderr__): new_err,
    }
    sys.stdin = open(os.devnull)
    sys.stdout = sys.__stdout__ = new_out
    sys.stderr = sys.__stderr__ = new_err
    for problem in _repoint_logging_handlers(replacement):
        new_err.write(f"nblaunch: {problem}\n")


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
