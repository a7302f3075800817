"""Optimizer and LR-scheduler wrappers returned by ``Accelerator.prepare``.

:class:`AcceleratedOptimizer` steps (and zeroes gradients) only on sync steps of gradient
accumulation, and goes through the GradScaler under fp16; :class:`AcceleratedScheduler` steps only
after the optimizer really stepped (not on accumulation micro-steps, not when fp16 overflow made
the scaler skip the step).

On XLA (``on_xla=True``) a step first averages the gradients over the devices (``xm.reduce_gradients``,
once per step, also when ``clip_grad_norm_`` asked for it earlier), then runs ``torch_xla.sync()``
so every step is one XLA graph.

Both forward every other attribute to the wrapped object, so ``optimizer.param_groups``,
``scheduler.get_last_lr()`` and so on work as before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nblaunch.training.runtime import xla
from nblaunch.training.step.gradient_state import GradientState
from nblaunch.worker import step_clock

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer for accumulation and fp16.

    Subclasses ``torch.optim.Optimizer`` only so ``isinstance`` checks (and LR schedulers created
    on the prepared optimizer) keep working; it owns no state of its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                 scaler: "torch.amp.GradScaler | None" = None, on_xla: bool = False) -> None:
        # Optimizer.__init__ is not called on purpose: everything is the wrapped optimizer's.
        self.optimizer = optimizer
        self.scaler = scaler
        self.gradient_state = gradient_state
        self._step_was_skipped = False  # only a GradScaler ever skips a step
        self._xla = on_xla
        self._gradients_reduced = False  # XLA: already averaged over the devices for this step

    # The attributes torch code reads on an optimizer, all the wrapped one's.
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally: hand them to the wrapped optimizer.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    @property
    def step_was_skipped(self) -> bool:
        """True if the last sync step did not update the parameters (fp16 overflow)."""
        return self._step_was_skipped

    def step(self, closure: Callable | None = None) -> Any:  # type: ignore[override]
        if not self.gradient_state.sync_gradients:
            return None  # an accumulation micro-step: gradients keep adding up
        clock = step_clock.current()
        if clock is None:
            return self._step(closure)
        clock.optimizer_began()
        try:
            return self._step(closure)
        finally:
            clock.optimizer_ended(self)  # the first prepared optimizer's step ends a training step

    def _step(self, closure: Callable | None) -> Any:
        if self._xla:
            return self._xla_step(closure)
        scaler = self.scaler
        if scaler is None:
            if closure is None:
                return self.optimizer.step()
            return self.optimizer.step(closure)
        # The scale only drops when scaler.update() saw inf/nan, i.e. exactly when it skipped.
        before = scaler.get_scale()
        result = scaler.step(self.optimizer, closure) if closure is not None else scaler.step(self.optimizer)
        scaler.update()
        self._step_was_skipped = scaler.get_scale() < before
        return result

    def reduce_gradients(self) -> None:
        """XLA: average the gradients over all devices, once per step (nothing with one device).

        Example: ``accelerator.clip_grad_norm_`` calls it so the norm is the global one.
        """
        if self._xla and not self._gradients_reduced:
            xla.reduce_gradients(self.optimizer)
            self._gradients_reduced = True

    def _xla_step(self, closure: Callable | None) -> Any:
        self.reduce_gradients()
        result = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self._gradients_reduced = False
        xla.sync()  # without it the lazy graph would grow over every step until something reads it
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            self._gradients_reduced = False  # the next gradients are new ones

    def state_dict(self) -> dict:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:  # type: ignore[override]
        self.optimizer.add_param_group(param_group)

    def train(self) -> None:  # schedule-free optimizers have train()/eval()
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()


class AcceleratedScheduler:
    """Wraps an LR scheduler so it advances with real optimizer steps, as Accelerate's does.

    After each real optimizer step it steps ``steps_per_optimizer_step`` times: the number of
    processes by default (unless batches are split), so a schedule sized from the unprepared
    DataLoader's length ends with the data, as under Accelerate; 1 makes the schedule follow
    optimizer steps (``Accelerator(step_scheduler_per_process=False)``). With
    ``step_with_optimizer=False`` every ``step()`` goes straight through.
    """

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer],
                 gradient_state: GradientState, step_with_optimizer: bool = True,
                 steps_per_optimizer_step: int = 1) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_optimizer_step = steps_per_optimizer_step

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        for opt in self.optimizers:
            if opt.step_was_skipped:
                return
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses to step past it
        for _ in range(self.steps_per_optimizer_step):
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
