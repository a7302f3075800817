"""A rank's clock of its training steps: each step split into its parts, sent to the launcher.

The Accelerator starts it (:func:`start`) and the pieces of a training loop it prepared tell it
what they do: the prepared DataLoader how long the rank waited for a batch, the prepared model
when its forward began and ended, ``accelerator.backward`` its backward and, from inside it, when
its last gradient was computed (where DDP syncs: see ``StepClock.backward_began``), the prepared
optimizer its step (the end of a training step: with accumulation, one step is one optimizer
step), the Accelerator's collectives their time. From those each step is a ``StepRecord``
(``nblaunch.step_split.book``): data, compute (forward, and backward up to its last gradient),
communication (from then to the end of the backward -- the all-reduce the compute did not hide --
and the collectives), the optimizer, and the whole step; sent about twice a second and at the end
(:func:`flush`).

On the CPU every mark is the monotonic clock. On a GPU the compute, the sync and the optimizer are
CUDA events on the current stream, read when they have completed -- a step or two late, never by
synchronising. The wait for data is the host's either way.

Each rank also counts the collectives it enters and leaves, by kind (:func:`entered`,
:func:`left`); a rank answering a stack request sends them, and a stalled launch is told by count
("rank 0 waits in its 7th gradient sync; rank 1 has entered 6").

``NBLAUNCH_STEP_SPLIT=0`` in the ranks' environment turns the clock off, and with it the count of gradient syncs.

Example (what the prepared pieces do)::

    clock = step_clock.current()          # None outside a launch, or turned off
    began = time.perf_counter(); batch = next(iterator); clock.waited_for_data(began, batch)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from typing import Any, Iterator

from nblaunch import wire
from nblaunch.contract import variables
from nblaunch.per_process import per_process
from nblaunch.worker import channel

REPORT_EVERY_S = 0.5  # the dashboard's pace
_MAX_UNRESOLVED = 64  # GPU steps whose events have not completed; past it the oldest is waited for

class _ThisRank:
    """This process's clock and counts: a forked child (a rank, a DataLoader worker) starts without
    its parent's (``per_process``)."""

    def __init__(self) -> None:
        self.clock: StepClock | None = None
        self.counts: dict[str, list[int]] = {}  # kind -> [entered, left]
        self.depth = 0  # collectives inside collectives (pad_across_processes gathers) count once
        self.trained_before: str | None = None  # what another library's loop left before this warm call


_here = per_process(_ThisRank)


def entered(kind: str) -> None:
    """This rank entered a collective of ``kind`` ("gradient sync", "gather", ...)."""
    _here().counts.setdefault(kind, [0, 0])[0] += 1


def left(kind: str) -> None:
    _here().counts.setdefault(kind, [0, 0])[1] += 1


def counts() -> dict[str, tuple[int, int]]:
    """``{kind: (entered, left)}`` of every collective this rank counted."""
    return {kind: (n[0], n[1]) for kind, n in _here().counts.items()}


@contextlib.contextmanager
def collective(kind: str) -> Iterator[None]:
    """Around one of the Accelerator's collectives: counted, and its time is communication."""
    here = _here()
    if here.depth or not channel.in_launch():
        yield
        return
    here.depth += 1
    entered(kind)
    began = time.perf_counter()
    try:
        yield
    finally:
        here.depth -= 1
        left(kind)
        if here.clock is not None:
            here.clock.collective(time.perf_counter() - began)


def start(cuda: bool) -> StepClock | None:
    """The rank's clock, made by its first Accelerator (None outside a launch or turned off)."""
    here = _here()
    if channel.in_launch() and os.environ.get(variables.STEP_SPLIT, "1") != "0" and (
            here.clock is None or here.clock.cuda != cuda):  # a warm cell may move from the CPU to a GPU
        here.clock = StepClock(cuda)
    return here.clock


def current() -> StepClock | None:
    return _here().clock


@contextlib.contextmanager
def set_aside() -> Iterator[None]:
    """No clock for what runs inside: its steps go unmeasured, as with the split off (what the
    split costs is measured so, block against block in one launch: ``benchmarks/m_split.py``)."""
    here = _here()
    clock, here.clock = here.clock, None
    try:
        yield
    finally:
        here.clock = clock


def begin_call() -> None:
    """A warm rank begins a call: its steps and counts are the cell's own, numbered from one
    (the step left unfinished by the last cell, and the time between cells, are no step)."""
    here = _here()
    here.counts = {}
    here.trained_before = _trained_through()  # an earlier cell's, or the pool's own group: said then, or never
    if here.clock is not None:
        here.clock = StepClock(here.clock.cuda)


