"""``accelerator.accumulate(model)``: which micro-steps synchronise gradients and step."""

from __future__ import annotations

import contextlib
from typing import Any

from nblaunch.training.model.gradient_sync import paused_gradient_sync, syncs_gradients
from nblaunch.training.step.gradient_state import GradientState


class Accumulate:
    """The context of ``accelerator.accumulate(model)``; a class, not a generator, to stay cheap."""

    __slots__ = ("gs", "models", "stack", "sync_each_batch")

    def __init__(self, gs: GradientState, models: tuple, sync_each_batch: bool = False) -> None:
        self.gs = gs
        self.models = models
        self.stack: contextlib.ExitStack | None = None
        self.sync_each_batch = sync_each_batch  # all-reduce at every micro-step: less memory with DDP

    def __enter__(self) -> None:
        gs = self.gs
        if gs.num_steps == 1:  # no accumulation: every micro-step syncs
            gs.sync_gradients = True
            return
        if gs.sync_with_dataloader and gs.end_of_dataloader:
            gs.step = 0  # the dataloader ends: sync whatever has been accumulated
            gs.sync_gradients = True
            return
        gs.step += 1
        if gs.step >= gs.num_steps:
            gs.step = 0
            gs.sync_gradients = True
            return
        gs.sync_gradients = False
        if self.sync_each_batch:
            return  # gradients are reduced as usual; only the optimizer waits for the last micro-step
        stack = None
        for model in self.models:
            if syncs_gradients(model):
                if stack is None:
                    stack = contextlib.ExitStack()
                stack.enter_context(paused_gradient_sync(model))
        self.stack = stack

    def __exit__(self, *exc: Any) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            stack.close()
