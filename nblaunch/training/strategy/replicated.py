"""``Replicated``: every rank holds the whole model; with more than one process its gradients
are averaged by DistributedDataParallel (with Accelerate's communication hooks). One process, an
untrained model and XLA (where the prepared optimizer averages) keep the model as it is.

Example::

    strategy = Replicated(DistributedDataParallelKwargs(), num_processes=2, on_xla=False)
    ddp = strategy.wrap_model(model, torch.device("cpu"), trainable=True)
"""

from __future__ import annotations

import torch

from nblaunch.training.model.ddp import wrap_ddp
from nblaunch.training.options.kwargs import DistributedDataParallelKwargs
from nblaunch.training.strategy.strategy_interface import Strategy

__all__ = ["Replicated"]


class Replicated(Strategy):
    """DDP over the ranks (Accelerate's MULTI_CPU/MULTI_GPU), or the model as it is."""

    def __init__(self, ddp_options: DistributedDataParallelKwargs, num_processes: int, on_xla: bool) -> None:
        self.ddp_options = ddp_options
        self.num_processes = num_processes
        self.on_xla = on_xla

    def wrap_model(self, model: torch.nn.Module, device: torch.device, trainable: bool) -> torch.nn.Module:
        if trainable and self.num_processes > 1 and not self.on_xla:
            return wrap_ddp(model, device, self.ddp_options)
        return model

    def describe(self) -> str:
        return "DDP" if self.num_processes > 1 else "one process"
