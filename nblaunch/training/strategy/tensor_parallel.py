"""``TensorParallel``: each planned layer's weight split over the ``tp`` ranks of a
``ParallelismConfig``'s ``DeviceMesh`` (torch's ``parallelize_module``: ``ColwiseParallel``,
``RowwiseParallel``), on NCCL and gloo. The plan is the config's ``tp_plan`` or, for a
``transformers`` model, its own (``config.base_model_tp_plan`` and the head's ``_tp_plan``); a
model already split (``from_pretrained(..., tp_plan="auto")``) is kept as it is, as Accelerate
does. The ranks of one ``tp`` group read the same batches; parameters outside the plan are whole
on every rank and get the same gradients there.

Example::

    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_plan={"mlp.up": "colwise",
                                                                                       "mlp.down": "rowwise"}))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

import torch

from nblaunch.training.model.fsdp import shard_model
from nblaunch.training.options.fsdp_plugin import ShardingSettings
from nblaunch.training.options.parallelism import ParallelismConfig
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.strategy import sharded_layout
from nblaunch.training.strategy.strategy_interface import Strategy
from nblaunch.training.strategy.saved_by_strategy import SavedByStrategy

__all__ = ["TensorParallel", "has_dtensor_parameters", "model_plan"]

_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_rep", "embedding_rowwise",
           "embedding_colwise", "replicate")


def has_dtensor_parameters(model: torch.nn.Module) -> bool:
    """Whether any parameter of the model is a ``DTensor`` (split by tensor parallelism or FSDP2)."""
    from torch.distributed.tensor import DTensor  # deferred: public from torch 2.5, and only TP and FSDP2 make them
    return any(isinstance(p, DTensor) for p in model.parameters())


def _style(name: str, style: Any) -> Any:
    """torch's ParallelStyle for a plan's word (``transformers``' words), or the style given."""
    from torch.distributed.tensor import Replicate  # deferred: TP only
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(style, ParallelStyle):
        return style
    styles = {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
              "rowwise_rep": lambda: RowwiseParallel(),
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
              "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if style not in styles:
        raise ValueError(f"tp_plan[{name!r}] = {style!r}: give one of {', '.join(_STYLES)}, or a torch ParallelStyle")
    return styles[style]()


def _models_own_plan(model: torch.nn.Module) -> dict[str, Any]:
    """A ``transformers`` model's plan, its base model's patterns under the base model's name."""
    plan: dict[str, Any] = {}
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix if prefix and hasattr(model, prefix) else ""
    for pattern, style in base.items():
        plan[f"{inner}.{pattern}" if inner else pattern] = style
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def model_plan(model: torch.nn.Module, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each module the plan names (its patterns expanded over the model), to torch's style."""
    patterns = dict(given) if given is not None else _models_own_plan(model)
    if not patterns:
        raise ValueError(f"tensor parallelism needs a plan, and {type(model).__name__} has none: give "
                         "ParallelismConfig(tp_plan={'<module name pattern>': 'colwise' | 'rowwise', ...})")
    expanded: dict[str, Any] = {}
    for name, _ in model.named_modules():
        for pattern, style in patterns.items():
            if name and fnmatch.fnmatchcase(name, pattern) and style != "replicate":
                expanded[name] = _style(pattern, style)
    if not expanded:
        raise ValueError(f"no module of {type(model).__name__} matches the tp_plan's patterns {sorted(patterns)}: "
                         "patterns are module names as model.named_modules() gives them, * for any part")
    return expanded


class TensorParallel(Strategy):
    """Tensor parallelism over the mesh's ``tp`` dimension (Accelerate's ``ParallelismConfig(tp_size=...)``)."""

    def __init__(self, config: ParallelismConfig, state: PartialState, sharding: ShardingSettings | None = None) -> None:
        config.check_world(state.num_processes)
        if config.dp_replicate_enabled:
            raise NotImplementedError(f"ParallelismConfig(tp_size={config.tp_size}, dp_replicate_size="
                                      f"{config.dp_replicate_size}): tensor parallelism with whole copies between "
                                      "groups is not supported by nblaunch; shard between them with dp_shard_size "
                                      "and an fsdp_plugin")
        if config.dp_shard_enabled != (sharding is not None):
            raise ValueError(f"ParallelismConfig(tp_size={config.tp_size}, dp_shard_size={config.dp_shard_size}) "
                             + ("shards between the tensor-parallel groups with FSDP2: give an fsdp_plugin too"
                                if config.dp_shard_enabled else
                                "with an fsdp_plugin: FSDP2 shards over dp_shard_size, which is 1; give it"))
        self.sharding = sharding
        if sharding is not None:
            self.distributed_type = DistributedType.FSDP  # as Accelerate says with an fsdp_plugin
        self.config = config
        self.state = state
        # Built now, as Accelerate does: from_pretrained(..., device_mesh=accelerator.torch_device_mesh)
        # needs it before prepare.
        state.ensure_process_group()
        self.device_mesh = config.build_device_mesh(state.device.type)

    def describe(self) -> str:
        sharded = f", FSDP2 over {self.config.dp_shard_size} groups" if self.sharding else ""
        return f"tensor parallel over {self.config.tp_size} ranks{sharded}"

    def autocasts(self, trainable: bool) -> bool:
        return self.sharding is None or not trainable  # FSDP2 computes in its policy's dtype

    def wrap_model(self, model: torch.nn.Module, device: torch.device, trainable: bool) -> torch.nn.Module:
        if not trainable or has_dtensor_parameters(model):
            # A frozen or evaluated model stays whole on every rank; one split already
            # (transformers' from_pretrained(tp_plan=...)) is kept, as Accelerate does.
            return model
        from torch.distributed.tensor.parallel import parallelize_module  # deferred: TP only
        model = parallelize_module(model, self.device_mesh["tp"], model_plan(model, self.config.tp_plan))
        if self.sharding is not None:  # then FSDP2 between the groups: 2-D parameters (dp_shard, tp)
            model = shard_model(model, self.sharding, device, mesh=self.device_mesh["dp_shard"])
        return model

    def check_optimizer(self, models: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        sharded_layout.owner_of(models, optimizer, has_dtensor_parameters)

    def data_ranks(self, num_processes: int, process_index: int) -> tuple[int, int]:
        tp = self.config.tp_size
        return num_processes // tp, process_index // tp

    def clip_grad_norm_(self, parameters: list, max_norm: float, norm_type: float) -> torch.Tensor:
        """The norm over every rank's pieces of the split weights and the whole others."""
        from torch.distributed.tensor import DTensor  # deferred: TP only
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norms = []
        for grad in grads:
            norm = torch.linalg.vector_norm(grad, norm_type)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        scale = float(max_norm) / (float(total) + 1e-6)
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)
        return total

    def clip_grad_value_(self, parameters: list, clip_value: float) -> None:
        for p in parameters:
            if p.grad is not None:
                p.grad.clamp_(-clip_value, clip_value)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        from torch.distributed.tensor import DTensor  # deferred: TP only
        from nblaunch.training.model.unwrap import unwrap_model
        if not has_dtensor_parameters(model):
            return super().full_state_dict(model)
        main = self.state.is_main_process
        whole = {}
        for name, value in unwrap_model(model).state_dict().items():  # in order on every rank: collectives
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if main:  # one weight gathered at a time: no rank holds the whole model on its device
                whole[name] = value.detach().cpu()
        return whole

    def save_states(self, models: list, optimizers: list, output_dir: str, state: PartialState) -> SavedByStrategy:
        return sharded_layout.save(models, optimizers, output_dir, spread=has_dtensor_parameters)

    def load_states(self, models: list, optimizers: list, input_dir: str, strict: bool,
                    state: PartialState) -> SavedByStrategy:
        return sharded_layout.load(models, optimizers, input_dir, strict, spread=has_dtensor_parameters)
