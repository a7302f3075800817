"""What the parts of the :class:`~nblaunch.training.accelerator.core.Accelerator` read from it,
declared in one place: :class:`AcceleratorHost`, the base of every part.

The Accelerator is its constructor (``core``) plus four groups of methods, each a base class of
it: ``prepare``, ``training_step``, ``collectives`` and ``persistence``. A group reads only what
the host declares here (the attributes ``Accelerator.__init__`` sets, the process-state
properties, ``unwrap_model`` and ``wait_for_everyone``) and its own methods, never another
group's.

Example::

    class Accelerator(PrepareMethods, TrainingStepMethods, CollectiveMethods, PersistenceMethods):
        def __init__(self, ...):
            self.state = AcceleratorState(...)   # every attribute AcceleratorHost declares
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nblaunch.training.model.unwrap import unwrap_model
from nblaunch.training.runtime.state import AcceleratorState, DistributedType

if TYPE_CHECKING:
    from nblaunch.training.data.prepared import PreparedDataLoader
    from nblaunch.training.model.placement import ReplacedParameters
    from nblaunch.training.options.project import ProjectConfiguration
    from nblaunch.training.options.kwargs import AORecipeKwargs, DataLoaderConfiguration, DistributedDataParallelKwargs, ProfileKwargs
    from nblaunch.training.step.accumulation import Accumulate
    from nblaunch.training.step.gradient_state import GradientState
    from nblaunch.training.step.optim import AcceleratedOptimizer, AcceleratedScheduler
    from nblaunch.training.precision.compiling import CompileStep
from nblaunch.training.precision.precision_interface import Precision
from nblaunch.training.strategy.strategy_interface import Strategy

__all__ = ["AcceleratorHost"]


class AcceleratorHost:
    """The Accelerator's state, as its method groups see it; ``Accelerator.__init__`` sets every
    attribute declared here."""

    # The process and the configuration.
    state: AcceleratorState
    device: torch.device
    device_placement: bool
    mixed_precision: str
    fsdp_plugin: Any
    parallelism_config: Any  # the ParallelismConfig given (or from the environment), else None
    fp8_recipe: AORecipeKwargs | None  # mixed_precision='fp8': which Linear layers torchao converts, how
    deepspeed_plugin: Any  # the DeepSpeedPlugin the strategy trains with, else None
    dataloader_config: DataLoaderConfiguration
    rng_types: list[str]
    ddp_options: DistributedDataParallelKwargs
    autocast_kwargs: dict[str, Any]
    profile_handler: ProfileKwargs | None
    sync_each_batch: bool
    gradient_state: GradientState
    scaler: torch.amp.GradScaler | None
    step_scheduler_with_optimizer: bool
    step_scheduler_per_process: bool
    project_configuration: ProjectConfiguration
    log_with: list[Any]  # tracker names and objects, checked; opened by init_trackers
    trackers: list[Any]  # the open trackers (main process only)
    project_name: str | None  # init_trackers'
    config: dict | None  # init_trackers'
    _strategy: Strategy  # how prepared models are spread over the ranks (DDP, FSDP2, ...)
    _precision: Precision  # how they compute: autocast, scaler, conversion (fp16, bf16, fp8, the stack's own)
    _compile_step: CompileStep  # whether prepare compiles them, last

    # What was prepared, in order (Accelerate's names: transformers' Trainer reads _models).
    _models: list[torch.nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[PreparedDataLoader]
    _custom_objects: list[Any]  # register_for_checkpointing's
    _replaced_parameters: ReplacedParameters
    _accumulate_context: Accumulate | None  # the last accumulate()'s, reused for the same models
    _trigger: bool  # set_trigger's flag
    _resumed: bool  # a checkpoint was loaded (by the user's load_state, or resume= before the first step)

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number of the next automatically named checkpoint."""
        return self.project_configuration.iteration

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
        return self._strategy.distributed_type or self.state.distributed_type

    @property
    def is_fsdp2(self) -> bool:
        """True when ``prepare`` shards models (an ``fsdp_plugin`` was given): always FSDP2 here."""
        return self._strategy.distributed_type is DistributedType.FSDP

    @property
    def torch_device_mesh(self) -> Any:
        """The ``DeviceMesh`` the ranks are laid on (a ``parallelism_config``'s), else None."""
        return self._strategy.device_mesh

    @property
    def tensor_parallel_rank(self) -> int:
        """This rank's place in its tensor-parallel group (0 where ``tp_size`` is 1)."""
        return self._mesh_rank("tp", "tp_enabled")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place along ``dp_replicate`` (0 where its size is 1)."""
        return self._mesh_rank("dp_replicate", "dp_replicate_enabled")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's place along ``dp_shard`` (0 where its size is 1)."""
        return self._mesh_rank("dp_shard", "dp_shard_enabled")

    def _mesh_rank(self, dimension: str, enabled: str) -> int:
        if self.parallelism_config is None:
            raise RuntimeError(f"the {dimension} rank needs a layout: give Accelerator(parallelism_config=...)")
        if not getattr(self.parallelism_config, enabled):
            return 0
        mesh = self._strategy.device_mesh
        if mesh is not None and dimension in (mesh.mesh_dim_names or ()):
            return mesh.get_local_rank(dimension)
        return self.process_index  # the layout's only dimension (DDP or FSDP2 alone): every rank along it

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

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
        """The user's model out of DDP (and torch.compile); without the autocast forward if asked.

        A sharded model is the user's model itself (FSDP2 shards in place), its parameters shards:
        ``get_state_dict(model)`` gives its whole weights.
        """
        return unwrap_model(model, keep_fp32_wrapper)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a barrier); no-op with one process."""
        self.state.wait_for_everyone()
