"""The ``Precision`` seam: what every precision answers (its autocast, its GradScaler, how it
converts a model, what it does after an optimizer is prepared), with the answers of full fp32
(``mixed_precision="no"``). See the package docstring.

Example::

    precision = pick_precision("bf16", device, engine_precision=None)
    precision.wrap_forward(model)            # forward under bf16 autocast, outputs in fp32
    with precision.autocast():               # accelerator.autocast()
        ...
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nblaunch.training.precision.autocast import AutocastForward

__all__ = ["Precision"]


class Precision:
    """Full precision (``"no"``): no autocast, no scaler, the model as it is."""

    #: ``Accelerator.mixed_precision``: "no", "fp16", "bf16", "fp8".
    mode = "no"
    #: The dtype the forward autocasts to; None: no autocast.
    autocast_dtype: torch.dtype | None = None
    #: fp8's recipe (``AORecipeKwargs``), None for the others (``Accelerator.fp8_recipe``).
    recipe: Any = None
    #: Whether a compiled model is the default (fp8 on GPUs with fp8 units: eager fp8 is slower than bf16).
    wants_compile = False

    def __init__(self, device: torch.device, autocast_kwargs: dict[str, Any] | None = None) -> None:
        self.device = device
        self.autocast_kwargs = dict(autocast_kwargs or {})
        #: The fp16 ``GradScaler`` (saved and loaded with checkpoints as ``scaler.pt``); None for the others.
        self.scaler: Any = None

    def convert(self, model: torch.nn.Module, sharded: bool) -> torch.nn.Module:
        """The model with layers of this precision (fp8's Float8Linear), before it is placed and spread."""
        return model

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Run the model's forward under this precision's autocast, its outputs in fp32 (once)."""
        if self.autocast_dtype is not None and not isinstance(model.__dict__.get("forward"), AutocastForward):
            model.forward = AutocastForward(model.forward, self.device.type, self.autocast_dtype)

    def autocast(self, extra: dict[str, Any] | None = None) -> Any:
        """The autocast context of ``accelerator.autocast()`` (a null context without autocast)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, **{**self.autocast_kwargs, **(extra or {})})

    def optimizer_prepared(self, optimizer: torch.optim.Optimizer, sharded_models: list[torch.nn.Module]) -> None:
        """What this precision adds to a prepared optimizer of FSDP2 models (fp8: the weights' scales)."""

    def describe(self) -> str:
        return self.mode
