"""The launch server's base: ``python -m nblaunch.server.base_process SOCKET_FD KERNEL_PID``.

A kernel that initialised CUDA (or asked for ``start_method="spawn"``) cannot fork its ranks:
a forked child's CUDA is broken. A fresh interpreter per rank works but costs seconds each
launch (``import torch``). So the kernel starts this process once (``launch/ahead``),
as soon as a launch could need it: it imports torch, never touches CUDA, says it is ready, then
forks ranks on request (``server/serving``) and, when the kernel asks, generations: children
that import what the kernel's ranks will import before forking them (``server/generation``).

It dies with the kernel (the death signal, and EOF on the socket); its ranks and generations
die with it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import NoReturn

from nblaunch import wire
from nblaunch.contract.variables import TORCH_WARM_POOL
from nblaunch.preimport import import_for_ranks
from nblaunch.server.generation import run_generation
from nblaunch.server.serving import Server
from nblaunch.worker import lifeline

_FIRST = ("torch", "torch.distributed")  # before it says it is ready


def main(argv: list[str]) -> NoReturn:
    socket_fd, kernel_pid = (int(a) for a in argv)
    lifeline.die_with_parent(kernel_pid)
    lifeline.name_process("nblaunch-server")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel to handle
    # torch's compile workers started by an import would make this a process with threads and
    # children of its own: the ranks, forked from here, start them if they compile.
    os.environ.setdefault(TORCH_WARM_POOL, "0")
    added: dict[str, str] = {}  # what the imports set in os.environ: the ranks get it too
    for module in _FIRST:
        added.update(import_for_ranks(module))
    wire.write_frame(socket_fd, wire.SERVER_READY)
    Server(socket.socket(fileno=socket_fd), added, make_generation=run_generation).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
