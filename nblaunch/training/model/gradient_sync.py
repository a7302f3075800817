"""Turning a prepared model's gradient synchronisation off for a block (DDP's ``no_sync`` and
FSDP2's ``set_requires_gradient_sync``, behind one context manager), or on for the next backward
(``trigger_sync_in_backward``, Accelerate's name).

Example::

    with paused_gradient_sync(model):
        accelerator.backward(loss)      # gradients accumulate locally; the next sync step reduces
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["paused_gradient_sync", "forced_gradient_sync", "trigger_sync_in_backward", "syncs_gradients"]

# FSDP2 has a setter and no getter: how many blocks have paused a sharded model, kept on it.
_PAUSES = "_nblaunch_gradient_sync_pauses"


def syncs_gradients(model: torch.nn.Module) -> bool:
    """True for a model whose backward reduces gradients across ranks (DDP or FSDP2)."""
    return isinstance(model, DistributedDataParallel) or hasattr(model, "set_requires_gradient_sync")


@contextlib.contextmanager
def paused_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """No gradient reduction in the block's backward passes; nothing for an unwrapped model.
    Blocks nest: the outermost one turns reduction back on."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        pauses = getattr(model, _PAUSES, 0)
        setattr(model, _PAUSES, pauses + 1)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            setattr(model, _PAUSES, pauses)
            model.set_requires_gradient_sync(pauses == 0)
    else:
        yield


@contextlib.contextmanager
def forced_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """A sharded model's backward in the block reduces, even inside a paused block (for DDP and
    FSDP2 see :func:`trigger_sync_in_backward`)."""
    if not hasattr(model, "set_requires_gradient_sync"):
        yield
        return
    model.set_requires_gradient_sync(True)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(getattr(model, _PAUSES, 0) == 0)


@contextlib.contextmanager
def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """Make the next backward of a DDP ``model`` all-reduce, even inside ``no_sync`` or an
    accumulating micro-step (for several forwards before one backward); FSDP2's likewise."""
    if not isinstance(model, DistributedDataParallel):
        with forced_gradient_sync(model):
            yield
        return
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])  # DDP's own call before a synchronising backward
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved
