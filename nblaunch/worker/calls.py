"""A warm rank: it serves calls from the launcher until the launcher closes it.

The launcher starts warm ranks as a launch whose function is :func:`serve_calls`. The rank's
watch thread (which also answers stack requests) hands each ``CALL`` frame from the control
socket to this module's queue, with the memfds that carry its big tensors and arrays (mapped
copy-on-write, as a spawned rank maps its payload); the main thread runs the call, flushes
its output (so every line of a call is in the pipe before its answer), and sends
``CALL_RESULT``, or ``CALL_FAILED`` with the failure when the call raised. An error is the
call's outcome, as it is a notebook cell's: the rank, its process group and everything it
holds stay, and it serves the next call. ``CLOSE`` ends the loop; the rank then leaves like any
finished rank.

A call may name the ranks it runs on (``only``): the others answer at once with nothing, and in
the named ones the collectives of the pool's group are refused for the call (``subset_guard``),
since the ranks left out would never join them. The launcher's other requests during a call
(interrupt, release the group: ``control``) come through the watch thread to ``step_stop`` and
``pool.group``.

The ranks form their process group before the first call (``pool.group``). Every call starts
with a clean training state: the process group stays, user objects stay
(in the namespace of :func:`run_code` and in whatever the functions keep), but an interrupted
loop's bookkeeping (the active DataLoader, accumulation counters) does not carry over. Its training
steps are the call's own (``step_clock.begin_call``), sent before its answer.

Example (what ``WarmRanks.run(f, 3)`` makes a rank do)::

    deliver(wire.CALL, package((1, f, (3,), None)).data)  # from the watch thread
    serve_calls()  # runs f(3), sends (1, result); returns on CLOSE
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
import os
import pickle
import queue
from typing import Any, Callable

from nblaunch import wire
from nblaunch.contract import variables as v
from nblaunch.worker import channel, payload, step_clock, step_stop
from nblaunch.worker.warm import device_check, failed_frames, group
from nblaunch.worker.warm.subset_guard import collectives_refused
from nblaunch.worker.reports import describe, failure_record
from nblaunch.worker.streams import flush_streams

_inbox: queue.SimpleQueue = queue.SimpleQueue()
namespace: dict[str, Any] = {"__name__": "__main__"}  # what ``%%distributed`` cells define, per rank
_before_each_call: list[Callable[[], None]] = []
_released: list[bool] = []  # the launcher released this call's group (a refused release is not one)


def before_each_call(hook: Callable[[], None]) -> None:
    """Run ``hook()`` before every call this rank serves. The training side registers the
    forgetting of an interrupted loop's bookkeeping when it is imported (nothing to forget
    before that), so this module never imports it."""
    if hook not in _before_each_call:
        _before_each_call.append(hook)


def deliver(kind: bytes, body: bytes, shared: tuple[dict[int, int], list] | None = None) -> None:
    """Called by the watch thread for each CALL or CLOSE frame, with the memfds the call's
    pickle refers to (``{launcher's fd number: ours}``, out-of-band buffers), if any."""
    _inbox.put((kind, body, shared))


def control(kind: bytes, body: bytes) -> None:
    """The launcher's requests during a call, on the watch thread: INTERRUPT, RELEASE."""
    if kind == wire.INTERRUPT:
        step_stop.interrupt(pickle.loads(body))
    elif kind == wire.RELEASE:
        why_not = group.release_group()
        if not why_not:
            _released.append(True)
        channel.send(wire.RELEASED, pickle.dumps(why_not))


def serve_calls() -> None:
    """The function a warm rank runs: it joins the pool's process group, then serves calls, one
    at a time, until CLOSE."""
    group.form_pool_group()
    step_stop.install()
    rank = int(os.environ[v.RANK])
    while True:
        kind, body, shared = _inbox.get()
        if kind == wire.CLOSE:
            return None
        _serve_one(rank, body, shared)


def _serve_one(rank: int, body: bytes, shared: tuple[dict[int, int], list] | None) -> None:
    local_fd, buffers = shared or ({}, [])
    call_id = 0
    _released.clear()
    try:
        call_id, function, args, only = payload.load(body, buffers, local_fd)
        if not getattr(function, "keeps_failed_frames", False):
            failed_frames.forget()  # the last failure's frames, kept for the debugger until now
        if only is not None and rank not in only:
            channel.send(wire.CALL_RESULT, _reply(call_id, None))  # not this rank's call
            return
        for hook in _before_each_call:
            hook()
        step_stop.begin_call(call_id)
        step_clock.begin_call()
        try:
            with collectives_refused(only):
                result = function(*args)
        finally:
            step_stop.end_call()
            step_clock.flush()  # the cell's last steps, before its answer
        flush_streams()
        reply = _reply(call_id, result)
    except BaseException as error:  # SystemExit too: a cell's exit is its own, not the rank's
        flush_streams()
        channel.send(wire.CALL_FAILED, pickle.dumps((call_id, _call_failure(error))))
        return
    channel.send(wire.CALL_RESULT, reply)


def _call_failure(error: BaseException) -> Any:
    failure = failure_record(error)
    failed_frames.keep(error)
    lost = device_check.lost_device()
    if lost:  # the pool ends: every later cell would fail on this rank's device
        failure = dataclasses.replace(failure, device_lost=lost)
    if _released:  # raised because the launcher released the group after another rank failed
        failure = dataclasses.replace(failure, collateral=True, reason=(
            f"let go of the collective it waited in, which a rank whose call raised would never join "
            f"({type(error).__name__})"))
    return failure


def _reply(call_id: int, result: Any) -> bytes:
    try:
        return channel.pickle_value((call_id, result))
    except Exception as error:
        raise TypeError(f"the call returned a {type(result).__name__} that cannot be sent back: "
                        f"{describe(error)}") from error


def namespace_names() -> list[str]:
    """The names this rank's cells have defined (a kernel that reattaches to detached warm ranks
    asks, so it does not send them again)."""
    return sorted(name for name in namespace if not name.startswith("__"))


def run_code(source: str, sent: dict[str, Any], filename: str = "<distributed cell>") -> Any:
    """Run a cell's code in this rank's namespace and return its last expression's value (or None).

    ``sent`` holds what the cell uses from the notebook (the magic leaves out names the ranks'
    own cells defined). The source is registered with linecache, so a traceback shows its lines.
    """
    namespace.update(sent)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename=filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
