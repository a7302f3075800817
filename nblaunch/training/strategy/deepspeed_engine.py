"""``DeepSpeedStrategy``: ZeRO stages 0-3 (and offload) through DeepSpeed itself, as Accelerate's
DeepSpeed path does it, on GPUs (NCCL) and on CPU ranks (gloo; DeepSpeed picks its CPU
accelerator by itself, which Accelerate cannot use).

``prepare`` hands the model, optimizer and scheduler to ``deepspeed.initialize`` together, after
filling the config's "auto" values from the training (the DataLoader's batch size, the
Accelerator's accumulation steps, clipping 1.0) and refusing a config that contradicts it;
nothing is half-prepared when it refuses. ``backward`` is the engine's backward, and its step at
the end of each accumulation window. Checkpoints are DeepSpeed's own (``pytorch_model/``), so
Accelerate's DeepSpeed path resumes them and the other way round.

Example::

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader

from nblaunch.contract.variables import LOCAL_RANK, RANK, WORLD_SIZE
from nblaunch.training.model.unwrap import is_deepspeed_engine
from nblaunch.training.options.deepspeed_config import HfDeepSpeedConfig
from nblaunch.training.options.deepspeed_plugin import DeepSpeedPlugin, DummyOptim, DummyScheduler
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.step.gradient_state import GradientState
from nblaunch.training.step.optim import AcceleratedOptimizer
from nblaunch.training.strategy.deepspeed_wrappers import (DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper,
                                                          DeepSpeedSchedulerWrapper)
from nblaunch.training.strategy.strategy_interface import Strategy, deepspeed_tag
from nblaunch.training.strategy.saved_by_strategy import SavedByStrategy

__all__ = ["DeepSpeedStrategy", "require_deepspeed"]

INSTALL = 'pip install "nblaunch[deepspeed]"'


def require_deepspeed() -> None:
    """Refuse, naming the extra to install, where DeepSpeed cannot be imported."""
    try:
        import deepspeed  # noqa: F401  (deferred: an optional extra, ~3 s to import)
    except ImportError as error:
        raise ImportError(f"deepspeed_plugin needs DeepSpeed, which is not installed: {INSTALL} "
                          f"({error})") from None


class DeepSpeedStrategy(Strategy):
    """DeepSpeed's engine for the one trained model (Accelerate's ``DistributedType.DEEPSPEED``)."""

    distributed_type = DistributedType.DEEPSPEED

    def __init__(self, plugin: DeepSpeedPlugin, state: PartialState, mixed_precision: str,
                 split_batches: bool) -> None:
        if mixed_precision == "fp8":  # before DeepSpeed is imported or its config read
            raise NotImplementedError("mixed_precision='fp8' with a deepspeed_plugin is not supported by nblaunch: "
                                      "train DeepSpeed in 'bf16', or fp8 with DDP or an fsdp_plugin")
        require_deepspeed()
        plugin.set_mixed_precision(mixed_precision)  # refuses a config of the other precision
        self.plugin = plugin
        self.state = state
        self.split_batches = split_batches
        self.wrapper: DeepSpeedEngineWrapper | None = None
        self.gradient_state: GradientState | None = None
        self._warned_clipping = False
        self._transformers_config = _zero3_init_for_transformers(plugin)  # kept: transformers holds a weakref

    def places(self, trainable: bool) -> bool:
        return not trainable  # DeepSpeed moves (or partitions) the model itself

    def autocasts(self, trainable: bool) -> bool:
        return False  # DeepSpeed's fp16/bf16 sections, not autocast

    def own_precision(self) -> str | None:
        return self.plugin.config_precision()  # the config's fp16/bf16 sections, no autocast or GradScaler

    def refuses_compile(self) -> str | None:
        return ("dynamo_backend with a deepspeed_plugin is not supported by nblaunch yet: compile with "
                "DDP or an fsdp_plugin, or train DeepSpeed eagerly (dynamo_backend='no')")

    def divides_loss(self) -> bool:
        return False  # the engine divides by its gradient_accumulation_steps

    def describe(self) -> str:
        return f"DeepSpeed ZeRO-{self.plugin.zero_stage}"

    def owns_scheduler(self, scheduler: Any) -> bool:
        return isinstance(scheduler, DeepSpeedSchedulerWrapper)

    def release(self) -> None:
        if self.wrapper is not None and hasattr(self.wrapper.engine, "destroy"):
            self.wrapper.engine.destroy()  # its hooks and buffers, as Accelerate's free_memory does
        self.wrapper = None
        self.gradient_state = None

    def wrap_model(self, model: torch.nn.Module, device: torch.device, trainable: bool) -> torch.nn.Module:
        if trainable:  # prepare_together takes every trained model of a prepare() call
            raise ValueError("under DeepSpeed a trained model is prepared with its optimizer (and training "
                             "DataLoader) in one prepare() call: DeepSpeed's engine takes them together")
        return model

    def check_optimizer(self, models: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        engine = self.wrapper.engine if self.wrapper is not None else None
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if engine is not None and ids & {id(p) for p in engine.module.parameters()}:
            raise ValueError("this optimizer trains the DeepSpeed engine's model, which DeepSpeed's own optimizer "
                             "steps: prepare the model and its optimizer in one prepare() call")

    # -- prepare -------------------------------------------------------------------------------

    def prepare_together(self, args: tuple, gradient_state: GradientState) -> dict[int, Any]:
        models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module) and not is_deepspeed_engine(a)
                  and any(p.requires_grad for p in a.parameters())]
        if not models:
            return {}
        if len(models) > 1 or self.wrapper is not None:
            raise ValueError("DeepSpeed trains one model per Accelerator (its engine holds the optimizer): a model "
                             "that is not trained (a reference, a teacher) is prepared with requires_grad_(False) "
                             "or prepare_model(model, evaluation_mode=True); several trained ones, as one Module")
        optimizers = [i for i, a in enumerate(args) if isinstance(a, (torch.optim.Optimizer, DummyOptim))
                      and not isinstance(a, AcceleratedOptimizer)]
        if len(optimizers) > 1:
            raise ValueError("DeepSpeed steps one optimizer per model: prepare one")
        if not optimizers:
            raise ValueError("under DeepSpeed a trained model is prepared with its optimizer (and training "
                             "DataLoader) in one prepare() call: DeepSpeed's engine takes them together; a model "
                             "only evaluated is prepared with prepare_model(model, evaluation_mode=True)")
        schedulers = [i for i, a in enumerate(args) if isinstance(a, DummyScheduler)]
        loaders = [a for a in args if isinstance(a, DataLoader)]
        model = args[models[0]]
        optimizer = args[optimizers[0]] if optimizers else None
        scheduler = args[schedulers[0]] if schedulers else None
        config, steps = self._filled_config(model, optimizer, scheduler, loaders, gradient_state)  # refuses here
        kwargs: dict[str, Any] = {"model": model, "config_params": config}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
        elif optimizer is not None:
            kwargs["optimizer"] = self._cpu_optimizer(optimizer, config)
        if scheduler is not None and scheduler.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        self.state.ensure_process_group()  # one process outside a launch: a group of its own
        _one_process_variables()
        import deepspeed  # deferred: the optional extra
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(**kwargs)
        self.wrapper = DeepSpeedEngineWrapper(engine)
        self.gradient_state = gradient_state
        gradient_state.num_steps = steps  # the config's, where it set one (as under Accelerate)
        self.plugin.deepspeed_config.clear()  # the filled config is the plugin's from now on, as Accelerate's
        self.plugin.deepspeed_config.update(config)
        self.plugin.hf_ds_config.set_stage_and_offload()
        replaced: dict[int, Any] = {models[0]: engine}
        if optimizer is not None:
            wrapped = DeepSpeedOptimizerWrapper(ds_optimizer, gradient_state)
            replaced[optimizers[0]] = wrapped
            if scheduler is not None:
                replaced[schedulers[0]] = DeepSpeedSchedulerWrapper(ds_scheduler, [wrapped], gradient_state)
        return replaced

    def _filled_config(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, loaders: list[DataLoader],
                       gradient_state: GradientState) -> tuple[dict, int]:
        """The config with every "auto" filled, checked against the Accelerator, and the
        accumulation steps to train with; a copy, so a refused prepare leaves everything as it was."""
        config = HfDeepSpeedConfig(self.plugin.deepspeed_config)
        world = self.state.num_processes
        micro = config.get_value("train_micro_batch_size_per_gpu")
        sizes = [loader.batch_size // (world if self.split_batches else 1) for loader in loaders
                 if loader.batch_size is not None]
        if micro in ("auto", None):
            if not sizes:
                raise ValueError("DeepSpeed needs the batch size per process: prepare the training DataLoader in the "
                                 "same prepare() call as the model, or set train_micro_batch_size_per_gpu in the "
                                 "DeepSpeed config")
            micro = min(sizes) if self.plugin.is_train_batch_min else max(sizes)
        elif sizes and micro not in sizes:
            raise ValueError(f"the DeepSpeed config's train_micro_batch_size_per_gpu is {micro}, the DataLoader gives "
                             f"{sizes[0]} per process: make them equal, or set the config's value to \"auto\"")
        steps = config.get_value("gradient_accumulation_steps")
        if steps not in ("auto", None) and steps != gradient_state.num_steps:
            if gradient_state.num_steps != 1:
                raise ValueError(f"the DeepSpeed config's gradient_accumulation_steps is {steps}, the Accelerator's "
                                 f"{gradient_state.num_steps}: give one of them, or set the config's to \"auto\"")
        else:
            steps = gradient_state.num_steps
        if config.get_value("gradient_accumulation_steps") is None:  # left out: the same as "auto"
            config.set("gradient_accumulation_steps", steps)
        total = config.get_value("train_batch_size")
        if total not in ("auto", None) and total != micro * steps * world:
            raise ValueError(f"the DeepSpeed config's train_batch_size is {total}, but {micro} per process x {steps} "
                             f"accumulation steps x {world} processes is {micro * steps * world}: set it to \"auto\"")
        for key, value in (("train_micro_batch_size_per_gpu", micro), ("train_batch_size", micro * steps * world)):
            if config.get_value(key) is None:  # left out: the same as "auto"
                config.set(key, value)
        config.fill_auto(**{"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps,
                            "train_batch_size": micro * steps * world, "gradient_clipping": 1.0,
                            "zero_optimization.stage3_gather_16bit_weights_on_model_save": False})
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        buckets = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
                   "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                   "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}
        for key, size in buckets.items():
            if config.is_auto(key):
                if hidden is None:
                    config.del_config_sub_tree(key)  # DeepSpeed's default, for a model without config.hidden_size
                else:
                    config.set(key, size(hidden))
        self._check_optimizer(config, optimizer, scheduler)
        left = config.autos()
        if left:
            raise ValueError(f"the DeepSpeed config leaves {left} as \"auto\" and nothing here fills them: give values")
        return config.config, steps

    def _check_optimizer(self, config: Any, optimizer: Any, scheduler: Any) -> None:
        in_config = "optimizer" in config.config
        if in_config and optimizer is not None and not isinstance(optimizer, DummyOptim):
            raise ValueError("the DeepSpeed config has an optimizer section and prepare() got a torch optimizer: drop "
                             "one (use accelerate.utils.DummyOptim with the config's optimizer)")
        if isinstance(optimizer, DummyOptim):
            if not in_config:
                raise ValueError("DummyOptim stands for the DeepSpeed config's optimizer section, which is missing")
            config.fill_auto(**{"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
        elif optimizer is not None:
            config.config.setdefault("zero_allow_untested_optimizer", True)
        if scheduler is not None and scheduler.lr_scheduler_callable is None:
            if "scheduler" not in config.config:
                raise ValueError("DummyScheduler stands for the DeepSpeed config's scheduler section (missing) or "
                                 "needs lr_scheduler_callable")
            lr = optimizer.lr if isinstance(optimizer, DummyOptim) else (optimizer.defaults.get("lr")
                                                                          if optimizer is not None else None)
            total = scheduler.total_num_steps
            if total is not None and not self.split_batches:  # Accelerate's: steps of one process
                total = math.ceil(total / self.state.num_processes)
            config.fill_auto(**{"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": lr,
                                "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
                                "scheduler.params.total_num_steps": total})

    def _cpu_optimizer(self, optimizer: torch.optim.Optimizer, config: dict) -> Any:
        """Offloading the optimizer to the CPU runs DeepSpeed's CPU Adam, as Accelerate swaps it in
        (unless the config's ``zero_force_ds_cpu_optimizer`` is false)."""
        offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        if offload in ("none", None) or not config.get("zero_force_ds_cpu_optimizer", True):
            return optimizer
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"offload_optimizer_device={offload!r} runs DeepSpeed's CPU Adam, and the optimizer is "
                             f"{type(optimizer).__name__}: use Adam/AdamW, or set zero_force_ds_cpu_optimizer false")
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # deferred: the optional extra; compiles on first use
        defaults = optimizer.defaults
        return DeepSpeedCPUAdam(optimizer.param_groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                                weight_decay=defaults["weight_decay"],
                                adamw_mode=isinstance(optimizer, torch.optim.AdamW))

    # -- the step ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, scaler: Any, **kwargs: Any) -> None:
        if self.wrapper is None:  # nothing prepared yet: a plain backward
            loss.backward(**kwargs)
            return
        self.wrapper.backward(loss, sync_gradients=self.gradient_state.sync_gradients, **kwargs)

    def clip_grad_norm_(self, parameters: list, max_norm: float, norm_type: float) -> torch.Tensor:
        """DeepSpeed clipped inside its step (to its config's ``gradient_clipping``): the norm it
        found; a different ``max_norm`` is said once, not applied."""
        clipping = self.plugin.deepspeed_config.get("gradient_clipping")  # filled by prepare: 1.0 for "auto"
        if not self._warned_clipping and clipping not in (None, "auto") and float(clipping) != float(max_norm):
            self._warned_clipping = True
            warnings.warn(f"DeepSpeed clips inside its step to gradient_clipping={clipping} (its config); "
                          f"clip_grad_norm_(max_norm={max_norm}) does not clip again: give "
                          f"DeepSpeedPlugin(gradient_clipping={max_norm})", stacklevel=4)
        norm = self.wrapper.get_global_grad_norm() if self.wrapper is not None else None
        return torch.tensor(float("nan") if norm is None else float(norm))

    def clip_grad_value_(self, parameters: list, clip_value: float) -> None:
        raise NotImplementedError("DeepSpeed clips by norm only (its config's gradient_clipping): use "
                                  "clip_grad_norm_, or DeepSpeedPlugin(gradient_clipping=...)")

    # -- weights and checkpoints ---------------------------------------------------------------

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        if not is_deepspeed_engine(model) or model.zero_optimization_stage() != 3:
            return super().full_state_dict(model)
        if model.zero_gather_16bit_weights_on_model_save():  # zero3_save_16bit_model: DeepSpeed's own gather
            whole = model._zero3_consolidated_16bit_state_dict()
            return dict(whole) if whole is not None else {}
        import deepspeed  # deferred: the optional extra
        module = model.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if not self.state.is_main_process:
                return {}
            return {name: tensor.detach().clone().cpu() for name, tensor in module.state_dict().items()}

    def save_states(self, models: list, optimizers: list, output_dir: str, state: PartialState) -> SavedByStrategy:
        written = super().save_states(models, optimizers, output_dir, state)
        for i, model in enumerate(models):
            if is_deepspeed_engine(model):
                model.save_checkpoint(output_dir, deepspeed_tag(i))
                written.models.add(i)
        written.optimizers.update(i for i, opt in enumerate(optimizers) if isinstance(opt, DeepSpeedOptimizerWrapper))
        return written

    def load_states(self, models: list, optimizers: list, input_dir: str, strict: bool,
                    state: PartialState) -> SavedByStrategy:
        written = super().load_states(models, optimizers, input_dir, strict, state)
        for i, model in enumerate(models):
            if is_deepspeed_engine(model):
                if not os.path.isdir(os.path.join(input_dir, deepspeed_tag(i))):
                    raise FileNotFoundError(f"{input_dir!r} has no {deepspeed_tag(i)}/ (DeepSpeed's checkpoint of model "
                                            f"{i}): it was saved without DeepSpeed; load it the same way it was saved")
                path, _ = model.load_checkpoint(input_dir, deepspeed_tag(i), load_module_strict=strict)
                if path is None:
                    raise FileNotFoundError(f"DeepSpeed could not load {os.path.join(input_dir, deepspeed_tag(i))}")
                written.models.add(i)
        written.optimizers.update(i for i, opt in enumerate(optimizers) if isinstance(opt, DeepSpeedOptimizerWrapper))
        return written


def _one_process_variables() -> None:
    """DeepSpeed reads the rank from the environment (else it looks for MPI): a process outside
    a launch, with its own one-process group, says it is rank 0 of 1."""
    if RANK in os.environ:
        return
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return
    for name, value in ((RANK, "0"), (LOCAL_RANK, "0"), (WORLD_SIZE, "1")):
        os.environ.setdefault(name, value)


def _zero3_init_for_transformers(plugin: DeepSpeedPlugin) -> Any:
    """``zero3_init_flag``: transformers' ``from_pretrained`` then creates models already
    partitioned (ZeRO-3), reading DeepSpeed's config through a weak reference it keeps; the object
    is returned for the strategy to hold."""
    if not plugin.zero3_init_flag:
        return None
    try:
        from transformers.integrations import HfDeepSpeedConfig as TransformersConfig  # deferred: optional
    except ImportError:
        raise ImportError("DeepSpeedPlugin(zero3_init_flag=True) partitions models transformers creates, and "
                          "transformers is not installed: pip install transformers, or zero3_init_flag=False") from None
    config = copy.deepcopy(plugin.deepspeed_config)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if config.get(key, "auto") == "auto":
            config[key] = 1
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    return TransformersConfig(config)
