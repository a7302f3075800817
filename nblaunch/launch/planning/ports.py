"""The rendezvous port: a free one unless the user pins it; and the socket that listens on it."""

from __future__ import annotations

import errno
import socket

from nblaunch.launch.errors import LaunchConfigError


def _bound(addr: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Same option as torch's TCPStore: a port in TIME_WAIT from an earlier launch is fine.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _in_use(addr: str, port: int, err: OSError, named: str) -> LaunchConfigError:
    if err.errno == errno.EADDRINUSE:
        return LaunchConfigError(
            f"{named}{port} is already in use on {addr} (an earlier launch, another notebook or another "
            "program holds it). Pass use_port=None to let nblaunch pick a free port, or pin another one."
        )
    return LaunchConfigError(f"cannot listen on {addr}:{port}: {err.strerror}. Check master_addr, or pass use_port=None.")


def choose_port(master_addr: str, pinned: int | None, *, hosted_here: bool) -> int:
    """Return the port the rendezvous will listen on.

    ``hosted_here`` is False on nodes other than the master's: the port lives elsewhere, so it
    cannot be checked or chosen here.
    """
    if pinned is not None:
        if not hosted_here:
            return pinned
        try:
            _bound(master_addr, pinned).close()
        except OSError as err:
            raise _in_use(master_addr, pinned, err, "use_port=") from None
        return pinned
    try:
        with _bound(master_addr, 0) as sock:
            return sock.getsockname()[1]
    except OSError as err:
        raise LaunchConfigError(
            f"cannot listen on master_addr={master_addr!r}: {err.strerror}. Use an address of "
            "this machine (127.0.0.1 for a single machine)."
        ) from None


def listening_socket(master_addr: str, port: int) -> socket.socket:
    """A socket listening on ``master_addr:port`` (the rendezvous store's), or a clear error if
    the port was taken since it was chosen."""
    try:
        sock = _bound(master_addr, port)
    except OSError as err:
        raise _in_use(master_addr, port, err, "port ") from None
    sock.listen(socket.SOMAXCONN)
    return sock
