"""Saying what went wrong when the failing rank's own error is only a symptom."""

from __future__ import annotations

import re

from nblaunch.launch.errors import RankFailure

_COLLECTIVE = re.compile(r'distributed_c10d\.py", line \d+, in (\w+)')

UNEVEN_WORK_HINT = (
    "This is the usual sign of uneven work: the ranks ran different numbers of steps or batches. "
    "Give every rank the same number of batches (a prepared DataLoader does, with even_batches=True; "
    "or drop_last=True), or let ranks that run out wait for the others with "
    "Accelerator.join_uneven_inputs / torch.distributed.algorithms.Join."
)


def explain_peer_left(failure: RankFailure, finished: list[int]) -> RankFailure:
    """``failure`` is a communication error (a peer went away) and the ranks ``finished`` ended
    normally before the launch did: say that they left while this rank still waited for them."""
    found = _COLLECTIVE.findall(failure.traceback)
    where = f"in {found[-1]}()" if found else "in a collective"
    who = " and ".join(f"rank {r}" for r in finished)
    failure.reason = f"still {where} when {who} finished and left: {failure.reason}"
    failure.hint = UNEVEN_WORK_HINT
    return failure
