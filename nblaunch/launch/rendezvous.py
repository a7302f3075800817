"""The rendezvous store of a launch, hosted by the launcher for as long as one attempt runs.

torch's ``env://`` rendezvous makes rank 0 host the TCPStore unless ``TORCHELASTIC_USE_AGENT_STORE``
says an agent hosts it, as torchrun's does. In rank 0 the store dies the moment rank 0 returns:
a peer still inside ``init_process_group`` (reading addresses from the store, connecting its
pairs) then fails with "Connection reset by peer" although nothing went wrong -- the first
function anyone tries (join a group, return the rank) failed that way now and then. Hosted here
it outlives every rank of the attempt, and ``TORCH_DIST_INIT_BARRIER=1`` (``LaunchPlan.rank_environ``)
keeps every rank in ``init_process_group`` until every rank's group is connected. A rank that
returns early still breaks a peer's *later* collective at once, so uneven work is named, not hung.

Example (what ``LocalHome.attempt`` does around starting the ranks)::

    with hosted_store(plan):
        workers = starter.start(plan, environ)
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator

from nblaunch.launch.planning import ports
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting import fdtable


def hosts_store(plan: LaunchPlan) -> bool:
    """Whether this node's launcher hosts the store: node 0's, unless torch_xla meets its own way."""
    return plan.node_rank == 0 and plan.device_kind != "xla"


@contextlib.contextmanager
def hosted_store(plan: LaunchPlan) -> Iterator[None]:
    """The store on ``plan.master_addr:plan.master_port`` while the block runs (nothing where
    ``hosts_store`` is False). Raises LaunchConfigError if the port was taken meanwhile."""
    if not hosts_store(plan):
        yield
        return
    # Deferred: importing nblaunch never imports torch; the ranks forked from here then inherit it.
    import torch.distributed as dist

    sock = ports.listening_socket(plan.master_addr, plan.master_port)
    fd = sock.detach()
    fdtable.hold([fd])  # a rank forked while the store runs must not keep the port open after it
    try:
        store = dist.TCPStore(plan.master_addr, plan.master_port, None, True, datetime.timedelta(minutes=30),
                              wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        fdtable.close([fd])
        raise
    try:
        yield
    finally:
        fdtable.forget([fd])  # before the store closes it: the number may be reused at once
        del store
