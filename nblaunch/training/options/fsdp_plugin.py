"""Accelerate's ``FullyShardedDataParallelPlugin``, read into what nblaunch does with it: FSDP2
(``torch.distributed.fsdp.fully_shard``).

The plugin has Accelerate's field names, and Accelerate's own plugin object is accepted in its
place (read by its fields, like the other configuration objects). :func:`sharding_settings`
turns either into :class:`ShardingSettings` and refuses, when the ``Accelerator`` is made and so
before any training step, every setting nblaunch would otherwise silently not honour.

Example::

    from nblaunch.utils import FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["FullyShardedDataParallelPlugin", "ShardingSettings", "WrapRule", "sharding_settings"]

# Accelerate's default under FSDP2: every module with parameters is a unit of its own.
DEFAULT_MIN_NUM_PARAMS = 0


@dataclass
class FullyShardedDataParallelPlugin:
    """How ``prepare`` shards a model (Accelerate's fields; see ``docs/accelerator.md``).

    Honoured: ``reshard_after_forward`` (or ``sharding_strategy`` FULL_SHARD / SHARD_GRAD_OP),
    ``mixed_precision_policy``, ``auto_wrap_policy`` (``"transformer_based_wrap"`` with
    ``transformer_cls_names_to_wrap``, ``"size_based_wrap"`` with ``min_num_params``,
    ``"no_wrap"``, or a torch wrap-policy callable), ``cpu_offload``, ``ignored_modules``,
    ``sync_module_states``, ``activation_checkpointing``. Accepted with nothing to do under FSDP2
    (it prefetches and keeps the original parameters itself): ``fsdp_version``,
    ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``, ``use_orig_params``,
    ``state_dict_type`` (full or sharded), ``state_dict_config``, ``optim_state_dict_config``.
    ``cpu_ram_efficient_loading`` means ``sync_module_states``: every rank loads the weights and
    rank 0's are copied to the others (the same weights as Accelerate's, without its memory saving).
    Refused with an error: the rest (``param_init_fn``, ``activation_checkpointing_offload``,
    hybrid and no sharding, local state dicts).
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None


@dataclass(frozen=True)
class WrapRule:
    """Which submodules get a sharding unit of their own (the root always gets one).

    ``kind``: ``"none"``, ``"classes"`` (``class_names``, or the model's ``_no_split_modules``
    when empty), ``"size"`` (more than ``min_num_params`` parameters) or ``"callable"`` (torch's
    FSDP1 policy signature: ``policy(module=, recurse=False, nonwrapped_numel=)``).
    """

    kind: str = "none"
    class_names: tuple[str, ...] = ()
    classes: tuple[type, ...] = ()
    min_num_params: int = DEFAULT_MIN_NUM_PARAMS
    policy: Callable | None = None


@dataclass(frozen=True)
class ShardingSettings:
    """What :func:`nblaunch.training.model.fsdp.shard_model` does, every choice already checked."""

    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    cpu_offload: bool = False
    wrap: WrapRule = field(default_factory=WrapRule)
    ignored_modules: Any = None
    sync_module_states: bool = False
    activation_checkpointing: bool = False


def _accelerates_own(function: Callable) -> bool:
    return getattr(function, "__module__", "").startswith("accelerate.")


