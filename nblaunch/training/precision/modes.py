"""Which precision an ``Accelerator`` trains in: the word (``resolve_mixed_precision``), the
device's refusal of what it cannot run (``check_supported``), and the ``Precision`` for both
(``pick_precision``).

Modes are ``"no"``, ``"fp16"``, ``"bf16"`` and ``"fp8"``, read with the vocabulary every side
shares (``nblaunch.contract.precision``). ``mixed_precision=None`` reads ``NBLAUNCH_MIXED_PRECISION``
(set by the launcher from its own ``mixed_precision=``), so the launcher's choice reaches every
worker; an explicit argument wins. fp16 is refused on XLA devices (TPUs compute in bf16; ``bf16``
autocasts on the XLA device).

Example::

    mode = resolve_mixed_precision("auto", torch.device("cpu"))        # "no"
    precision = pick_precision("bf16", torch.device("cpu"), engine_precision=None)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from nblaunch.contract.precision import AUTO, BF16_HARDWARE, fast_precision, parse_precision, precision_from_environ
from nblaunch.training.options.kwargs import AORecipeKwargs
from nblaunch.training.precision.float8 import Float8
from nblaunch.training.precision.half import EngineOwned, Half
from nblaunch.training.precision.precision_interface import Precision

__all__ = ["resolve_mixed_precision", "check_supported", "pick_precision"]


def resolve_mixed_precision(value: str | None, device: torch.device) -> str:
    """The mode to use on ``device``: ``value`` if given, else the launch's
    (``NBLAUNCH_MIXED_PRECISION``), else ``"no"``; "auto" is the one ``device`` computes fast.
    An unknown word is a ``ValueError``."""
    mode = precision_from_environ() if value is None else parse_precision(value)
    if mode == AUTO:
        mode = fast_precision(device.type, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    return mode


def pick_precision(mode: str, device: torch.device, engine_precision: str | None,
                   recipe: AORecipeKwargs | None = None, autocast_kwargs: dict[str, Any] | None = None,
                   scaler_kwargs: dict[str, Any] | None = None) -> Precision:
    """The ``Precision`` for ``mode`` on ``device``; ``engine_precision``: the one a stack computes
    in by itself (DeepSpeed's config), which then wins. Refuses what the device cannot run."""
    if recipe is not None and mode != "fp8":
        raise ValueError("AORecipeKwargs is fp8's recipe: give it with mixed_precision='fp8'")
    if engine_precision is not None:
        return EngineOwned(engine_precision, device)
    check_supported(mode, device)
    if mode == "fp8":
        return Float8(device, recipe, autocast_kwargs)
    if mode in ("fp16", "bf16"):
        return Half(mode, device, autocast_kwargs, scaler_kwargs)
    return Precision(device)


def bf16_in_hardware(device: torch.device) -> bool:
    """Whether this CUDA device computes bf16 in hardware; ``torch.cuda.is_bf16_supported()``
    also says True where bf16 is only emulated (a T4)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a torch that does not tell emulation apart: by the device's capability
        return torch.cuda.get_device_capability(device) >= BF16_HARDWARE


def check_supported(mode: str, device: torch.device) -> None:
    """Refuse, with a clear message, a mode this device cannot run (fp8's own checks are
    ``Float8``'s).

    Example: ``check_supported("fp16", torch.device("xla", 0))`` raises ``ValueError``.
    """
    if mode == "fp16" and device.type == "xla":
        raise ValueError("mixed_precision='fp16' is not supported on XLA devices (no GradScaler "
                         "there, and TPUs compute in bf16): use 'bf16' or 'no'")
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"mixed_precision='bf16' is not supported by {torch.cuda.get_device_name(device)}")
    if mode == "bf16" and device.type == "cuda" and not bf16_in_hardware(device):
        warnings.warn(f"mixed_precision='bf16' on {torch.cuda.get_device_name(device)} (compute capability "
                      f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) is emulated, and slower than "
                      "fp16 there: use mixed_precision='fp16', or 'auto' for the one each device computes fast",
                      stacklevel=4)
    if mode == "fp16" and device.type == "cpu":
        try:
            torch.amp.GradScaler("cpu")
        except Exception as exc:  # older torch: no CPU GradScaler
            raise ValueError("mixed_precision='fp16' on the CPU needs torch.amp.GradScaler('cpu') "
                             f"(torch >= 2.3): {exc}. Use 'bf16' on the CPU.") from exc
