"""Accelerate's ``LocalSGD``: ranks step on their own gradients (DDP's all-reduce is off) and
average their parameters every ``local_sgd_steps`` steps and when the block ends. Less
communication per step, for slow links between ranks.

Example::

    with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            accelerator.backward(loss_of(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nblaunch.training.runtime.state import DistributedType

__all__ = ["LocalSGD"]


class LocalSGD:
    """Local steps, parameters averaged every ``local_sgd_steps`` calls of :meth:`step` and on
    leaving the ``with`` block. With one process (or ``enabled=False``) it does nothing."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int,
                 enabled: bool = True) -> None:
        kind = accelerator.distributed_type
        if kind in (DistributedType.XLA, DistributedType.DEEPSPEED, DistributedType.FSDP,
                    DistributedType.MEGATRON_LM):
            raise NotImplementedError(f"LocalSGD works with DDP on CPUs and GPUs, not with {kind.value}")
        if local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps must be at least 1, got {local_sgd_steps}")
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.enabled:
            try:
                if exc_info[0] is None:  # after an error the other ranks may never get here
                    self._average_parameters()
            finally:
                self._no_sync.__exit__(*exc_info)

    def step(self) -> None:
        """Count one optimizer step; every ``local_sgd_steps``-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    @torch.no_grad()
    def _average_parameters(self) -> None:
        # One all-reduce per dtype and device rather than one per parameter.
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in self.model.parameters():
            groups.setdefault((p.device, p.dtype), []).append(p.data)
        world = self.accelerator.num_processes
        for tensors in groups.values():
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat)
            flat /= world
            for tensor, averaged in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                tensor.copy_(averaged)
