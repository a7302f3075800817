"""The rendezvous port: a free one unless the user pins it."""

from __future__ import annotations

import errno
import socket

from nblaunch.launch.errors import LaunchConfigError


def _bind(addr: str, port: int) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option as torch's TCPStore: a port in TIME_WAIT from an earlier launch is fine.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        return sock.getsockname()[1]


def choose_port(master_addr: str, pinned: int | None, *, hosted_here: bool) -> int:
    """Return the port the rendezvous will listen on.

    ``hosted_here`` is False on nodes other than the master's: the port lives elsewhere, so it
    cannot be checked or chosen here.
    """
    if pinned is not None:
        if not hosted_here:
            return pinned
        try:
            _bind(master_addr, pinned)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise LaunchConfigError(
                    f"use_port={pinned} is already in use on {master_addr} (an earlier launch, "
                    "another notebook or another program holds it). Pass use_port=None to let "
                    "nblaunch pick a free port, or pin another one."
                ) from None
            raise LaunchConfigError(
                f"cannot listen on {master_addr}:{pinned}: {err.strerror}. Check master_addr, or "
                "pass use_port=None."
            ) from None
        return pinned
    try:
        return _bind(master_addr, 0)
    except OSError as err:
        raise LaunchConfigError(
            f"cannot listen on master_addr={master_addr!r}: {err.strerror}. Use an address of "
            "this machine (127.0.0.1 for a single machine)."
        ) from None