def flush() -> None:
    """Send every step not yet sent (the rank's function or a warm call ended); never raises."""
    try:
        clock = _here().clock
        if clock is not None:
            clock.send(final=True)
        elif channel.in_launch() and os.environ.get(variables.STEP_SPLIT, "1") != "0":
            _say_what_trained_unmeasured()
    except Exception:  # noqa: BLE001  a report of the steps must never fail the rank
        pass


def _say_what_trained_unmeasured() -> None:
    """Trained through another library's loop (in this launch, or this warm call): say once that
    the split needs nblaunch's."""
    what = _trained_through()
    if what is None or what == _here().trained_before:
        return
    note = (f"the step split needs nblaunch's Accelerator: these ranks trained through {what}; "
            "`from nblaunch import Accelerator` (the same names and semantics) measures every step")
    channel.send(wire.STEP_TIMES, pickle.dumps(([], note)))


def _trained_through() -> str | None:
    state = sys.modules.get("accelerate.state")
    if getattr(getattr(state, "PartialState", None), "_shared_state", None):
        return "accelerate's Accelerator (transformers' Trainer uses it)"
    if ("lightning.pytorch" in sys.modules or "pytorch_lightning" in sys.modules) and _group_made():
        return "Lightning's Trainer"  # imported (perhaps by the kernel, before the fork) and a group made
    return None


def _group_made() -> bool:
    distributed = sys.modules.get("torch.distributed")
    return bool(distributed is not None and distributed.is_available() and distributed.is_initialized())


