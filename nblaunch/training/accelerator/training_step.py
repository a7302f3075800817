"""The ``Accelerator``'s training step (Accelerate's names): ``backward``, ``accumulate``,
gradient sync control, autocast, the profiler, unscaling and clipping. A group of methods of
:class:`~nblaunch.training.accelerator.core.Accelerator`, reading only what
:class:`~nblaunch.training.accelerator.host.AcceleratorHost` declares.

Example::

    with accelerator.accumulate(model):
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
"""

from __future__ import annotations

from typing import Any

import torch

from nblaunch.training.accelerator.host import AcceleratorHost
from nblaunch.training.data import uneven
from nblaunch.training.model.gradient_sync import paused_gradient_sync, trigger_sync_in_backward
from nblaunch.training.options.kwargs import AutocastKwargs, ProfileKwargs, adopt
from nblaunch.training.runtime.state import DistributedType
from nblaunch.training.step import profiling
from nblaunch.training.step.accumulation import Accumulate
from nblaunch.training.step.optim import AcceleratedOptimizer
from nblaunch.worker import step_clock
from nblaunch.worker import step_stop

__all__ = ["TrainingStepMethods"]


class TrainingStepMethods(AcceleratorHost):
    """backward, accumulate, gradient sync, autocast, profile, unscaling and clipping."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled under fp16; under
        DeepSpeed the engine's backward, and its step at the end of an accumulation window."""
        # An interrupt stops every rank at the same step (a warm cell, a launch); a launch finishes
        # the accumulation window and the loop's body first.
        gradient_state = self.gradient_state
        step_stop.step_boundary(gradient_state.sync_gradients, gradient_state.active_dataloader)
        steps = gradient_state.num_steps
        if steps > 1 and self._strategy.divides_loss():
            loss = loss / steps
        clock = step_clock.current()
        if clock is None:
            self._strategy.backward(loss, self.scaler, **kwargs)
            return
        clock.backward_began(loss)
        self._strategy.backward(loss, self.scaler, **kwargs)
        clock.backward_ended()

    def accumulate(self, *models: torch.nn.Module) -> Accumulate:
        """Context for one micro-step of gradient accumulation.

        Sets ``sync_gradients``: True every ``gradient_accumulation_steps`` micro-steps and on the
        last batch of a prepared DataLoader; otherwise DDP's ``no_sync`` skips the all-reduce and
        the prepared optimizer/scheduler do nothing.
        """
        cached = self._accumulate_context
        if cached is not None and cached.stack is None and len(cached.models) == len(models) and all(
                a is b for a, b in zip(cached.models, models)):
            return cached  # the same models as last step: no new object per step
        cached = self._accumulate_context = Accumulate(self.gradient_state, models, self.sync_each_batch)
        return cached

    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Any:
        """Context: ranks that run out of batches keep answering the others' collectives
        (torch's ``Join`` over DDP models); ``even_batches`` overrides the prepared loaders'."""
        distributed = self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        return uneven.join_uneven_inputs(joinables, self._dataloaders, distributed,
                                         self.distributed_type is DistributedType.NO,
                                         self.dataloader_config.even_batches, even_batches)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Any:
        """Context: the next backward of ``model`` all-reduces, even in an accumulating step."""
        return trigger_sync_in_backward(model)

    def no_sync(self, model: torch.nn.Module) -> Any:
        """Context: no gradient reduction in its backward passes (DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``); nothing for an unwrapped model."""
        return paused_gradient_sync(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """Autocast context of the configured mixed precision (a null context for ``"no"``)."""
        return self._precision.autocast(autocast_handler.to_kwargs() if autocast_handler is not None else None)

    def profile(self, profile_handler: ProfileKwargs | None = None) -> Any:
        """Profile the block with torch's profiler (``ProfileKwargs``: this one, else the one
        given in ``kwargs_handlers``); each rank's Chrome trace goes to ``output_trace_dir``::

            with accelerator.profile() as prof:
                train_step()
            accelerator.print(prof.key_averages().table(row_limit=5))
        """
        options = adopt(profile_handler) if profile_handler is not None else self.profile_handler
        return profiling.profile(options or ProfileKwargs(), self.process_index)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the fp16 loss scale (before clipping); only on sync steps."""
        if self.scaler is None or not self.gradient_state.sync_gradients:
            return
        if optimizer is None:
            optimizers = self._optimizers
        else:
            optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            self.scaler.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Unscale (fp16) or average over the XLA devices, then
        ``torch.nn.utils.clip_grad_norm_``; returns the total norm (over every rank's shards
        for a sharded model)."""
        parameters = list(parameters)
        self._finish_gradients(parameters)
        return self._strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        parameters = list(parameters)
        self._finish_gradients(parameters)
        self._strategy.clip_grad_value_(parameters, clip_value)

    def _finish_gradients(self, parameters: list) -> None:
        """Make the gradients final before clipping: unscaled (fp16), averaged (XLA)."""
        optimizers = self._optimizers_of(parameters)
        self.unscale_gradients(optimizers)
        if self._on_xla and self.gradient_state.sync_gradients:
            for opt in optimizers:
                opt.reduce_gradients()  # the prepared optimizer then does not reduce again

    def _optimizers_of(self, parameters: list) -> list[AcceleratedOptimizer]:
        ids = {id(p) for p in parameters}
        return [opt for opt in self._optimizers
                if any(id(p) in ids for g in opt.param_groups for p in g["params"])]
