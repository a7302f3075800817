"""A generation of the launch server: forked by the base, it imports what the kernel's ranks
will import, then forks ranks that find it all loaded.

The kernel asks the base for one when its list of modules or its environment changed
(``launch/ahead/launch_server``). A generation imports with the kernel's environment (a
library reads variables at import), one package at a time (``server/loading``), telling the
kernel which package it is on (``SERVER_LOADING``) and what came of it (``SERVER_LOADED``); it
answers a request for a rank between two packages (the kernel sends none before ``SERVER_READY``,
but a generation never keeps one waiting longer than a package). A package that starts CUDA or a
thread, or reads a rank's own variables (``RANK``: not set here, and the library would keep the
wrong value), poisons it: it says so and exits, and the kernel asks for another generation
without that package. Then ``SERVER_READY``, and it serves like the base.

Example (what the base runs in the forked child)::

    run_generation(socket_fd, 1, kernel_environ, ["torch._dynamo", "sklearn", "sklearn.base"], added)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import time
from typing import Iterator, NoReturn

from nblaunch import wire
from nblaunch.contract.variables import TORCH_WARM_POOL
from nblaunch.server.loading import OK, load_package, packages_in_order, reads_rank_variables
from nblaunch.server.serving import Server
from nblaunch.worker import lifeline


def run_generation(socket_fd: int, generation_id: int, environ: dict[str, str], names: list[str],
                   added: dict[str, str]) -> NoReturn:
    """The body of a generation, in the process the base forked for it."""
    lifeline.die_with_parent(os.getppid())  # the base's children die with it, as its ranks do
    lifeline.name_process("nblaunch-server")
    os.environ.clear()
    os.environ.update({**added, **environ})
    os.environ.setdefault(TORCH_WARM_POOL, "0")  # as in the base: imports start no compile workers
    server = Server(socket.socket(fileno=socket_fd), added, make_generation=run_generation)  # the next, from it
    with _one_intra_op_thread():
        _load_all(server, names)
    wire.write_frame(server.fd, wire.SERVER_READY)
    server.serve_forever()


def _load_all(server: Server, names: list[str]) -> None:
    for package, modules in packages_in_order(names):
        server.poll(0)  # a rank asked for meanwhile starts now, before the next package
        wire.write_frame(server.fd, wire.SERVER_LOADING, pickle.dumps(package))
        started = time.monotonic()
        verdict, environ = load_package(modules, watch_threads=True)
        if verdict == OK:
            verdict = reads_rank_variables(environ) or OK
        os.environ.update(environ.written)  # for the packages after it, and the ranks
        server.added.update(environ.written)
        wire.write_frame(server.fd, wire.SERVER_LOADED, pickle.dumps((package, verdict, time.monotonic() - started)))
        if verdict != OK and not verdict.startswith("raised"):
            os._exit(0)  # no rank may come from here any more: the kernel asks for another generation


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """An import that runs a torch op would start GNU OpenMP's pool for this thread, and every
    rank forked from it would hang in its first parallel op (see ``launch/starting/
    forking_thread``): with one thread no pool is made. The count is put back for the ranks."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    if threads is not None:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(threads)
