"""A warm rank's frames about its calls, as the events a pool's display receives.

Example::

    event = call_event(1, wire.CALL_FAILED, body)   # CallFailed(rank=1, call_id=..., failure=...)
"""

from __future__ import annotations

import pickle

from nblaunch import wire
from nblaunch.contract.failure import RankFailure
from nblaunch.events import CallFailed, CallFinished, CallSteps, Event, GroupReleased

ANSWERS = (wire.CALL_RESULT, wire.CALL_FAILED)  # the call is over on that rank
KINDS = ANSWERS + (wire.STEPS, wire.RELEASED)


def call_event(rank: int, kind: bytes, body: bytes) -> Event | RankFailure:
    """The event for one of ``KINDS``; a ``RankFailure`` for an answer that cannot be read here."""
    try:
        value = pickle.loads(body)
    except Exception as error:
        return RankFailure(rank, f"its call's answer could not be unpickled here: {error!r}")
    if kind == wire.CALL_RESULT:
        return CallFinished(rank=rank, call_id=value[0], result=value[1])
    if kind == wire.CALL_FAILED:
        value[1].rank = rank  # numbered by the pipe it came on
        return CallFailed(rank=rank, call_id=value[0], failure=value[1])
    if kind == wire.STEPS:
        return CallSteps(rank=rank, call_id=value[0], steps=value[1])
    return GroupReleased(rank=rank, why_not=value)
