"""The user's model out of what preparing (and ``torch.compile``) put around it.

Example::

    ddp = DistributedDataParallel(torch.compile(model))
    unwrap_model(ddp) is model      # True
"""

from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DistributedDataParallel

from nblaunch.training.precision.autocast import AutocastForward

__all__ = ["unwrap_model", "is_deepspeed_engine"]


def unwrap_model(model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
    """The model out of DDP, a DeepSpeed engine and ``torch.compile``; without the autocast forward that mixed
    precision puts on it unless ``keep_fp32_wrapper``. A sharded (FSDP2) model is the user's
    model itself: FSDP2 shards in place."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif is_deepspeed_engine(model):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model, torch.nn.Module):
            model = model._orig_mod  # torch.compile's wrapper has no public name for it
        else:
            break
    if not keep_fp32_wrapper and isinstance(model.__dict__.get("forward"), AutocastForward):
        del model.__dict__["forward"]
    return model


def is_deepspeed_engine(model: torch.nn.Module) -> bool:
    """A DeepSpeed engine, without importing DeepSpeed (only a loaded DeepSpeed made one)."""
    deepspeed = sys.modules.get("deepspeed")
    engine = getattr(deepspeed, "DeepSpeedEngine", None)
    return engine is not None and isinstance(model, engine)
