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
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from nblaunch.training import ops, placement, uneven
from nblaunch.training.accumulation import Accumulate
from nblaunch.training.config import (AutocastKwargs, DataLoaderConfiguration, DistributedDataParallelKwargs,
                                      GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                                      ProfileKwargs, adopt, refuse_unsupported)
from nblaunch.training.ddp import wrap_ddp
from nblaunch.training.data import PreparedDataLoader, skip_first_batches
from nblaunch.training.loaders import build_prepared_loader
from nblaunch.training.optim import AcceleratedOptimizer, AcceleratedScheduler
from nblaunch.training.precision import (AutocastForward, autocast_dtype, check_supported,
                                         make_grad_scaler, resolve_mixed_precision)
from nblaunch.training.state import AcceleratorState, DistributedType, GradientState
from nblaunch.worker import channel

__all__ = ["Accelerator"]


# Accelerate arguments for features nblaunch does not have: refused when actually used.
_UNSUPPORTED = ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin",
                "parallelism_config", "dynamo_backend", "dynamo_plugin")
# Accelerate arguments that are accepted and have no effect here.
_IGNORED = ("log_with", "project_config", "downcast_bf16", "logging_dir")


class Accelerator:
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
        self.profile_options = ProfileKwargs()
        for handler in handlers:
            if isinstance(handler, DistributedDataParallelKwargs):
                self.ddp_options = handler
            elif isinstance(handler, GradScalerKwargs):
                scaler_kwargs = handler.to_kwargs()
            elif isinstance(handler, AutocastKwargs):
                self.autocast_kwargs = handler.to_kwargs()
            elif isinstance(handler, ProfileKwargs):
                self.profile_options = handler
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
        return self.state.distributed_type

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
        return any(opt._step_was_skipped for opt in self._optimizers)

    def __repr__(self) -> str:
        return (f"Accelerator(process {self.process_index}/{self.num_processes}, device={self.device}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")

    # -- prepare ------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers; returned in the given order.

        Anything else is returned unchanged, and so is an object that is already prepared.
        One object in, one object out; several in, a tuple out.
        """
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError("device_placement needs one entry per object")
        results: list[Any] = list(args)
        # Models first: optimizers need their moved parameters. Schedulers last: they need the
        # prepared optimizers.
        models = [i for i, obj in enumerate(args) if isinstance(obj, torch.nn.Module)]
        before = [dict(args[i].named_parameters()) for i in models] if self._on_xla else []
        for i in models:
            results[i] = self.prepare_model(args[i], device_placement=device_placement[i])
        if before:
            moved = placement.moved_parameters(before, [results[i] for i in models])
            for obj in args:
                if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer):
                    placement.switch_parameters(obj, moved)
        for i, (obj, place) in enumerate(zip(args, device_placement)):
            if not isinstance(obj, torch.nn.Module) and not _is_scheduler(obj):
                results[i] = self._prepare_one(obj, place)
        for i, obj in enumerate(args):
            if _is_scheduler(obj):
                results[i] = self.prepare_scheduler(obj)
        return results[0] if len(results) == 1 else tuple(results)

    def _prepare_one(self, obj: Any, place: bool | None) -> Any:
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=place)
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj, device_placement=place)
        return obj

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Move to the device, wrap the forward in autocast (mixed precision), wrap in DDP.

        DDP is used only with more than one process and trainable parameters (and not with
        ``evaluation_mode``), never on XLA (the prepared optimizer averages the gradients there).
        """
        if any(model is m for m in self._models) or isinstance(model, DistributedDataParallel):
            return model
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement:
            model = placement.move_keeping_ties(model, self.device) if self._on_xla else model.to(self.device)
        if self._autocast_dtype is not None and not isinstance(model.__dict__.get("forward"), AutocastForward):
            model.forward = AutocastForward(model.forward, self.device.type, self._autocast_dtype)
        if (self.num_processes > 1 and not evaluation_mode and not self._on_xla
                and any(p.requires_grad for p in model.parameters())):
            model = wrap_ddp(model, self.device, self.ddp_options)
        self._models.append(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Wrap so that ``step``/``zero_grad`` act only on sync steps, through the fp16 scaler
        (on XLA: averaging the gradients over the devices, then ``torch_xla.sync()``).

        On XLA, moving a model makes new parameters: prepare the model and its optimizer in one
        ``prepare`` call (the optimizer is pointed at the moved parameters), or create the
        optimizer after preparing the model.
        """
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        for opt in self._optimizers:
            if opt.optimizer is optimizer:
                return opt
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement and self._on_xla:
            placement.check_on_xla(optimizer)
        if device_placement and self.device.type != "cpu" and optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # moves existing state to the params' device
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.scaler, on_xla=self._on_xla)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap so that the scheduler advances once per real optimizer step."""
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        for sched in self._schedulers:
            if sched.scheduler is scheduler:
                return sched
        target = getattr(scheduler, "optimizer", None)
        if isinstance(target, AcceleratedOptimizer):
            target = target.optimizer
        optimizers = [opt for opt in self._optimizers if opt.optimizer is target] or list(self._optimizers)
        per_process = self.step_scheduler_per_process and not self.split_batches
        wrapped = AcceleratedScheduler(scheduler, optimizers, self.gradient_state,
                                       step_with_optimizer=self.step_scheduler_with_optimizer,
                                       steps_per_optimizer_step=self.num_processes if per_process else 1)
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: DataLoader,
                            device_placement: bool | None = None) -> PreparedDataLoader:
        """This process's share of ``data_loader``, its batches on the device: read by this
        process, or by rank 0 and dispatched (``dispatch_batches``; see ``loaders``)."""
        if isinstance(data_loader, PreparedDataLoader):
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        config = self.dataloader_config
        prepared = build_prepared_loader(
            data_loader, num_processes=self.num_processes, process_index=self.process_index,
            device=self.device if device_placement else None, gradient_state=self.gradient_state,
            split_batches=config.split_batches, even_batches=config.even_batches,
            non_blocking=config.non_blocking, rng_types=self.rng_types,
            seedable_sampler=config.use_seedable_sampler, data_seed=config.data_seed,
            dispatch_batches=config.dispatch_batches)
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Iterate ``dataloader`` from batch ``num_batches`` of the epoch (see ``data.skip_first_batches``)."""
        return skip_first_batches(dataloader, num_batches)

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
        return uneven.trigger_sync_in_backward(model)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """DDP's ``no_sync`` for a prepared model (nothing for an unwrapped one)."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """Autocast context of the configured mixed precision (a null context for ``"no"``)."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        kwargs = dict(self.autocast_kwargs)
        if autocast_handler is not None:
            kwargs.update(autocast_handler.to_kwargs())
        return torch.autocast(self.device.type, dtype=self._autocast_dtype, **kwargs)

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
        ``torch.nn.utils.clip_grad_norm_``; returns the total norm."""
        parameters = list(parameters)
        self._finish_gradients(parameters)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

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

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
        """The user's model out of DDP (and torch.compile); without the autocast forward if asked."""
        while True:
            if isinstance(model, DistributedDataParallel):
                model = model.module
            elif hasattr(model, "_orig_mod") and isinstance(model, torch.nn.Module):
                model = model._orig_mod
            else:
                break
        if not keep_fp32_wrapper and isinstance(model.__dict__.get("forward"), AutocastForward):
            del model.__dict__["forward"]
        return model

    # -- collectives --------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors of all processes along dim 0 (see :func:`ops.gather`)."""
        return ops.gather(tensor)

    def gather_object(self, obj: Any) -> list:
        return ops.gather_object(obj)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: the samples repeated to even out the last round are dropped,
        so over a whole prepared DataLoader the results match the dataset exactly.

        Tensors may differ in length along dim 0 between processes (``even_batches=False``).
        Non-tensor data (or ``use_gather_object=True``) goes through ``gather_object``.
        """
        as_objects = use_gather_object or not _all_tensors(input_data)
        if as_objects:
            data = ops.gather_object(input_data if isinstance(input_data, (list, tuple)) else [input_data])
        else:
            data = ops.gather(input_data, allow_uneven_dim0=True)
        loader = self.gradient_state.active_dataloader
        if loader is not None and loader.end_of_dataloader and self.num_processes > 1:
            real = loader.remainder
            if real >= 0:
                data = data[:real] if as_objects else ops.recursively_apply(lambda t: t[:real], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return ops.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> Any:
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        return ops.broadcast(tensor, from_process)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        return self.state.split_between_processes(inputs, apply_padding)

    def main_process_first(self) -> Any:
        return self.state.main_process_first()

    def local_main_process_first(self) -> Any:
        return self.state.local_main_process_first()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.state.local_process_index == 0:
            print(*args, **kwargs)

    def on_main_process(self, function: Callable) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Any:
        return self.state.on_process(function, process_index)

    def set_trigger(self) -> None:
        """Raise a flag on this process; :meth:`check_trigger` tells every process (early stop)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger` (then lowered)."""
        flag = torch.tensor([1.0 if self._trigger else 0.0], device=self.device)
        flag = ops.reduce(flag, "sum")
        if flag.item() > 0:
            self._trigger = False
            return True
        return False

    # -- checkpoints --------------------------------------------------------------------------

    def _checkpoint_dir(self, path: Any) -> str:
        if path is not None:
            return os.fspath(path)
        if self.project_dir is None:
            raise ValueError("give a directory, or Accelerator(project_dir=...)")
        return os.path.join(self.project_dir, "checkpoint")

    def save_state(self, output_dir: str | os.PathLike | None = None, **kwargs: Any) -> str:
        """Save models, optimizers, schedulers, scaler, every rank's RNG states and data positions.

        Call it on every process (it ends with a barrier). Returns the directory.
        """
        from nblaunch.training.checkpoint import save_state
        return save_state(self, self._checkpoint_dir(output_dir))

    def load_state(self, input_dir: str | os.PathLike | None = None, strict: bool = True, **kwargs: Any) -> None:
        """Restore what :meth:`save_state` wrote; prepared DataLoaders resume mid-epoch."""
        from nblaunch.training.checkpoint import load_state
        load_state(self, self._checkpoint_dir(input_dir), strict=strict)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save/load these objects (each needs ``state_dict`` and ``load_state_dict``)."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"{type(obj).__name__} has no state_dict/load_state_dict")
            self._custom_objects.append(obj)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """``torch.save`` on the main process only (call it on every process: on XLA tensors are
        copied to the CPU first, ``xm.save``'s way)."""
        from nblaunch.training.checkpoint import host_saver
        save = host_saver(self.state)
        if self.is_main_process:
            save(obj, f)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike,
                   max_shard_size: Any = None, safe_serialization: bool = True) -> str:
        """Write the unwrapped model's weights (main process): ``model.safetensors`` when
        ``safetensors`` is installed and asked for, else ``pytorch_model.bin``. Returns the path."""
        from nblaunch.training.checkpoint import host_saver
        save_directory = os.fspath(save_directory)
        state_dict = self.get_state_dict(model)
        save = host_saver(self.state)
        save_file = None
        if safe_serialization:
            try:
                from safetensors.torch import save_file
            except ImportError:
                warnings.warn("safetensors is not installed: writing pytorch_model.bin", stacklevel=2)
        if save_file is not None:
            path = os.path.join(save_directory, "model.safetensors")
        else:
            path = os.path.join(save_directory, "pytorch_model.bin")
        if self.is_main_process:
            os.makedirs(save_directory, exist_ok=True)
            if save_file is not None:
                save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, path,
                          metadata={"format": "pt"})
            else:
                save(state_dict, path)
        self.wait_for_everyone()
        return path

    # -- logging ------------------------------------------------------------------------------

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send scalar metrics to the launching cell (every rank sends; the display chooses).

        Outside a launch it does nothing. Tensors are turned into numbers (``.item()``).
        """
        channel.log_metrics(values, step)  # a no-op outside a launch

    def init_trackers(self, project_name: str, config: dict | None = None,
                      init_kwargs: dict | None = None) -> None:
        """Accepted for compatibility: metrics go to the launching cell, not to trackers."""
        self.project_name = project_name
        self.config = config

    def get_tracker(self, name: str, unwrap: bool = False) -> None:
        return None

    def end_training(self) -> None:
        self.wait_for_everyone()

    def free_memory(self, *objects: Any) -> tuple:
        """Drop references to everything prepared (and empty the CUDA cache)."""
        import gc
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._custom_objects.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return tuple(None for _ in objects)

    clear = free_memory


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


def _is_scheduler(obj: Any) -> bool:
    if isinstance(obj, AcceleratedScheduler):
        return True
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", None)
    if base is not None and isinstance(obj, base):
        return True
    return isinstance(obj, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (tuple, list)):
        return len(data) > 0 and all(_all_tensors(d) for d in data)
    if isinstance(data, dict):
        return len(data) > 0 and all(_all_tensors(d) for d in data.values())
    return False
