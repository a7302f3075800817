"""What ``prepare`` hands back under DeepSpeed (Accelerate's names): the optimizer and scheduler
DeepSpeed made, whose ``step``/``zero_grad`` do nothing because the engine steps inside
``accelerator.backward`` at the end of each accumulation window; and the engine's wrapper.

Example::

    model, optimizer = accelerator.prepare(model, optimizer)   # DeepSpeedEngine, DeepSpeedOptimizerWrapper
    accelerator.backward(loss)       # engine.backward, then engine.step() on a sync step
    optimizer.step()                 # nothing: already stepped
"""

from __future__ import annotations

from typing import Any, Callable

from nblaunch.training.step.gradient_state import GradientState
from nblaunch.training.step.optim import AcceleratedOptimizer, AcceleratedScheduler
from nblaunch.worker import step_clock

__all__ = ["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper"]


class DeepSpeedEngineWrapper:
    """Backward and step of a ``DeepSpeedEngine``: the accumulation boundary is the
    Accelerator's ``sync_gradients``; DeepSpeed divides the loss by its accumulation steps."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()  # clips (its gradient_clipping), steps, zeroes, steps its scheduler

    def get_global_grad_norm(self) -> float | None:
        """The gradients' norm DeepSpeed found in its last step (before clipping); None before one."""
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """DeepSpeed's optimizer; ``step`` and ``zero_grad`` are the engine's, done in ``backward``."""

    def __init__(self, optimizer: Any, gradient_state: GradientState) -> None:
        super().__init__(optimizer, gradient_state, scaler=None)

    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        clock = step_clock.current()
        if clock is not None and self.gradient_state.sync_gradients:
            clock.optimizer_ended(self)  # the engine stepped in backward: this only ends the training step
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        return None

    @property
    def step_was_skipped(self) -> bool:
        """True when DeepSpeed's fp16 loss scaler skipped the last step (an overflow)."""
        return bool(getattr(self.optimizer, "overflow", False))


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """A scheduler DeepSpeed steps with its optimizer; ``step`` does nothing."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None
