"""Accelerate's configuration objects: the same names and fields, and Accelerate's own objects
accepted in their place.

Code that keeps ``from accelerate.utils import DistributedDataParallelKwargs`` and passes that
object to nblaunch's ``Accelerator`` works: handlers are recognised by their class name and read
by their fields (``adopt``), never by ``isinstance``.

Example::

    from nblaunch.utils import DistributedDataParallelKwargs
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from nblaunch.contract.precision import ListedEnum

__all__ = [
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradScalerKwargs", "AutocastKwargs",
    "InitProcessGroupKwargs", "ProfileKwargs", "GradientAccumulationPlugin", "DDPCommunicationHookType",
    "KwargsHandler", "RNGType", "AORecipeKwargs", "adopt", "refuse_unsupported",
]


class DDPCommunicationHookType(str, enum.Enum):
    """DDP communication hooks, as Accelerate names them."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class RNGType(ListedEnum):
    """``rng_types`` values, as Accelerate names them; nblaunch synchronises TORCH, CUDA, XLA
    and GENERATOR."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    GENERATOR = "generator"


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards DataLoaders (Accelerate's fields and defaults).

    ``dispatch_batches``: rank 0 reads every batch and sends each rank its part (None: only for
    iterable data sets). ``use_seedable_sampler``/``data_seed``: shuffle with a sampler seeded
    per epoch. ``use_stateful_dataloader``: ``torchdata``'s StatefulDataLoader state in
    checkpoints. ``non_blocking``: asynchronous host-to-device copies (CUDA).
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


class KwargsHandler:
    """The base of the ``*Kwargs`` handlers (dataclasses whose fields are a call's arguments)."""

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from their defaults."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``torch.nn.parallel.DistributedDataParallel``, and its communication hook."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def ddp_arguments(self) -> dict[str, Any]:
        """What goes to DistributedDataParallel's constructor (not the hook fields)."""
        hook_fields = {"comm_hook", "comm_wrapper", "comm_state_option"}
        return {k: v for k, v in self.to_kwargs().items() if k not in hook_fields}


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for ``torch.amp.GradScaler`` (fp16)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group``. The backend defaults to what the
    device needs (gloo on CPU, nccl on CUDA); ``timeout`` bounds every collective."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments for ``torch.profiler.profile`` (``Accelerator.profile``)."""

    activities: list | None = None
    schedule_option: dict | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None


@dataclass
class GradientAccumulationPlugin:
    """``num_steps`` micro-steps per optimizer step. ``sync_each_batch``: all-reduce gradients at
    every micro-step (less memory with DDP, more communication)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class AORecipeKwargs(KwargsHandler):
    """fp8 training through torchao (``mixed_precision="fp8"``): ``config`` a torchao
    ``Float8LinearConfig`` (None: torchao's, with the two settings below), and
    ``module_filter_func(module, name) -> bool`` which Linear layers to convert (None: every
    Linear but the model's first and last, with both sizes divisible by 16, as Accelerate).
    ``pad_inner_dim``: pad sizes to multiples of 16 (default off); ``enable_fsdp_float8_all_gather``:
    FSDP2 gathers the weights in fp8 (default: on GPUs under an ``fsdp_plugin``)."""

    config: Any = None
    module_filter_func: Any = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None


# Accelerate's other fp8 recipes: their backends are not nblaunch's.
_OTHER_FP8_RECIPES = {"TERecipeKwargs": "TransformerEngine", "MSAMPRecipeKwargs": "MS-AMP",
                      "FP8RecipeKwargs": "TransformerEngine or MS-AMP"}

_OURS = {cls.__name__: cls for cls in (
    DataLoaderConfiguration, DistributedDataParallelKwargs, GradScalerKwargs, AutocastKwargs,
    InitProcessGroupKwargs, ProfileKwargs, GradientAccumulationPlugin, AORecipeKwargs,
)}


def adopt(obj: Any) -> Any:
    """Our configuration object for ``obj``: itself if it is ours; an Accelerate object (or any
    object of the same class name) rebuilt from its fields. Raises TypeError for anything else.

    Example::

        from accelerate.utils import DistributedDataParallelKwargs as Theirs
        adopt(Theirs(find_unused_parameters=True)).find_unused_parameters   # True
    """
    name = type(obj).__name__
    if name in _OTHER_FP8_RECIPES:
        raise NotImplementedError(f"{name} ({_OTHER_FP8_RECIPES[name]} fp8) is not supported by nblaunch: give "
                                  "AORecipeKwargs() for fp8 through torchao (pip install \"nblaunch[fp8]\")")
    ours = _OURS.get(name)
    if ours is None:
        raise TypeError(f"unsupported configuration object {type(obj).__module__}.{type(obj).__qualname__}")
    if isinstance(obj, ours):
        return obj
    values = {}
    for f in fields(ours):
        if hasattr(obj, f.name):
            value = getattr(obj, f.name)
            if f.name in ("comm_hook", "comm_wrapper"):
                value = DDPCommunicationHookType(getattr(value, "value", value))
            values[f.name] = value
    return ours(**values)


def refuse_unsupported(config: DataLoaderConfiguration) -> None:
    """DataLoaderConfiguration options nblaunch does not do yet: an error, never a silent difference."""
    if config.use_stateful_dataloader:
        raise NotImplementedError("DataLoaderConfiguration(use_stateful_dataloader=True) is not supported by "
                                  "nblaunch yet: save_state already records every prepared loader's position")
