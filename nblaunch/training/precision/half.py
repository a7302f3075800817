"""fp16 and bf16 through autocast (``torch.autocast``), fp16 with its ``GradScaler``; on the CPU
too (CPU autocast and ``torch.amp.GradScaler("cpu")``), never silently ignored.

Example::

    Half("fp16", torch.device("cpu")).scaler      # a GradScaler("cpu")
"""

from __future__ import annotations

from typing import Any

import torch

from nblaunch.training.precision.precision_interface import Precision

__all__ = ["Half"]


class Half(Precision):
    """``"fp16"`` or ``"bf16"``: the forward under autocast; fp16's loss scaled by a GradScaler."""

    def __init__(self, mode: str, device: torch.device, autocast_kwargs: dict[str, Any] | None = None,
                 scaler_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(device, autocast_kwargs)
        self.mode = mode
        self.autocast_dtype = torch.float16 if mode == "fp16" else torch.bfloat16
        if mode == "fp16":
            self.scaler = torch.amp.GradScaler(device.type, **(scaler_kwargs or {}))


class EngineOwned(Precision):
    """The precision of a stack that computes in its own (DeepSpeed's config ``fp16``/``bf16``
    sections): no autocast and no GradScaler here; ``mode`` says which it is."""

    def __init__(self, mode: str, device: torch.device) -> None:
        super().__init__(device)
        self.mode = mode
