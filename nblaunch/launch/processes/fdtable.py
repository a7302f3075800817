"""The launcher's own file descriptors, closed in every process forked from the launcher's.

Pipe and socket ends and memfds of every live launch are registered the moment they are made.
A process forked from the kernel -- a rank of any launch, or the user's own DataLoader worker or
fork-based pool -- must hold none of them: a held write end hides a rank's EOF, a held pipe end
makes an unrelated process look like part of a launch (see ``nblaunch.proctree``), and a held
memfd keeps its memory after the launch. An at-fork hook closes them in every child; the fork
that starts a rank keeps only that rank's own ends (``forking``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Iterable, Iterator

_fds: set[int] = set()
_keep_in_child: frozenset[int] = frozenset()
_lock = threading.Lock()


def hold(fds: Iterable[int]) -> None:
    """Register descriptors the launcher just made (a pidfd)."""
    with _lock:
        _fds.update(fds)


def new_pipe() -> tuple[int, int]:
    """``os.pipe()``, registered before any fork of ours can copy it."""
    with _lock:
        ends = os.pipe()
        _fds.update(ends)
    return ends


def new_socketpair() -> tuple[int, int]:
    """Two connected Unix stream sockets (a two-way pipe that can also carry descriptors),
    registered before any fork of ours can copy them."""
    with _lock:
        one, other = socket.socketpair()
        ends = (one.detach(), other.detach())
        _fds.update(ends)
    return ends


def new_memfd(name: str) -> int:
    """An anonymous memory file, registered before any fork of ours can copy it."""
    with _lock:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        _fds.add(fd)
    return fd


def close(fds: Iterable[int]) -> None:
    """Close registered descriptors and forget them. A number not (or no longer) registered is
    left alone: closing twice must never close what reused the number meanwhile."""
    with _lock:
        for fd in fds:
            if fd not in _fds:
                continue
            _fds.discard(fd)
            try:
                os.close(fd)
            except OSError:
                pass


def forget(fds: Iterable[int]) -> None:
    """Stop closing these in children, without closing them here: whoever they were handed to
    (a rendezvous store owns its listening socket) closes them."""
    with _lock:
        _fds.difference_update(fds)


@contextlib.contextmanager
def forking(keep: Iterable[int]) -> Iterator[None]:
    """Around the ``os.fork()`` that starts a rank: the child keeps ``keep`` (its own ends) and
    closes every other registered descriptor. No descriptor is made or closed meanwhile."""
    global _keep_in_child
    with _lock:
        _keep_in_child = frozenset(keep)
        try:
            yield
        finally:
            _keep_in_child = frozenset()


def _after_fork_in_child() -> None:
    global _lock, _keep_in_child
    for fd in _fds - _keep_in_child:
        try:
            os.close(fd)
        except OSError:
            pass
    _fds.clear()  # a launch made in this child registers its own
    _keep_in_child = frozenset()
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
