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

import os
from typing import Any, Iterable

from nblaunch.training.accelerator.communication import CollectiveMethods
from nblaunch.training.accelerator.persistence import PersistenceMethods
from nblaunch.training.accelerator.prepare import PrepareMethods
from nblaunch.training.accelerator.trackers import TrackingMethods
from nblaunch.training.accelerator.training_step import TrainingStepMethods
from nblaunch.training.model.placement import ReplacedParameters
from nblaunch.training.options.deepspeed_plugin import DeepSpeedPlugin, deepspeed_plugin_from_environment
from nblaunch.training.options.dynamo_plugin import DYNAMO_VARIABLES, TorchDynamoPlugin, adopt_dynamo_plugin
from nblaunch.training.options.fsdp_environment import fsdp_plugin_from_environment
from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin
from nblaunch.training.options.parallelism import ParallelismConfig, parallelism_config_from_environment
from nblaunch.training.options.kwargs import (AORecipeKwargs, AutocastKwargs, DataLoaderConfiguration, DistributedDataParallelKwargs,
                                              GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                                              ProfileKwargs, adopt, refuse_unsupported)
from nblaunch.training.options.project import ProjectConfiguration, project_configuration
from nblaunch.training.precision.modes import pick_precision, resolve_mixed_precision
from nblaunch.training.precision.compiling import CompileStep
from nblaunch.training.runtime.state import AcceleratorState
from nblaunch.training.step.gradient_state import GradientState
from nblaunch.training.strategy.picking import pick_strategy
from nblaunch.worker import channel, step_clock, step_stop
from nblaunch.training.tracking.choose import choose_trackers

__all__ = ["Accelerator"]


# Accelerate arguments that are accepted and have no effect here.
_IGNORED = ("downcast_bf16",)


