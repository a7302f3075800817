"""What Accelerate's ``accelerate.utils`` offers that training code calls, under the same names.

Port by replacing ``accelerate.utils`` (and its submodules, ``accelerate.utils.operations``,
``accelerate.utils.dataclasses``, ...) with ``nblaunch.utils``::

    from nblaunch.utils import DistributedDataParallelKwargs, gather, set_seed

Everything here works inside a launch and, where it makes sense, in a plain process.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import inspect
from typing import Any, Callable

import torch

from nblaunch.training.options.kwargs import (AutocastKwargs, DataLoaderConfiguration, DDPCommunicationHookType,
                                      DistributedDataParallelKwargs, GradientAccumulationPlugin, GradScalerKwargs,
                                      InitProcessGroupKwargs, ProfileKwargs)
from nblaunch.training.data.prepared import skip_first_batches
from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin
from nblaunch.training.runtime.collectives import (DistributedOperationException, broadcast, broadcast_object_list,
                                                   copy_tensor_to_devices, gather, gather_object,
                                                   pad_across_processes, reduce)
from nblaunch.training.runtime.tree import recursively_apply, send_to_device
from nblaunch.training.runtime.seed import set_seed, synchronize_rng_states
from nblaunch.training.runtime.state import DistributedType

__all__ = [
    "AutocastKwargs", "DataLoaderConfiguration", "FullyShardedDataParallelPlugin", "DDPCommunicationHookType", "DistributedDataParallelKwargs",
    "GradientAccumulationPlugin", "GradScalerKwargs", "InitProcessGroupKwargs", "ProfileKwargs",
    "DistributedType", "DistributedOperationException",
    "broadcast", "broadcast_object_list", "copy_tensor_to_devices", "gather", "gather_object", "pad_across_processes", "recursively_apply",
    "reduce", "send_to_device", "set_seed", "synchronize_rng_states", "skip_first_batches",
    "find_executable_batch_size", "release_memory",
    "is_bf16_available", "is_fp16_available", "is_cuda_available", "is_mps_available", "is_xpu_available",
    "is_npu_available", "is_mlu_available", "is_hpu_available", "is_torch_xla_available",
    "is_datasets_available", "is_transformers_available", "is_pytest_available", "is_tqdm_available",
]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 compute on this machine's accelerator (CUDA with bf16), or on the CPU."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    return True  # on the CPU as well (with a GradScaler, as on CUDA)


def is_mps_available(min_version: str = "1.12") -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def is_xpu_available(check_device: bool = False) -> bool:
    return bool(getattr(torch, "xpu", None) and torch.xpu.is_available())


def is_npu_available(check_device: bool = False) -> bool:
    return False  # nblaunch does not drive Ascend NPUs


def is_mlu_available(check_device: bool = False) -> bool:
    return False


def is_hpu_available(init_hccl: bool = False) -> bool:
    return False


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return _installed("torch_xla")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_pytest_available() -> bool:
    return _installed("pytest")


def is_tqdm_available() -> bool:
    return _installed("tqdm")


def release_memory(*objects: Any) -> list:
    """Drop references, collect garbage and empty the CUDA cache; returns ``[None] * len(objects)``."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return objects


def _out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and ("out of memory" in text.lower() or "DefaultCPUAllocator" in text))


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable:
    """Decorator: call ``function(batch_size, ...)`` from ``starting_batch_size``, halving the
    batch size after each out-of-memory error, as Accelerate's decorator of that name.

    Example::

        @find_executable_batch_size(starting_batch_size=256)
        def train(batch_size):
            ...
        train()   # no batch_size argument: the decorator supplies it
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    shrink = reduce_batch_size_fn or (lambda: batch_size // 2)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        first = next(iter(inspect.signature(function).parameters), None)
        if args and first is not None and len(args) >= len(inspect.signature(function).parameters):
            raise TypeError(f"{function.__name__} gets its first argument ({first}) from "
                            "find_executable_batch_size: do not pass it")
        while True:
            if batch_size == 0:
                raise RuntimeError("no executable batch size found: it reached zero")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not _out_of_memory(error):
                    raise
                release_memory()
                batch_size = shrink()

    return wrapper
