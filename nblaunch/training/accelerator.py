"""The ``Accelerator``: the training side of a launch, with Accelerate's names and semantics.

Replace ``from accelerate import Accelerator`` by ``from nblaunch import Accelerator`` and a
training function keeps working::

    def train():
        accelerator = Accelerator(mixed_precision="bf16")
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            accelerator.log({"loss": loss}, step=...)

    notebook_launcher(train, num_processes=2)

On XLA (``notebook_launcher(train, start_method="xla")``, automatic on TPU hosts) the same
function runs once per device: no DDP, gradients averaged by the prepared optimizer through XLA,
one ``torch_xla.sync()`` per batch and per optimizer step, bf16 through autocast on the device.

The differences from Accelerate that are on purpose are listed in ``docs/accelerator.md``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable

import torch

from nblaunch.training.data import uneven
from nblaunch.training.step import profiling
from nblaunch.training.accelerator_collectives import CollectiveMethods
from nblaunch.training.accelerator_persistence import PersistenceMethods
from nblaunch.training.accelerator_prepare import PrepareMethods
from nblaunch.training.step.accumulation import Accumulate
from nblaunch.training.options.kwargs import (AutocastKwargs, DataLoaderConfiguration, DistributedDataParallelKwargs,
                                      GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                                      ProfileKwargs, adopt, refuse_unsupported)
from nblaunch.training.data.prepared import PreparedDataLoader
from nblaunch.training.model.fsdp import total_norm
from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin, ShardingSettings, sharding_settings
from nblaunch.training.step.gradient_state import GradientState
from nblaunch.training.model.gradient_sync import paused_gradient_sync, trigger_sync_in_backward
from nblaunch.training.step.optim import AcceleratedOptimizer, AcceleratedScheduler
from nblaunch.training.model.placement import ReplacedParameters
from nblaunch.training.model.precision import (autocast_dtype, check_supported,
                                         make_grad_scaler, resolve_mixed_precision)
from nblaunch.training.runtime.state import AcceleratorState, DistributedType

__all__ = ["Accelerator"]


# Accelerate arguments for features nblaunch does not have: refused when actually used.
_UNSUPPORTED = ("deepspeed_plugin", "megatron_lm_plugin", "torch_tp_plugin",
                "parallelism_config", "dynamo_backend", "dynamo_plugin")
# Accelerate arguments that are accepted and have no effect here.
_IGNORED = ("log_with", "project_config", "downcast_bf16", "logging_dir")


class Accelerator(PrepareMethods, CollectiveMethods, PersistenceMethods):
    """Per-process training helper: device placement, DDP, mixed precision, accumulation,
    sharded data, collectives and checkpoints.

    Args:
        device_placement: move prepared models and batches to ``accelerator.device``.
        split_batches: the DataLoader batch size is the global one (split between processes).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; None reads
            ``NBLAUNCH_MIXED_PRECISION`` (the launcher's ``mixed_precision=``), default ``"no"``.
        gradient_accumulation_steps: micro-steps per optimizer step (with :meth:`accumulate`).
        cpu: use the CPU (gloo) even if CUDA is available.
        dataloader_config: a :class:`DataLoaderConfiguration`.
        even_batches: shortcut for ``dataloader_config.even_batches``.
        step_scheduler_with_optimizer: prepared schedulers advance only after a real optimizer
            step (True) or at every ``step()`` call (False).
        step_scheduler_per_process: after a real optimizer step a prepared scheduler steps once
            per process (True, Accelerate's behaviour: a schedule sized from the unprepared
            loader's length ends with the data) or once (False: 2 processes x batch b then train
            exactly like 1 process x batch 2b). With ``split_batches`` it steps once either way.
        kwargs_handlers: :class:`DistributedDataParallelKwargs`, :class:`GradScalerKwargs`,
            :class:`AutocastKwargs`.
        gradient_accumulation_plugin: a :class:`GradientAccumulationPlugin`.
        project_dir: default directory of ``save_state`` / ``load_state``.
        rng_types: RNGs given rank 0's state at the start of every epoch of a prepared loader
            (Accelerate's; default ``["generator"]``, the shuffle's own generator).
        fsdp_plugin: a :class:`~nblaunch.utils.FullyShardedDataParallelPlugin` (or Accelerate's):
            ``prepare`` shards models with FSDP2 instead of wrapping them in DDP.

    Example::

        accelerator = Accelerator(gradient_accumulation_steps=2)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        step_scheduler_with_optimizer: bool = True,
        step_scheduler_per_process: bool = True,
        kwargs_handlers: Iterable[Any] | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        even_batches: bool | None = None,
        project_dir: str | os.PathLike | None = None,
        rng_types: list[str] | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | Any = None,
        **kwargs: Any,
    ) -> None:
        for name, value in kwargs.items():
            if name in _UNSUPPORTED:
                if value not in (None, False, "no", "NO"):
                    raise NotImplementedError(f"Accelerator({name}=...) is not supported by nblaunch")
            elif name == "dispatch_batches":  # Accelerate before 1.0 took it here
                continue
            elif name not in _IGNORED:
                raise TypeError(f"Accelerator() got an unexpected keyword argument {name!r}")
        handlers = [adopt(h) for h in kwargs_handlers or ()]  # Accelerate's own objects too
        group = next((h for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
        self.state = AcceleratorState(cpu=cpu, **_group_arguments(group))
        self.device: torch.device = self.state.device
        self.device_placement = device_placement
        self.mixed_precision: str = resolve_mixed_precision(mixed_precision)
        check_supported(self.mixed_precision, self.device)
        self._autocast_dtype = autocast_dtype(self.mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        self._sharding: ShardingSettings | None = None
        if fsdp_plugin is not None:
            if self.state.distributed_type is DistributedType.XLA:
                raise NotImplementedError("fsdp_plugin is not supported on XLA devices by nblaunch")
            self._sharding = sharding_settings(fsdp_plugin, self.mixed_precision)  # refuses before any step
        self.state.fsdp_plugin = fsdp_plugin

        config = adopt(dataloader_config) if dataloader_config is not None else DataLoaderConfiguration()
        refuse_unsupported(config)
        if split_batches is not None:
            config.split_batches = split_batches
        if even_batches is not None:
            config.even_batches = even_batches
        if kwargs.get("dispatch_batches") is not None:
            config.dispatch_batches = kwargs["dispatch_batches"]
        self.dataloader_config = config
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]

        self.ddp_options = DistributedDataParallelKwargs()
        scaler_kwargs: dict[str, Any] = {}
        self.autocast_kwargs: dict[str, Any] = {}
        self.profile_handler: ProfileKwargs | None = None
        for handler in handlers:
            if isinstance(handler, DistributedDataParallelKwargs):
                self.ddp_options = handler
            elif isinstance(handler, GradScalerKwargs):
                scaler_kwargs = handler.to_kwargs()
            elif isinstance(handler, AutocastKwargs):
                self.autocast_kwargs = handler.to_kwargs()
            elif isinstance(handler, ProfileKwargs):
                self.profile_handler = handler
            elif not isinstance(handler, InitProcessGroupKwargs):
                raise TypeError(f"unsupported kwargs handler {type(handler).__name__}")

        self.sync_each_batch = False
        if gradient_accumulation_plugin is not None:
            plugin = adopt(gradient_accumulation_plugin)
            if gradient_accumulation_steps != 1:
                raise ValueError("give gradient_accumulation_steps or gradient_accumulation_plugin, not both")
            steps, sync_with_dataloader = plugin.num_steps or 1, plugin.sync_with_dataloader
            self.sync_each_batch = plugin.sync_each_batch
        else:
            steps, sync_with_dataloader = gradient_accumulation_steps, True
        if steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}")
        self.gradient_state = GradientState(steps, sync_with_dataloader)

        self.scaler: torch.amp.GradScaler | None = None
        if self.mixed_precision == "fp16":
            self.scaler = make_grad_scaler(self.device, **scaler_kwargs)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.step_scheduler_per_process = step_scheduler_per_process
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None

        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list[Any] = []
        self._replaced_parameters = ReplacedParameters()
        self._trigger = False
        self.trackers: list[Any] = []
        self._accumulate_context: Accumulate | None = None

    # -- process state --------------------------------------------------------------------------

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def distributed_type(self) -> DistributedType:
        if self._sharding is not None and self.state.num_processes > 1:
            return DistributedType.FSDP
        return self.state.distributed_type

    @property
    def is_fsdp2(self) -> bool:
        """True when ``prepare`` shards models (an ``fsdp_plugin`` was given): always FSDP2 here."""
        return self._sharding is not None

    @property
    def use_distributed(self) -> bool:
        return self.state.num_processes > 1

    @property
    def _on_xla(self) -> bool:
        return self.state.distributed_type is DistributedType.XLA

    @property
    def is_main_process(self) -> bool:
        return self.state.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.state.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.state.process_index == self.state.num_processes - 1

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def sync_gradients(self) -> bool:
        """True on micro-steps where gradients are synchronised and the optimizer steps."""
        return self.gradient_state.sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.num_steps = steps

    @property
    def step(self) -> int:
        """Micro-steps since the last synchronised step."""
        return self.gradient_state.step

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True if the last optimizer step was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    def __repr__(self) -> str:
        return (f"Accelerator(process {self.process_index}/{self.num_processes}, device={self.device}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")

    # -- training step --------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled under fp16."""
        steps = self.gradient_state.num_steps
        if steps > 1:
            loss = loss / steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def accumulate(self, *models: torch.nn.Module) -> Accumulate:
        """Context for one micro-step of gradient accumulation.

        Sets ``sync_gradients``: True every ``gradient_accumulation_steps`` micro-steps and on the
        last batch of a prepared DataLoader; otherwise DDP's ``no_sync`` skips the all-reduce and
        the prepared optimizer/scheduler do nothing.
        """
        cached = self._accumulate_context
        if cached is not None and cached.stack is None and len(cached.models) == len(models) and all(
                a is b for a, b in zip(cached.models, models)):
            return cached  # the same models as last step: no new object per step
        cached = self._accumulate_context = Accumulate(self.gradient_state, models, self.sync_each_batch)
        return cached

    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Any:
        """Context: ranks that run out of batches keep answering the others' collectives
        (torch's ``Join`` over DDP models); ``even_batches`` overrides the prepared loaders'."""
        distributed = self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        return uneven.join_uneven_inputs(joinables, self._dataloaders, distributed,
                                         self.distributed_type is DistributedType.NO,
                                         self.dataloader_config.even_batches, even_batches)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Any:
        """Context: the next backward of ``model`` all-reduces, even in an accumulating step."""
        return trigger_sync_in_backward(model)

    def no_sync(self, model: torch.nn.Module) -> Any:
        """Context: no gradient reduction in its backward passes (DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``); nothing for an unwrapped model."""
        return paused_gradient_sync(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """Autocast context of the configured mixed precision (a null context for ``"no"``)."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        kwargs = dict(self.autocast_kwargs)
        if autocast_handler is not None:
            kwargs.update(autocast_handler.to_kwargs())
        return torch.autocast(self.device.type, dtype=self._autocast_dtype, **kwargs)

    def profile(self, profile_handler: ProfileKwargs | None = None) -> Any:
        """Profile the block with torch's profiler (``ProfileKwargs``: this one, else the one
        given in ``kwargs_handlers``); each rank's Chrome trace goes to ``output_trace_dir``::

            with accelerator.profile() as prof:
                train_step()
            accelerator.print(prof.key_averages().table(row_limit=5))
        """
        options = adopt(profile_handler) if profile_handler is not None else self.profile_handler
        return profiling.profile(options or ProfileKwargs(), self.process_index)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the fp16 loss scale (before clipping); only on sync steps."""
        if self.scaler is None or not self.gradient_state.sync_gradients:
            return
        if optimizer is None:
            optimizers = self._optimizers
        else:
            optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            self.scaler.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Unscale (fp16) or average over the XLA devices, then
        ``torch.nn.utils.clip_grad_norm_``; returns the total norm (over every rank's shards
        for a sharded model)."""
        parameters = list(parameters)
        self._finish_gradients(parameters)
        return total_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        parameters = list(parameters)
        self._finish_gradients(parameters)
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def _finish_gradients(self, parameters: list) -> None:
        """Make the gradients final before clipping: unscaled (fp16), averaged (XLA)."""
        optimizers = self._optimizers_of(parameters)
        self.unscale_gradients(optimizers)
        if self._on_xla and self.gradient_state.sync_gradients:
            for opt in optimizers:
                opt.reduce_gradients()  # the prepared optimizer then does not reduce again

    def _optimizers_of(self, parameters: list) -> list[AcceleratedOptimizer]:
        ids = {id(p) for p in parameters}
        return [opt for opt in self._optimizers
                if any(id(p) in ids for g in opt.param_groups for p in g["params"])]


def _group_arguments(group: InitProcessGroupKwargs | None) -> dict[str, Any]:
    """PartialState's arguments from Accelerate's InitProcessGroupKwargs: its timeout, and its
    backend where it was chosen (its default, nccl, only means "the device's own")."""
    if group is None:
        return {}
    arguments: dict[str, Any] = {}
    if group.timeout is not None:
        arguments["timeout"] = group.timeout
    if group.backend not in (None, "nccl"):
        arguments["backend"] = group.backend
    return arguments