class Accelerator(PrepareMethods, TrainingStepMethods, CollectiveMethods, PersistenceMethods, TrackingMethods):
    """Per-process training helper: device placement, DDP, mixed precision, accumulation,
    sharded data, collectives and checkpoints.

    Args:
        device_placement: move prepared models and batches to ``accelerator.device``.
        split_batches: the DataLoader batch size is the global one (split between processes).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"``, or ``"auto"``: the one the device
            computes fast (bf16 on GPUs of compute capability 8.0 on and TPUs, fp16 on older
            GPUs, none on CPUs); None reads ``NBLAUNCH_MIXED_PRECISION`` (the launcher's
            ``mixed_precision=``), default ``"no"``.
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
        project_dir: the run's directory: ``save_state()`` writes under it, TensorBoard too.
        project_config: a :class:`~nblaunch.utils.ProjectConfiguration` (or Accelerate's):
            automatic checkpoint naming, ``total_limit``, ``logging_dir``.
        log_with: experiment trackers: ``"tensorboard"``, ``"wandb"``, ``"mlflow"``,
            ``"trackio"``, ``"all"`` (those installed), a :class:`~nblaunch.utils.LoggerType`,
            tracker objects, or a list of them; opened by :meth:`init_trackers`. ``log()``
            draws metrics in the launching cell with or without them.
        rng_types: RNGs given rank 0's state at the start of every epoch of a prepared loader
            (Accelerate's; default ``["generator"]``, the shuffle's own generator).
        fsdp_plugin: a :class:`~nblaunch.utils.FullyShardedDataParallelPlugin` (or Accelerate's):
            ``prepare`` shards models with FSDP2 instead of wrapping them in DDP. None reads
            ``ACCELERATE_USE_FSDP`` and ``FSDP_*``, as Accelerate does (``nblaunch launch --use_fsdp``,
            a config file's ``fsdp_config``, ``accelerate launch --use_fsdp``).
        parallelism_config: a :class:`~nblaunch.utils.ParallelismConfig` (or Accelerate's):
            ``tp_size`` splits the planned layers over that many ranks (``tp_plan``, or a
            ``transformers`` model's own plan), applied by ``prepare``; ``dp_replicate_size``
            (DDP) or ``dp_shard_size`` (with an ``fsdp_plugin``) for the rest.
        deepspeed_plugin: a :class:`~nblaunch.utils.DeepSpeedPlugin` (or Accelerate's): ``prepare``
            hands the model, optimizer and scheduler to DeepSpeed's engine (ZeRO stages 1-3,
            offload), on GPUs and CPU ranks alike; needs ``pip install "nblaunch[deepspeed]"``.
            None reads ``ACCELERATE_USE_DEEPSPEED`` and ``ACCELERATE_DEEPSPEED_*``.
        dynamo_backend: compile prepared models with ``torch.compile`` and this backend
            (``"inductor"``; ``"no"``: never, not even fp8's default), as the last step of ``prepare``.
        dynamo_plugin: a :class:`~nblaunch.utils.TorchDynamoPlugin` (or Accelerate's): backend,
            mode, fullgraph, dynamic, regional compilation. Neither given: ``ACCELERATE_DYNAMO_*``
            (``nblaunch launch --dynamo_backend``), else no compile except fp8 on GPUs with fp8
            units, which compiles with Inductor (eager fp8 is slower than bf16).

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
        project_config: ProjectConfiguration | Any = None,
        log_with: Any = None,
        rng_types: list[str] | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | Any = None,
        deepspeed_plugin: DeepSpeedPlugin | Any = None,
        parallelism_config: ParallelismConfig | Any = None,
        dynamo_backend: str | Any = None,
        dynamo_plugin: TorchDynamoPlugin | Any = None,
        **kwargs: Any,
    ) -> None:
        deepspeed_plugin = _one_deepspeed_plugin(deepspeed_plugin, kwargs.pop("deepspeed_plugins", None))
        parallelism_config = _one_parallelism_config(parallelism_config, kwargs.pop("torch_tp_plugin", None))
        if kwargs.get("megatron_lm_plugin") is not None:
            raise NotImplementedError("Accelerator(megatron_lm_plugin=...): Megatron-LM is not supported by nblaunch; "
                                      "for tensor parallelism give parallelism_config=ParallelismConfig(tp_size=...)")
        for name, value in kwargs.items():
            if name == "megatron_lm_plugin":
                continue
            if name in ("dispatch_batches", "logging_dir"):  # Accelerate before 1.0 took them here
                continue
            elif name not in _IGNORED:
                raise TypeError(f"Accelerator() got an unexpected keyword argument {name!r}")
        handlers = [adopt(h) for h in kwargs_handlers or ()]  # Accelerate's own objects too
        group = next((h for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
        self.state = AcceleratorState(cpu=cpu, **_group_arguments(group))
        self.device = self.state.device
        self.device_placement = device_placement
        self.mixed_precision = resolve_mixed_precision(mixed_precision, self.device)
        if fsdp_plugin is None and deepspeed_plugin is None:  # None unless the launch asked for one
            fsdp_plugin = fsdp_plugin_from_environment()
            deepspeed_plugin = deepspeed_plugin_from_environment()
        if parallelism_config is None:
            parallelism_config = parallelism_config_from_environment()
        self.fsdp_plugin = self.state.fsdp_plugin = fsdp_plugin

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
        self.autocast_kwargs = {}
        self.profile_handler = None
        fp8_recipe = None
        for handler in handlers:
            if isinstance(handler, DistributedDataParallelKwargs):
                self.ddp_options = handler
            elif isinstance(handler, GradScalerKwargs):
                scaler_kwargs = handler.to_kwargs()
            elif isinstance(handler, AutocastKwargs):
                self.autocast_kwargs = handler.to_kwargs()
            elif isinstance(handler, ProfileKwargs):
                self.profile_handler = handler
            elif isinstance(handler, AORecipeKwargs):
                fp8_recipe = handler
            elif not isinstance(handler, InitProcessGroupKwargs):
                raise TypeError(f"unsupported kwargs handler {type(handler).__name__}")

        # How models are spread over the ranks, chosen once; each stack refuses bad settings here.
        self._strategy = pick_strategy(self.state, self.mixed_precision, self.ddp_options, fsdp_plugin,
                                       deepspeed_plugin, config.split_batches, parallelism_config)
        self.parallelism_config = parallelism_config
        self.deepspeed_plugin = self.state.deepspeed_plugin = getattr(self._strategy, "plugin", None)
        # How the model computes, beside how it is spread: its autocast, scaler and conversion.
        self._precision = pick_precision(self.mixed_precision, self.device, self._strategy.own_precision(),
                                         fp8_recipe, self.autocast_kwargs, scaler_kwargs)
        self.mixed_precision = self._precision.mode
        self.fp8_recipe = self._precision.recipe
        self.scaler = self._precision.scaler
        self._compile_step = CompileStep(_one_dynamo_plugin(dynamo_backend, dynamo_plugin), self._precision,
                                         self.state.is_main_process)
        self.state.dynamo_plugin = self._compile_step.plugin  # Accelerate's accelerator.state.dynamo_plugin
        refusal = self._strategy.refuses_compile() if self._compile_step.enabled else None
        if refusal:
            raise NotImplementedError(refusal)

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

        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.step_scheduler_per_process = step_scheduler_per_process
        # logging_dir: Accelerate before 1.0 took it here
        self.project_configuration = project_configuration(project_config, project_dir, kwargs.get("logging_dir"))
        self.log_with = choose_trackers(log_with, self.logging_dir)  # a missing package fails here, not later
        self.project_name = None
        self.config = None

        self._models = []
        self._optimizers = []
        self._schedulers = []
        self._dataloaders = []
        self._custom_objects = []
        self._replaced_parameters = ReplacedParameters()
        self._trigger = False
        self.trackers = []
        self._accumulate_context = None
        self._resumed = False
        # An interrupted launch saves through this Accelerator, and resume= loads through it, at the
        # first step (nblaunch.worker.step_stop): the latest made in a process is the one its loop uses.
        step_stop.keep_work_with(self._save_at_stop)
        step_stop.before_first_step(self.resume)
        channel.report_device(str(self.device), self.mixed_precision)  # the rank's row in the cell says it
        if self.device.type != "xla":  # an XLA host runs its ranks as threads of one process: one clock would mix them
            step_clock.start(cuda=self.device.type == "cuda")  # the rank's steps, split (nblaunch.worker.step_clock)

    def __repr__(self) -> str:
        return (f"Accelerator(process {self.process_index}/{self.num_processes}, device={self.device}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")


def _one_deepspeed_plugin(plugin: Any, plugins: Any) -> Any:
    """``deepspeed_plugin``, or ``deepspeed_plugins`` (Accelerate's alias, a dict of named ones)
    holding one; several plugins to switch between are refused."""
    if plugins is None:
        return plugin
    if plugin is not None:
        raise ValueError("give deepspeed_plugin or deepspeed_plugins, not both")
    if isinstance(plugins, dict):
        if len(plugins) != 1:
            raise NotImplementedError(f"deepspeed_plugins with {len(plugins)} plugins (switching between them) is not "
                                      "supported by nblaunch: give one deepspeed_plugin")
        return next(iter(plugins.values()))
    return plugins


def _one_dynamo_plugin(backend: Any, plugin: Any) -> TorchDynamoPlugin | None:
    """The compile plugin asked for: ``dynamo_backend`` or ``dynamo_plugin`` (not both), else the
    ``ACCELERATE_DYNAMO_*`` variables; None when nothing asked (the precision then decides)."""
    if backend is not None and plugin is not None:
        raise ValueError("give dynamo_backend or dynamo_plugin, not both")
    if plugin is not None:
        return adopt_dynamo_plugin(plugin)
    if backend is not None:
        return TorchDynamoPlugin(backend=backend)
    if any(name in os.environ for name in DYNAMO_VARIABLES):
        return TorchDynamoPlugin()
    return None


def _one_parallelism_config(config: Any, tp_plugin: Any) -> Any:
    """``parallelism_config``, or the deprecated ``torch_tp_plugin`` as Accelerate turns it into one."""
    if tp_plugin is None:
        return config
    if config is not None:
        raise ValueError("give parallelism_config or torch_tp_plugin, not both")
    return ParallelismConfig(tp_size=getattr(tp_plugin, "tp_size", 1))


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