_DTYPES = {"fp32": torch.float32, "no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sharding_settings(plugin: Any, mixed_precision: str) -> ShardingSettings:
    """Check ``plugin`` (ours or Accelerate's) and return what it asks for.

    ``mixed_precision`` is the Accelerator's: without a policy of the plugin's own, ``"bf16"`` or
    ``"fp16"`` compute, reduce gradients and give outputs in that dtype on full-precision
    parameters, as Accelerate's plugin does.

    Example::

        sharding_settings(FullyShardedDataParallelPlugin(reshard_after_forward=False), "bf16")
        # ShardingSettings(reshard_after_forward=False, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, ...)
    """
    read = functools.partial(getattr, plugin)
    version = read("fsdp_version", None)
    if version not in (None, 1, 2, "1", "2"):
        raise ValueError(f"FullyShardedDataParallelPlugin(fsdp_version={version!r}): nblaunch shards with FSDP2; "
                         "give 2 (or 1: the same settings, run on FSDP2)")
    init = read("param_init_fn", None)
    if init is not None and not (read("sync_module_states", None) and _accelerates_own(init)):
        # (Accelerate's plugin sets its own to_empty initialiser with sync_module_states on a
        # GPU machine: sync_module_states is what it is for, and nblaunch broadcasts itself.)
        raise NotImplementedError("FullyShardedDataParallelPlugin(param_init_fn=...) is not supported by nblaunch: "
                                  "build the model on the CPU on every rank (sync_module_states=True copies "
                                  "rank 0's weights)")
    if read("activation_checkpointing_offload", None):
        raise NotImplementedError("FullyShardedDataParallelPlugin(activation_checkpointing_offload=...) is not "
                                  "supported by nblaunch: use activation_checkpointing=True alone")
    # Accelerate's default answer in `accelerate config`: only rank 0 loads the weights. Here every
    # rank loads them and rank 0's are copied to the others: the same weights, not the memory saving.
    sync_module_states = bool(read("sync_module_states", None) or read("cpu_ram_efficient_loading", None))
    state_dict_type = _name_of(read("state_dict_type", None))
    if state_dict_type not in (None, "FULL_STATE_DICT", "SHARDED_STATE_DICT", "1", "3"):
        raise NotImplementedError(f"FullyShardedDataParallelPlugin(state_dict_type={state_dict_type!r}) is not "
                                  "supported: save_state writes sharded checkpoints, get_state_dict full ones")
    policy = _precision(read("mixed_precision_policy", None), mixed_precision)
    wrap = _wrap_rule(read("auto_wrap_policy", None), read("transformer_cls_names_to_wrap", None),
                      read("min_num_params", None))
    checkpointing = bool(read("activation_checkpointing", None))
    if checkpointing and wrap.kind == "none":
        raise ValueError("FullyShardedDataParallelPlugin(activation_checkpointing=True) checkpoints each wrapped "
                         "layer: give auto_wrap_policy too (e.g. 'transformer_based_wrap')")
    return ShardingSettings(
        reshard_after_forward=_reshard(read("reshard_after_forward", None), read("sharding_strategy", None)),
        **policy, cpu_offload=_offload(read("cpu_offload", None)), wrap=wrap,
        ignored_modules=read("ignored_modules", None) or None,
        sync_module_states=sync_module_states, activation_checkpointing=checkpointing)


def _name_of(value: Any) -> str | None:
    """An enum member's name, or a string upper-cased: FSDP1's enums and Accelerate's strings."""
    if value is None:
        return None
    name = getattr(value, "name", value)
    return str(name).upper()


_STRATEGIES = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}


def _reshard(reshard_after_forward: Any, sharding_strategy: Any) -> bool:
    # Accelerate takes either; reshard_after_forward (a bool on FSDP2, a strategy on FSDP1) wins.
    for value in (reshard_after_forward, sharding_strategy):
        if isinstance(value, bool):
            return value
        name = _name_of(value)
        if name is None:
            continue
        if name in ("TRUE", "FALSE"):
            return name == "TRUE"
        if name in _STRATEGIES:
            return _STRATEGIES[name]
        if name in ("NO_SHARD", "3"):
            raise NotImplementedError("sharding_strategy NO_SHARD is DDP: leave out fsdp_plugin and prepare "
                                      "wraps the model in DistributedDataParallel")
        raise NotImplementedError(f"sharding_strategy {name} is not supported by nblaunch (hybrid sharding "
                                  "needs a 2-D mesh): use FULL_SHARD or SHARD_GRAD_OP")
    return True


