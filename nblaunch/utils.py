"""What Accelerate's ``accelerate.utils`` offers that training code calls, under the same names.

Port by replacing ``accelerate.utils`` (and its submodules, ``accelerate.utils.operations``,
``accelerate.utils.dataclasses``, ...) with ``nblaunch.utils``::

    from nblaunch.utils import DistributedDataParallelKwargs, gather, set_seed

Everything here works inside a launch and, where it makes sense, in a plain process.
"""

from __future__ import annotations

from nblaunch.training.checkpoint.single import save
from nblaunch.training.data.prepared import skip_first_batches
from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin
from nblaunch.training.options.project import ProjectConfiguration
from nblaunch.training.options.kwargs import (AutocastKwargs, DataLoaderConfiguration, DDPCommunicationHookType,
                                              DistributedDataParallelKwargs, GradientAccumulationPlugin,
                                              GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)
from nblaunch.training.runtime.availability import (is_bf16_available, is_cuda_available, is_datasets_available,
                                                    is_fp16_available, is_hpu_available, is_mlu_available,
                                                    is_mps_available, is_npu_available, is_pytest_available,
                                                    is_torch_xla_available, is_tqdm_available,
                                                    is_transformers_available, is_xpu_available)
from nblaunch.training.runtime.collectives import (DistributedOperationException, broadcast, broadcast_object_list,
                                                   copy_tensor_to_devices, gather, gather_object,
                                                   pad_across_processes, reduce, synchronize_rng_states)
from nblaunch.training.runtime.environment import DistributedType
from nblaunch.training.runtime.main_process import tqdm, wait_for_everyone
from nblaunch.training.runtime.memory import find_executable_batch_size, release_memory
from nblaunch.training.runtime.seed import set_seed
from nblaunch.training.runtime.tree import recursively_apply, send_to_device
from nblaunch.training.tracking.base import LoggerType

__all__ = [
    "AutocastKwargs", "DataLoaderConfiguration", "FullyShardedDataParallelPlugin", "DDPCommunicationHookType",
    "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs", "InitProcessGroupKwargs",
    "ProfileKwargs", "ProjectConfiguration", "LoggerType", "DistributedType", "DistributedOperationException",
    "broadcast", "broadcast_object_list", "copy_tensor_to_devices", "gather", "gather_object", "pad_across_processes",
    "recursively_apply", "reduce", "send_to_device", "set_seed", "synchronize_rng_states", "skip_first_batches",
    "find_executable_batch_size", "release_memory", "save", "tqdm", "wait_for_everyone",
    "is_bf16_available", "is_fp16_available", "is_cuda_available", "is_mps_available", "is_xpu_available",
    "is_npu_available", "is_mlu_available", "is_hpu_available", "is_torch_xla_available",
    "is_datasets_available", "is_transformers_available", "is_pytest_available", "is_tqdm_available",
]
