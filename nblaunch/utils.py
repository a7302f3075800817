"""What Accelerate's ``accelerate.utils`` offers that training code calls, under the same names.

Port by replacing ``accelerate.utils`` (and its submodules, ``accelerate.utils.operations``,
``accelerate.utils.dataclasses``, ...) with ``nblaunch.utils``::

    from nblaunch.utils import DistributedDataParallelKwargs, gather, set_seed

Everything here works inside a launch and, where it makes sense, in a plain process.
"""

from __future__ import annotations

# Whole modules whose every public name is Accelerate's (each lists them in its __all__).
from nblaunch.training.model import introspection
from nblaunch.training.model.introspection import *  # noqa: F401,F403
from nblaunch.training.runtime import availability, operations, python_values
from nblaunch.training.runtime.availability import *  # noqa: F401,F403
from nblaunch.training.runtime.operations import *  # noqa: F401,F403
from nblaunch.training.runtime.python_values import *  # noqa: F401,F403

from nblaunch.cli.accelerate_config import write_basic_config
from nblaunch.contract.precision import PrecisionType
from nblaunch.training.checkpoint.layout import (MODEL_NAME, OPTIMIZER_NAME, PROFILE_PATTERN_NAME, RNG_STATE_NAME,
                                                 SAFE_MODEL_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
                                                 SAFE_WEIGHTS_PATTERN_NAME, SAMPLER_NAME, SCALER_NAME, SCHEDULER_NAME,
                                                 WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_PATTERN_NAME)
from nblaunch.training.checkpoint.merging import merge_fsdp_weights
from nblaunch.training.checkpoint.single import load, save
from nblaunch.training.data.prepared import skip_first_batches
from nblaunch.training.options.deepspeed_config import HfDeepSpeedConfig
from nblaunch.training.options.deepspeed_plugin import DeepSpeedPlugin, DummyOptim, DummyScheduler
from nblaunch.training.options.dynamo_plugin import DynamoBackend, TorchDynamoPlugin
from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin
from nblaunch.training.options.parallelism import ParallelismConfig
from nblaunch.training.options.kwargs import (AORecipeKwargs, AutocastKwargs, DataLoaderConfiguration, DDPCommunicationHookType,
                                              DistributedDataParallelKwargs, GradientAccumulationPlugin,
                                              GradScalerKwargs, InitProcessGroupKwargs, KwargsHandler, ProfileKwargs,
                                              RNGType)
from nblaunch.training.options.project import ProjectConfiguration
from nblaunch.training.runtime.collectives import (CannotPadNestedTensorWarning, DistributedOperationException,
                                                   broadcast, broadcast_object_list, copy_tensor_to_devices, gather,
                                                   gather_object, pad_across_processes, reduce, synchronize_rng_state,
                                                   synchronize_rng_states)
from nblaunch.training.runtime.environment import DistributedType
from nblaunch.training.runtime.main_process import tqdm, wait_for_everyone
from nblaunch.training.runtime.memory import find_executable_batch_size, release_memory
from nblaunch.training.runtime.seed import set_seed
from nblaunch.training.runtime.tree import concatenate, recursively_apply, send_to_device
from nblaunch.training.strategy.deepspeed_wrappers import (DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper,
                                                          DeepSpeedSchedulerWrapper)
from nblaunch.training.tracking.general_tracker import LoggerType

__all__ = [
    "AORecipeKwargs", "AutocastKwargs", "DataLoaderConfiguration", "FullyShardedDataParallelPlugin", "DDPCommunicationHookType",
    "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs", "InitProcessGroupKwargs",
    "KwargsHandler", "PrecisionType", "RNGType", "ProfileKwargs", "ProjectConfiguration", "LoggerType",
    "DistributedType", "DistributedOperationException", "CannotPadNestedTensorWarning",
    "broadcast", "broadcast_object_list", "copy_tensor_to_devices", "gather", "gather_object", "pad_across_processes",
    "concatenate", "recursively_apply", "reduce", "send_to_device", "set_seed", "synchronize_rng_state",
    "synchronize_rng_states", "skip_first_batches", "find_executable_batch_size", "release_memory", "save", "load", "merge_fsdp_weights", "write_basic_config", "tqdm",
    "wait_for_everyone",
    "ParallelismConfig", "TorchDynamoPlugin", "DynamoBackend", "DeepSpeedPlugin", "HfDeepSpeedConfig", "DummyOptim", "DummyScheduler", "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper",
    "MODEL_NAME", "SAFE_MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "RNG_STATE_NAME",
    "SCALER_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_INDEX_NAME",
    "WEIGHTS_PATTERN_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "PROFILE_PATTERN_NAME",
    *availability.__all__, *operations.__all__, *python_values.__all__, *introspection.__all__,
]
