"""Mixed precision: which mode, the autocast context, the model-forward wrapper, the GradScaler.

Modes are ``"no"``, ``"fp16"``, ``"bf16"`` and ``"fp8"`` (torchao's float8 Linear layers, ``fp8``), read with the vocabulary every side shares
(``nblaunch.contract.precision``). ``mixed_precision=None`` reads ``NBLAUNCH_MIXED_PRECISION``
(set by the launcher from its own ``mixed_precision=``), so the launcher's choice reaches every
worker; an explicit argument wins.

fp16 works for real on the CPU too (CPU autocast to float16 and ``torch.amp.GradScaler("cpu")``),
it is never silently ignored. fp8 needs torchao, and says so where it only emulates (the CPU) or
cannot run (a GPU without fp8 units); fp16 is refused on XLA devices
(TPUs compute in bf16; ``bf16`` autocasts on the XLA device).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from nblaunch.contract.precision import AUTO, BF16_HARDWARE, fast_precision, parse_precision, precision_from_environ
from nblaunch.training.model.fp8 import check_fp8_device, require_torchao
from nblaunch.training.runtime.tree import recursively_apply

__all__ = ["resolve_mixed_precision", "autocast_dtype", "AutocastForward", "convert_outputs_to_fp32",
           "make_grad_scaler"]

def resolve_mixed_precision(value: str | None, device: torch.device) -> str:
    """The mode to use on ``device``: ``value`` if given, else the launch's
    (``NBLAUNCH_MIXED_PRECISION``), else ``"no"``; "auto" is the one ``device`` computes fast.
    An unknown word is a ``ValueError``."""
    mode = precision_from_environ() if value is None else parse_precision(value)
    if mode == AUTO:
        mode = fast_precision(device.type, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    return mode


def bf16_in_hardware(device: torch.device) -> bool:
    """Whether this CUDA device computes bf16 in hardware; ``torch.cuda.is_bf16_supported()``
    also says True where bf16 is only emulated (a T4)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a torch that does not tell emulation apart: by the device's capability
        return torch.cuda.get_device_capability(device) >= BF16_HARDWARE


def autocast_dtype(mode: str) -> torch.dtype | None:
    # fp8: the float8 matmuls are torchao's; the rest of the forward runs in bf16, as under Accelerate.
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(mode)


def check_supported(mode: str, device: torch.device) -> None:
    """Refuse, with a clear message, a mode this device cannot run.

    Example: ``check_supported("fp16", torch.device("xla", 0))`` raises ``ValueError``.
    """
    if mode == "fp8":
        require_torchao()
        check_fp8_device(device)
    if mode == "fp16" and device.type == "xla":
        raise ValueError("mixed_precision='fp16' is not supported on XLA devices (no GradScaler "
                         "there, and TPUs compute in bf16): use 'bf16' or 'no'")
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"mixed_precision='bf16' is not supported by {torch.cuda.get_device_name(device)}")
    if mode == "bf16" and device.type == "cuda" and not bf16_in_hardware(device):
        warnings.warn(f"mixed_precision='bf16' on {torch.cuda.get_device_name(device)} (compute capability "
                      f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) is emulated, and slower than "
                      "fp16 there: use mixed_precision='fp16', or 'auto' for the one each device computes fast",
                      stacklevel=3)
    if mode == "fp16" and device.type == "cpu":
        try:
            torch.amp.GradScaler("cpu")
        except Exception as exc:  # older torch: no CPU GradScaler
            raise ValueError("mixed_precision='fp16' on the CPU needs torch.amp.GradScaler('cpu') "
                             f"(torch >= 2.3): {exc}. Use 'bf16' on the CPU.") from exc


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


def make_grad_scaler(device: torch.device, **kwargs: Any) -> "torch.amp.GradScaler":
    return torch.amp.GradScaler(device.type, **kwargs)
