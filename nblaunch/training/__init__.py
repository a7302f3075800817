"""The training side of nblaunch: an Accelerate-compatible ``Accelerator`` for each worker.

Example::

    from nblaunch.training import Accelerator, set_seed

    def train():
        set_seed(0)
        accelerator = Accelerator()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        ...
"""

from nblaunch.training.accelerator.core import Accelerator
from nblaunch.training.data.loaders import DataLoaderDispatcher, SeedableRandomSampler, prepare_data_loader
from nblaunch.training.data.prepared import skip_first_batches
from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin
from nblaunch.training.options.parallelism import ParallelismConfig
from nblaunch.training.options.kwargs import (AutocastKwargs, DataLoaderConfiguration, DDPCommunicationHookType,
                                              DistributedDataParallelKwargs, GradientAccumulationPlugin,
                                              GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)
from nblaunch.training.runtime.collectives import (broadcast, broadcast_object_list, gather, gather_object,
                                                   pad_across_processes, reduce)
from nblaunch.training.runtime.seed import set_seed
from nblaunch.training.runtime.state import AcceleratorState, DistributedType, PartialState, reset_process_state
from nblaunch.training.runtime.tree import send_to_device
from nblaunch.training.step.gradient_state import GradientState
from nblaunch.training.step.local_sgd import LocalSGD

__all__ = [
    "Accelerator", "PartialState", "AcceleratorState", "GradientState", "DistributedType", "reset_process_state",
    "prepare_data_loader", "SeedableRandomSampler", "DataLoaderDispatcher", "LocalSGD",
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "FullyShardedDataParallelPlugin", "GradScalerKwargs",
    "GradientAccumulationPlugin", "AutocastKwargs", "InitProcessGroupKwargs", "ProfileKwargs",
    "DDPCommunicationHookType", "ParallelismConfig", "set_seed", "skip_first_batches",
    "gather", "gather_object", "reduce", "pad_across_processes", "broadcast",
    "broadcast_object_list", "send_to_device",
]
