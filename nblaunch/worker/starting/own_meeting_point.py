"""A rank meets at the launcher's store, unless the user's code names a meeting point of its own.

Each rank is told that the launcher hosts the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``,
see ``nblaunch.launch.rendezvous``), so torch makes every rank a client of it. Code copied from
torch's tutorials often sets ``MASTER_PORT`` itself, or passes ``init_method="tcp://host:port"``:
no store listens there, and every rank would wait for one until init_process_group's timeout.
Such a call gets torch's own way instead (rank 0 hosts the store at that port), as it would
without a launcher: torch's store factory is wrapped to say "no agent store" for any other port.

Example (what ``bootstrap`` does before the user's function runs)::

    meet_at_the_launchers_store_only("29500")
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from nblaunch.after_import import when_imported
from nblaunch.contract import variables as v

_RENDEZVOUS = "torch.distributed.rendezvous"


def meet_at_the_launchers_store_only(port: str) -> None:
    """From now on, a store at any port but ``port`` is made as torch makes it without a launcher."""
    when_imported(_RENDEZVOUS, functools.partial(_wrap_store_factory, int(port)))


def _wrap_store_factory(launchers_port: int, module: ModuleType) -> None:
    make = getattr(module, "_create_c10d_store", None)
    if make is None or getattr(make, "_nblaunch_wrapped", False):
        return  # a torch without it: every store is the launcher's, as asked

    @functools.wraps(make)
    def create_store(hostname: str, port: int, *args: Any, **kwargs: Any) -> Any:
        if int(port) == launchers_port or os.environ.get(v.TORCHELASTIC_USE_AGENT_STORE) is None:
            return make(hostname, port, *args, **kwargs)
        agent = os.environ.pop(v.TORCHELASTIC_USE_AGENT_STORE)
        try:  # torch reads the variable inside: without it, rank 0 hosts this store
            return make(hostname, port, *args, **kwargs)
        finally:
            os.environ[v.TORCHELASTIC_USE_AGENT_STORE] = agent

    create_store._nblaunch_wrapped = True  # type: ignore[attr-defined]
    module._create_c10d_store = create_store
