"""Sharding a prepared model with FSDP2 (``torch.distributed.fsdp.fully_shard``), and its state
dicts: full ones for ``get_state_dict``/``save_model``, sharded ones for checkpoints.

``fully_shard`` changes the model in place: its parameters become ``DTensor`` shards (new
``Parameter`` objects, so an optimizer made before must be pointed at them: ``prepare`` does
that), the forward gathers each unit's parameters and frees them after, and the backward
reduce-scatters the gradients, averaged like DDP's.

Example::

    settings = sharding_settings(FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap",
                                                               min_num_params=10_000), "no")
    model = shard_model(model, settings, torch.device("cpu"))
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from nblaunch.training.options.fsdp_plugin import ShardingSettings, WrapRule

__all__ = ["shard_model", "is_sharded", "full_state_dict", "sharded_state",
           "load_sharded_state", "total_norm"]


def is_sharded(model: Any) -> bool:
    """True for a model (or a submodule) that ``fully_shard`` made a sharding unit."""
    from torch.distributed.fsdp import FSDPModule  # deferred: FSDP2 is there from torch 2.6 (we allow 2.4)
    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, settings: ShardingSettings, device: torch.device,
                mesh: Any = None) -> torch.nn.Module:
    """Shard ``model`` (already on ``device``) over the world, or over ``mesh`` (the data-parallel
    dimension of a tensor-parallel layout, whose parameters are split already), as ``settings``
    say; returns it."""
    # deferred: FSDP2 is in torch.distributed.fsdp from torch 2.6 on (pyproject allows 2.4)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if is_sharded(model):
        return model
    if settings.param_dtype is not None:
        _upcast_trainable(model)
    if settings.sync_module_states:
        if mesh is not None:
            raise NotImplementedError("sync_module_states with tensor parallelism is not supported by nblaunch: "
                                      "build the model from the same seed on every rank instead")
        _copy_from_rank_0(model, device)
    offload = settings.cpu_offload and device.type != "cpu"
    if settings.cpu_offload and not offload:
        warnings.warn("cpu_offload: the parameters already live in CPU memory (training on the CPU); "
                      "nothing to offload", stacklevel=4)
    options: dict[str, Any] = {
        # The device's own mesh: FSDP2's default follows the machine's accelerator, which is not
        # this rank's device under Accelerator(cpu=True) on a GPU machine.
        "mesh": mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype,
                                          output_dtype=settings.output_dtype,
                                          cast_forward_inputs=settings.cast_forward_inputs),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    if settings.ignored_modules is not None:
        ignored = options["ignored_params"] = _ignored_parameters(model, settings.ignored_modules)
        for param in ignored:  # FSDP moves only what it shards
            param.data = param.data.to(device)
    units = _wrapped_submodules(model, settings.wrap)
    for unit in units:  # bottom-up: a unit's parameters are the ones no inner unit took
        if settings.activation_checkpointing:
            _checkpoint_activations(unit)
        fully_shard(unit, reshard_after_forward=settings.reshard_after_forward, **options)
    # The root: torch's own choice (None) keeps its parameters gathered from the forward to the
    # backward, where a re-gather could not overlap with anything.
    fully_shard(model, reshard_after_forward=None if units else settings.reshard_after_forward, **options)
    return model


def _upcast_trainable(model: torch.nn.Module) -> None:
    """FSDP2 computes in ``param_dtype`` from full-precision parameters, and a unit's trainable
    parameters must share one dtype: low-precision ones are made fp32, as Accelerate does."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


