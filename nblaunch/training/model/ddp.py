"""Wrapping a prepared model in DistributedDataParallel, with Accelerate's communication hooks."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from nblaunch.training.options.kwargs import DDPCommunicationHookType, DistributedDataParallelKwargs


def wrap_ddp(model: torch.nn.Module, device: torch.device, options: DistributedDataParallelKwargs) -> DistributedDataParallel:
    """``DistributedDataParallel(model, ...)`` with ``options``' arguments and its hook.

    ``comm_hook``: FP16/BF16 compress gradients for the all-reduce; POWER_SGD and
    BATCHED_POWER_SGD approximate them (``comm_state_option`` goes to ``PowerSGDState``).
    ``comm_wrapper`` FP16/BF16 compresses what a PowerSGD hook sends.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, **options.ddp_arguments())
    hook = DDPCommunicationHookType(options.comm_hook)
    wrapper = DDPCommunicationHookType(options.comm_wrapper)
    if hook is DDPCommunicationHookType.NO:
        if wrapper is not DDPCommunicationHookType.NO:
            raise ValueError("comm_wrapper needs a comm_hook (POWER_SGD or BATCHED_POWER_SGD) to wrap")
        return ddp  # DDP's own all-reduce, in C++: the step clock times it from the backward (step_clock)
    # deferred: only a configured hook needs them (~3 ms to import)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    state = None
    if hook is DDPCommunicationHookType.FP16:
        function = default_hooks.fp16_compress_hook
    elif hook is DDPCommunicationHookType.BF16:
        function = default_hooks.bf16_compress_hook
    else:
        state = powerSGD_hook.PowerSGDState(process_group=None, **options.comm_state_option)
        function = (powerSGD_hook.powerSGD_hook if hook is DDPCommunicationHookType.POWER_SGD
                    else powerSGD_hook.batched_powerSGD_hook)
    if wrapper is DDPCommunicationHookType.FP16:
        function = default_hooks.fp16_compress_wrapper(function)
    elif wrapper is DDPCommunicationHookType.BF16:
        function = default_hooks.bf16_compress_wrapper(function)
    ddp.register_comm_hook(state, function)
    return ddp
