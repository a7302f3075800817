"""The rendezvous store of a launch, hosted by the launcher for as long as one attempt runs.

torch's ``env://`` rendezvous makes rank 0 host the TCPStore unless ``TORCHELASTIC_USE_AGENT_STORE``
says an agent hosts it, as torchrun's does. In rank 0 the store dies the moment rank 0 returns:
a peer still inside ``init_process_group`` (reading addresses from the store, connecting its
pairs) then fails with "Connection reset by peer" although nothing went wrong -- the first
function anyone tries (join a group, return the rank) failed that way now and then. Hosted here
it outlives every rank of the attempt, and ``TORCH_DIST_INIT_BARRIER=1`` (``LaunchPlan.rank_environ``)
keeps every rank in ``init_process_group`` until every rank's group is connected. A rank that
returns early still breaks a peer's *later* collective at once, so uneven work is named, not hung.

The store serves from a thread of the launcher, and a thread must never run while the launcher
forks a rank: it resolves each client's address with glibc's resolver, and a rank forked while
it held the resolver's lock would wait for that lock for ever, in its own first connection to the
store (seen: 1 launch in a few hundred). So the socket listens before the ranks start (a rank's
connection waits in its backlog) and the store begins to serve once every rank is forked.

Example (what ``LocalCluster.attempt`` does around starting the ranks)::

    with Rendezvous(plan) as rendezvous:     # listening, nothing served yet
        workers = starter.start(plan, environ)
        rendezvous.serve()                   # every rank forked: the store's thread may start
"""

from __future__ import annotations

import datetime
from typing import Any

from nblaunch.launch.planning import ports
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes import fdtable


def hosts_store(plan: LaunchPlan) -> bool:
    """Whether this node's launcher hosts the store: node 0's, unless torch_xla meets its own way."""
    return plan.node_rank == 0 and plan.device_kind != "xla"


class Rendezvous:
    """The store's socket from ``__enter__``, the store itself from ``serve()``, both gone at
    ``__exit__``. Does nothing where ``hosts_store`` is False."""

    def __init__(self, plan: LaunchPlan) -> None:
        self._plan = plan
        self._fd: int | None = None
        self._store: Any = None

    def __enter__(self) -> Rendezvous:
        if hosts_store(self._plan):
            # Imported now, before the ranks are forked (they inherit it): imported in serve(),
            # once they run, it held up the supervisor, and a kernel that had not imported torch
            # showed nothing of a short launch until it was over. The cell already shows the
            # launch; the import changes nothing in os.environ.
            import torch.distributed  # noqa: F401  deferred: importing nblaunch never imports torch

            sock = ports.listening_socket(self._plan.master_addr, self._plan.master_port)  # clear error if taken
            self._fd = sock.detach()
            fdtable.hold([self._fd])  # no rank forked from here keeps the port open
        return self

    def serve(self) -> None:
        """Start serving, on a thread of this process: only once no more ranks are to be forked."""
        if self._fd is None or self._store is not None:
            return
        import torch.distributed as dist  # imported by __enter__ already

        # From here the store owns the socket and closes it: the fork hook must forget it first.
        fdtable.forget([self._fd])
        plan = self._plan
        try:
            self._store = dist.TCPStore(plan.master_addr, plan.master_port, None, True,
                                        datetime.timedelta(minutes=30), wait_for_workers=False,
                                        master_listen_fd=self._fd)
        except BaseException:
            fdtable.hold([self._fd])  # still ours: __exit__ closes it
            raise

    def __exit__(self, *exc_info: object) -> None:
        if self._store is not None:
            self._store = None  # its server stops and closes the socket
        elif self._fd is not None:
            fdtable.close([self._fd])  # never served: the socket is still ours
        self._fd = None
