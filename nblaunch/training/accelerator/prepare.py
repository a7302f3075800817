"""The ``Accelerator``'s ``prepare`` family (Accelerate's names), a group of methods of
:class:`~nblaunch.training.accelerator.core.Accelerator`: it reads the configuration, device and
process state that :class:`~nblaunch.training.accelerator.host.AcceleratorHost` declares and
records what it prepares (for checkpoints and ``free_memory``).

Example::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from nblaunch.training.accelerator.host import AcceleratorHost
from nblaunch.training.data.loaders import build_prepared_loader
from nblaunch.training.data.prepared import PreparedDataLoader, skip_first_batches
from nblaunch.training.model import placement
from nblaunch.training.model.fsdp import is_sharded
from nblaunch.training.step.optim import AcceleratedOptimizer, AcceleratedScheduler
from nblaunch.worker import step_clock

__all__ = ["PrepareMethods"]


class PrepareMethods(AcceleratorHost):
    """Models (device, autocast, DDP), optimizers, schedulers and DataLoaders made ready."""

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
        together = self._strategy.prepare_together(args, self.gradient_state)  # DeepSpeed's engine
        for i, replacement in together.items():
            results[i] = replacement
            self._record(replacement)
        # Models first: optimizers need their new parameters (XLA, FSDP). Schedulers last: they
        # need the prepared optimizers.
        for i, obj in enumerate(args):
            if isinstance(obj, torch.nn.Module) and i not in together:
                results[i] = self.prepare_model(obj, device_placement=device_placement[i])
        for i, (obj, place) in enumerate(zip(args, device_placement)):
            if not isinstance(obj, torch.nn.Module) and not _is_scheduler(obj) and i not in together:
                results[i] = self._prepare_one(obj, place)
        for i, obj in enumerate(args):
            if _is_scheduler(obj) and i not in together:
                results[i] = self.prepare_scheduler(obj)
        return results[0] if len(results) == 1 else tuple(results)

    def _record(self, prepared: Any) -> None:
        """Keep what a strategy prepared together in the lists checkpoints and ``free_memory`` read."""
        if isinstance(prepared, torch.nn.Module):
            self._models.append(prepared)
        elif isinstance(prepared, AcceleratedOptimizer):
            self._optimizers.append(prepared)
        elif isinstance(prepared, AcceleratedScheduler):
            self._schedulers.append(prepared)

    def _prepare_one(self, obj: Any, place: bool | None) -> Any:
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=place)
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj, device_placement=place)
        return obj

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Convert its layers as the precision says (``"fp8"``: Linear to Float8Linear), move it to
        the device, wrap the forward in autocast (mixed precision), spread it as the Accelerator's
        strategy does (DDP, FSDP2 with an ``fsdp_plugin``, tensor parallelism with a
        ``parallelism_config``), its forward compiled before (``dynamo_backend``, in place).

        DDP is used only with more than one process, FSDP with one too, all only for trainable
        parameters (and not with ``evaluation_mode``), never on XLA (the prepared optimizer averages
        the gradients there). Under DeepSpeed a trained model is prepared with its optimizer in one
        ``prepare`` call. Moving to XLA, sharding and splitting make new parameters: an optimizer
        prepared after is pointed at them.
        """
        if any(model is m for m in self._models) or isinstance(model, DistributedDataParallel):
            return model
        if is_sharded(model):  # sharded by the user: saved and loaded with the others
            self._models.append(model)
            return model
        if device_placement is None:
            device_placement = self.device_placement
        trainable = not evaluation_mode and not self._on_xla and any(p.requires_grad for p in model.parameters())
        strategy = self._strategy
        # Before conversion: a torchao config may give the fp8 layers new Parameters, and an
        # optimizer made before prepare must train them.
        before = dict(model.named_parameters())
        if trainable:  # before sharding: FSDP2 then shards the fp8 layers
            model = self._precision.convert(model, sharded=self.is_fsdp2)
        if device_placement and strategy.places(trainable):
            model = placement.move_keeping_ties(model, self.device) if self._on_xla else model.to(self.device)
        if strategy.autocasts(trainable):
            self._precision.wrap_forward(model)
        self._compile_step.compile(model)  # its forward, in place: DDP and FSDP2 wrap the compiled model
        model = strategy.wrap_model(model, self.device, trainable)
        clock = step_clock.current()
        if clock is not None:
            clock.watch_forward(model)
        self._replaced_parameters.record(before, model)
        for prepared in self._optimizers:  # prepared before their model
            self._replaced_parameters.switch(prepared.optimizer)
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
        self._replaced_parameters.switch(optimizer)
        self._strategy.check_optimizer(self._models, optimizer)  # e.g. one over a sharded model and more
        self._precision.optimizer_prepared(optimizer, [model for model in self._models if is_sharded(model)])
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
        shards, _ = self._strategy.data_ranks(self.num_processes, self.process_index)  # TP ranks share batches
        wrapped = AcceleratedScheduler(scheduler, optimizers, self.gradient_state,
                                       step_with_optimizer=self.step_scheduler_with_optimizer,
                                       steps_per_optimizer_step=shards if per_process else 1)
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
        # Ranks that split one model (tensor parallel) read the same batches.
        shards, shard = self._strategy.data_ranks(self.num_processes, self.process_index)
        prepared = build_prepared_loader(
            data_loader, num_processes=shards, process_index=shard,
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


def _is_scheduler(obj: Any) -> bool:
    if isinstance(obj, AcceleratedScheduler):
        return True
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", None)
    if base is not None and isinstance(obj, base):
        return True
    return isinstance(obj, torch.optim.lr_scheduler.ReduceLROnPlateau)