def _precision(policy: Any, mixed_precision: str) -> dict[str, Any]:
    if policy is None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
        # Accelerate's own policy (FullyShardedDataParallelPlugin.set_mixed_precision): gradients
        # reduced and outputs given in the compute dtype, so a loop trains to the same numbers.
        return {"param_dtype": dtype, "reduce_dtype": dtype, "output_dtype": dtype}
    if isinstance(policy, str):
        if policy.lower() not in _DTYPES:
            raise ValueError(f"mixed_precision_policy={policy!r}: give 'bf16', 'fp16', 'fp32', a dict or a "
                             "torch.distributed.fsdp.MixedPrecisionPolicy")
        dtype = _DTYPES[policy.lower()]
        return {"param_dtype": dtype, "reduce_dtype": dtype, "output_dtype": dtype}
    values = dict(policy) if isinstance(policy, dict) else {
        name: getattr(policy, name) for name in ("param_dtype", "reduce_dtype", "output_dtype",
                                                 "cast_forward_inputs", "buffer_dtype") if hasattr(policy, name)}
    if type(policy).__name__ == "MixedPrecision" or "buffer_dtype" in values:
        # FSDP1's: its input casting (off by default there) is done by its root, and FSDP2's own
        # default casts them; buffers keep their dtype under FSDP2.
        for fsdp1_only in ("buffer_dtype", "cast_forward_inputs", "cast_root_forward_inputs",
                           "keep_low_precision_grads", "_module_classes_to_ignore"):
            values.pop(fsdp1_only, None)
    unknown = set(values) - {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
    if unknown:
        raise ValueError(f"mixed_precision_policy has unknown keys {sorted(unknown)}")
    for key in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = values.get(key)
        if isinstance(value, str):
            values[key] = _DTYPES.get(value.lower()) or _refuse_dtype(key, value)
    return values


def _refuse_dtype(key: str, value: str) -> None:
    raise ValueError(f"mixed_precision_policy {key}={value!r}: give torch.bfloat16, torch.float16 or torch.float32")


def _offload(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    kind = type(value).__name__
    if kind == "CPUOffloadPolicy":
        return True
    if kind == "OffloadPolicy":  # FSDP2's "no offload"
        return False
    if kind == "CPUOffload":  # FSDP1's
        return bool(value.offload_params)
    raise ValueError(f"cpu_offload={value!r}: give True/False or torch.distributed.fsdp.CPUOffloadPolicy()")


def _wrap_rule(policy: Any, class_names: Any, min_num_params: Any) -> WrapRule:
    if isinstance(class_names, str):
        class_names = [name.strip() for name in class_names.split(",") if name.strip()]
    names = tuple(class_names or ())
    size = int(min_num_params) if min_num_params is not None else DEFAULT_MIN_NUM_PARAMS
    if policy is None or (isinstance(policy, str) and policy.lower() in ("no_wrap", "none")):
        return WrapRule()
    if isinstance(policy, str):
        kind = policy.lower()
        if kind == "transformer_based_wrap":
            return WrapRule("classes", class_names=names)
        if kind == "size_based_wrap":
            return WrapRule("size", min_num_params=size)
        raise ValueError(f"auto_wrap_policy={policy!r}: give 'transformer_based_wrap', 'size_based_wrap', "
                         "'no_wrap' or a torch wrap policy")
    # torch's own policies, as Accelerate's plugin holds them after its own set-up
    function = policy.func if isinstance(policy, functools.partial) else policy
    keywords = policy.keywords if isinstance(policy, functools.partial) else {}
    name = getattr(function, "__name__", type(function).__name__)
    if name == "transformer_auto_wrap_policy":
        classes = tuple(keywords.get("transformer_layer_cls") or ())
        return WrapRule("classes", class_names=names, classes=classes)
    if name == "size_based_auto_wrap_policy":
        return WrapRule("size", min_num_params=int(keywords.get("min_num_params", size)))
    if name in ("ModuleWrapPolicy", "TransformerAutoWrapPolicy"):
        return WrapRule("classes", classes=tuple(getattr(function, "_module_classes", ())))
    if callable(policy):
        return WrapRule("callable", policy=policy)
    raise ValueError(f"auto_wrap_policy={policy!r} is not a policy nblaunch knows")