class StepClock:
    """The parts of the step under way, and the steps measured but not yet sent."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._index = 0
        self._began: float | None = None  # the step under way began (host clock)
        self._data = 0.0
        self._samples = 0
        self._comm_host = 0.0  # collectives' time, on the host
        self._pairs: list[tuple[int, Any, Any]] = []  # (part, from mark, to mark) of this step
        self._forward: Any = None
        self._backward: Any = None
        self._launched: Any = None  # the backward's compute ended (its sync under way)
        self._optimizer: Any = None
        self._syncing = False  # a forward since the last backward will have DDP sync its gradients
        self._prehook: Any = None  # on the loss's autograd node, until the backward ends
        self._owner: int | None = None  # id() of the optimizer whose step ends a training step
        self._unresolved: list[tuple[int, float, float, int, float, list]] = []
        self._ready: list[tuple] = []
        self._sent_at = time.perf_counter()

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch  # deferred: the worker side never imports torch itself

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self, now: float) -> None:
        if self._began is None:
            self._began = now

    # -- what the prepared pieces say ----------------------------------------------------------

    def waited_for_data(self, began: float, batch: Any) -> None:
        now = time.perf_counter()
        self._begin(began)
        self._data += now - began
        self._samples += _batch_length(batch)

    def watch_forward(self, model: Any) -> None:
        """Time every forward of a prepared model (two hooks on the outermost module)."""
        model.register_forward_pre_hook(_forward_began)
        model.register_forward_hook(_forward_ended)

    def forward_began(self, syncing: bool) -> None:
        """A prepared model's forward begins; ``syncing``: DDP will all-reduce in its backward
        (DDP decides it in the forward: ``no_sync`` around the forward is what counts)."""
        self._begin(time.perf_counter())
        self._forward = self._mark()
        self._syncing = self._syncing or syncing

    def forward_ended(self) -> None:
        if self._forward is not None:
            self._pairs.append((_COMPUTE, self._forward, self._mark()))
            self._forward = None

    def backward_began(self, loss: Any) -> None:
        """``loss.backward()`` is about to run.

        Where DDP syncs in it, the end of the backward's compute is marked from inside: the loss's
        autograd node (reached before any gradient is ready) queues a callback at the end of the
        graph, ahead of the one DDP queues once its last bucket is handed to the all-reduce, which
        waits for the sync. DDP's own all-reduce stays in C++ (a Python communication hook would
        cost each bucket more than the whole clock costs a step)."""
        self._begin(time.perf_counter())
        self._backward, self._launched = self._mark(), None
        grad_fn = getattr(loss, "grad_fn", None)
        if self._syncing and grad_fn is not None:
            try:
                self._prehook = grad_fn.register_prehook(_queue_compute_ended)
            except Exception:  # noqa: BLE001  an odd loss: its sync counts as compute, the loop goes on
                self._prehook = None

    def compute_ended(self) -> None:
        """The backward's last gradient is computed: what is left of it is the gradient sync."""
        if self._backward is not None and self._launched is None:
            entered(_SYNC)
            self._launched = self._mark()

    def backward_ended(self) -> None:
        began, launched, self._backward, self._launched = self._backward, self._launched, None, None
        self._syncing = False
        if self._prehook is not None:  # a graph kept (retain_graph) would queue one more callback each time
            self._prehook.remove()
            self._prehook = None
        if began is None:
            return
        end = self._mark()
        if launched is None:
            self._pairs.append((_COMPUTE, began, end))
            return
        left(_SYNC)
        self._pairs.append((_COMPUTE, began, launched))
        self._pairs.append((_SYNC_WAIT, launched, end))

    def collective(self, seconds: float) -> None:
        """An Accelerator collective (gather, reduce, broadcast, wait_for_everyone) took this long."""
        self._comm_host += seconds

    def optimizer_began(self) -> None:
        self._optimizer = self._mark()

    def optimizer_ended(self, optimizer: object) -> None:
        """A prepared optimizer stepped; the first one to step ends every training step."""
        began, self._optimizer = self._optimizer, None
        if began is not None:
            self._pairs.append((_OPTIMIZER, began, self._mark()))
        if self._owner is None:
            self._owner = id(optimizer)
        if id(optimizer) == self._owner and self._began is not None:
            self._end_step()

    # -- steps ---------------------------------------------------------------------------------

    def _end_step(self) -> None:
        now = time.perf_counter()
        self._index += 1
        step = (self._index, now - (self._began or now), self._data, self._samples, self._comm_host, self._pairs)
        self._began, self._data, self._samples, self._comm_host, self._pairs = now, 0.0, 0, 0.0, []
        self._unresolved.append(step)
        self._resolve()
        if now - self._sent_at >= REPORT_EVERY_S:
            self.send()

    def _resolve(self, wait: bool = False) -> None:
        while self._unresolved:
            index, step, data, samples, comm, pairs = self._unresolved[0]
            if self.cuda and not (wait or len(self._unresolved) > _MAX_UNRESOLVED or _complete(pairs)):
                break
            self._unresolved.pop(0)
            parts = [0.0, 0.0, 0.0]
            sync_wait = -1.0
            for part, a, b in pairs:
                seconds = b - a if not self.cuda else _elapsed(a, b)
                parts[part] += seconds
                if part == _SYNC_WAIT:
                    sync_wait = max(sync_wait, 0.0) + seconds
            compute, waited, optimizer = parts
            self._ready.append((index, step, data, compute, waited + comm, optimizer, sync_wait, samples))

    def send(self, final: bool = False) -> None:
        self._resolve(wait=final)
        self._sent_at = time.perf_counter()
        if self._ready:
            ready, self._ready = self._ready, []
            channel.send(wire.STEP_TIMES, pickle.dumps((ready, "")))



def _forward_began(module: Any, *_: Any) -> None:
    # Module-level, not a closure: a model with its hooks still pickles (torch.save of a whole model).
    clock = current()
    if clock is not None:
        import torch  # deferred: the worker side never imports torch itself (a forward runs: it is loaded)

        clock.forward_began(torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", False))


def _forward_ended(*_: Any) -> None:
    clock = current()
    if clock is not None:
        clock.forward_ended()


def _queue_compute_ended(*_: Any) -> None:
    import torch  # deferred: the worker side never imports torch itself (a backward runs: it is loaded)

    torch.autograd.Variable._execution_engine.queue_callback(_compute_ended)


def _compute_ended() -> None:
    clock = current()
    if clock is not None:
        clock.compute_ended()


_COMPUTE, _SYNC_WAIT, _OPTIMIZER = 0, 1, 2
_SYNC = "gradient sync"


def _complete(pairs: list) -> bool:
    return all(b.query() for _, _, b in pairs)


def _elapsed(a: Any, b: Any) -> float:
    if not b.query():
        b.synchronize()  # only past _MAX_UNRESOLVED, or at the end
    return a.elapsed_time(b) / 1000.0


def _batch_length(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (in a dict, list or tuple), else 0."""
    for _ in range(4):  # nested at most this deep
        shape = getattr(batch, "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else 1
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)):
            batch = batch[0] if batch else None
        else:
            return 0
    return 0
