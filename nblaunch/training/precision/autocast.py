"""The autocast forward: a prepared model's ``forward`` run under autocast, its outputs in fp32
(so losses are computed in fp32), as Accelerate wraps it.

Example::

    model.forward = AutocastForward(model.forward, "cuda", torch.bfloat16)
    model(x).dtype        # torch.float32, computed in bf16
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nblaunch.training.runtime.tree import recursively_apply

__all__ = ["AutocastForward", "convert_outputs_to_fp32"]


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def convert_outputs_to_fp32(output: Any) -> Any:
    """Half-precision tensors in a (nested) output become float32, so losses are computed in fp32."""
    if isinstance(output, torch.Tensor):  # the usual case, without the recursion
        return _to_fp32(output)
    return recursively_apply(_to_fp32, output)


class AutocastForward:
    """Stands in for ``model.forward``: runs the original under autocast, returns fp32 outputs.

    Kept as an instance attribute of the model, so DDP (which calls ``module(...)``) goes through
    it; :func:`unwrap_model` takes it away again.
    """

    __slots__ = ("forward", "device_type", "dtype", "__wrapped__")

    def __init__(self, forward: Callable, device_type: str, dtype: torch.dtype) -> None:
        self.forward = forward
        self.__wrapped__ = forward
        self.device_type = device_type
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            output = self.forward(*args, **kwargs)
        return convert_outputs_to_fp32(output)