def _copy_from_rank_0(model: torch.nn.Module, device: torch.device) -> None:
    """``sync_module_states``: every rank starts from rank 0's parameters and buffers. One tensor
    at a time goes through ``device`` (NCCL sends only device memory); the model stays put."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            sent = tensor.data.to(device)
            dist.broadcast(sent, src=0)
            if sent is not tensor.data:
                tensor.data.copy_(sent)


def _ignored_parameters(model: torch.nn.Module, ignored: Any) -> set[torch.nn.Parameter]:
    """Parameters of ``ignored`` modules (modules, or a regular expression over module names as
    Accelerate takes it): they stay whole on every rank. FSDP2 does not reduce their gradients,
    so trainable ones would train apart on each rank: refused."""
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        modules = [(name, m) for name, m in model.named_modules() if pattern.fullmatch(name)]
    else:
        wanted = {id(m) for m in ignored}
        modules = [(name, m) for name, m in model.named_modules() if id(m) in wanted]
    trainable = [name for name, m in modules if any(p.requires_grad for p in m.parameters())]
    if trainable:
        raise ValueError(f"ignored_modules {trainable} have trainable parameters: FSDP does not average their "
                         "gradients, so each rank would train its own copy. Freeze them (requires_grad_(False)) "
                         "or let them be sharded")
    return {p for _, module in modules for p in module.parameters()}


def _wrapped_submodules(model: torch.nn.Module, rule: WrapRule) -> list[torch.nn.Module]:
    """The submodules ``rule`` gives a unit of their own, innermost first (never the root).

    A module sharing a parameter with modules outside it (tied weights: an embedding and the
    output layer) is left to an enclosing unit, which holds both: one parameter in two units is
    an error in FSDP2.
    """
    if rule.kind == "none":
        return []
    test = _unit_test(model, rule)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    order: list[torch.nn.Module] = []

    def self_contained(module: torch.nn.Module, prefix: str) -> bool:
        return all(name.startswith(prefix) for p in module.parameters() for name in names[id(p)])

    def visit(module: torch.nn.Module, prefix: str) -> None:
        if not isinstance(module, _LEAVES):
            for child_name, child in module.named_children():
                visit(child, f"{prefix}{child_name}.")
        if (module is not model and not isinstance(module, _CONTAINERS) and test(module)
                and self_contained(module, prefix)):
            order.append(module)

    visit(model, "")
    return order


# As torch's FSDP1 size policy: attention reads its out_proj's weight without calling out_proj,
# so no unit may start inside it; and containers have no forward to gather around.
_LEAVES = (torch.nn.MultiheadAttention,)
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _unit_test(model: torch.nn.Module, rule: WrapRule) -> Any:
    if rule.kind == "size":
        return lambda module: sum(p.numel() for p in module.parameters()) > rule.min_num_params
    if rule.kind == "callable":
        return lambda module: bool(rule.policy(module=module, recurse=False,
                                               nonwrapped_numel=sum(p.numel() for p in module.parameters())))
    names = rule.class_names or tuple(getattr(model, "_no_split_modules", None) or ())
    if not names and not rule.classes:
        raise ValueError("auto_wrap_policy='transformer_based_wrap' needs the layer classes: give "
                         "transformer_cls_names_to_wrap=['YourBlock'] (the model has no _no_split_modules)")
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [name for name in names if name not in present]
    if missing:
        raise ValueError(f"transformer_cls_names_to_wrap: no module of class {missing} in the model "
                         f"(its classes: {sorted(present)[:12]})")
    classes = tuple(present[name] for name in names) + tuple(rule.classes)
    return lambda module: isinstance(module, classes)


def _checkpoint_activations(unit: torch.nn.Module) -> None:
    """Keep only the unit's inputs in the forward and recompute the rest in the backward.

    The forward is replaced on the instance (not wrapped in another module), so parameter names,
    state dicts and checkpoints stay those of the plain model.
    """
    if isinstance(unit.__dict__.get("forward"), functools.partial):
        return
    unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, on the CPU, on rank 0 (an empty dict on the others).

    A collective: call it on every rank. It loads into the plain, unsharded model.
    """
    # deferred: torch.distributed.checkpoint takes ~50 ms to import, and only checkpoints need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's shards of the model's (or, with ``optimizer``, the optimizer's) state, keyed
    by parameter names: what ``torch.distributed.checkpoint`` saves and loads."""
    # deferred: torch.distributed.checkpoint is heavy (see full_state_dict)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    if optimizer is None:
        return get_model_state_dict(model)
    return get_optimizer_state_dict(model, optimizer)


def load_sharded_state(model: torch.nn.Module, state: dict[str, Any],
                       optimizer: torch.optim.Optimizer | None = None, strict: bool = True) -> None:
    """Put ``state`` (filled by ``torch.distributed.checkpoint.load``) back into the model or optimizer."""
    # deferred: torch.distributed.checkpoint is heavy (see full_state_dict)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    if optimizer is None:
        set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
    else:
        set_optimizer_state_dict(model, optimizer, state)


def total_norm(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s result over sharded gradients is a DTensor: the plain total."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
