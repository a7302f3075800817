"""Accelerate's FSDP settings as environment variables (``ACCELERATE_USE_FSDP`` and ``FSDP_*``),
read into a :class:`FullyShardedDataParallelPlugin`.

``accelerate launch --use_fsdp`` and ``nblaunch launch --use_fsdp`` (or a config file with
``distributed_type: FSDP`` and its ``fsdp_config``) hand their FSDP settings to every rank in
these variables; an ``Accelerator()`` made without ``fsdp_plugin`` builds its plugin from them,
as Accelerate's does. A variable that is not set leaves the plugin's field unset, so nblaunch's
own defaults apply (FSDP2, reshard after forward, one unit for the whole model).

Example::

    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      FSDP_TRANSFORMER_CLS_TO_WRAP="Block")
    fsdp_plugin_from_environment()
    # FullyShardedDataParallelPlugin(auto_wrap_policy='TRANSFORMER_BASED_WRAP', transformer_cls_names_to_wrap='Block', ...)
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from nblaunch.contract.variables import ACCELERATE_USE_FSDP, FSDP_VARIABLES
from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin

__all__ = ["fsdp_plugin_from_environment", "flag_value"]

_TRUE = ("1", "true", "yes", "y", "t", "on")
_FALSE = ("0", "false", "no", "n", "f", "off")


def flag_value(name: str, text: str) -> bool:
    """``text`` as a yes/no, with the spellings Accelerate accepts (``true``, ``1``, ``yes``, ...).

    Example: ``flag_value("FSDP_OFFLOAD_PARAMS", "False")`` is False.
    """
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: give true or false")


def _whole_number(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give a whole number") from None


def _text(name: str, text: str) -> str:
    return text


# Each of Accelerate's FSDP settings (its flag, and the key of a config file's fsdp_config), the
# plugin field it fills, and how the text of its variable (contract.variables.FSDP_VARIABLES) is read.
_SETTINGS: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "fsdp_version": ("fsdp_version", _whole_number),
    "fsdp_sharding_strategy": ("sharding_strategy", _text),
    "fsdp_reshard_after_forward": ("reshard_after_forward", _text),
    "fsdp_offload_params": ("cpu_offload", flag_value),
    "fsdp_min_num_params": ("min_num_params", _whole_number),
    "fsdp_auto_wrap_policy": ("auto_wrap_policy", _text),
    "fsdp_transformer_layer_cls_to_wrap": ("transformer_cls_names_to_wrap", _text),
    "fsdp_backward_prefetch": ("backward_prefetch", _text),
    "fsdp_state_dict_type": ("state_dict_type", _text),
    "fsdp_forward_prefetch": ("forward_prefetch", flag_value),
    "fsdp_use_orig_params": ("use_orig_params", flag_value),
    "fsdp_cpu_ram_efficient_loading": ("cpu_ram_efficient_loading", flag_value),
    "fsdp_sync_module_states": ("sync_module_states", flag_value),
    "fsdp_activation_checkpointing": ("activation_checkpointing", flag_value),
    "fsdp_activation_checkpointing_offload": ("activation_checkpointing_offload", flag_value),
    "fsdp_ignored_modules": ("ignored_modules", _text),  # a regular expression over module names
}

# What nblaunch refuses, said for each way the setting is given (flag, config file key).
_REFUSED = {
    "fsdp_activation_checkpointing_offload": "set it to false (--fsdp_activation_checkpointing_offload false) "
                                             "and keep fsdp_activation_checkpointing",
}


def fsdp_plugin_from_environment(environ: Mapping[str, str] | None = None) -> FullyShardedDataParallelPlugin | None:
    """The plugin the FSDP variables of ``environ`` (default ``os.environ``) ask for, or None when
    ``ACCELERATE_USE_FSDP`` is not true. Raises ``ValueError`` for a value it cannot read and
    ``NotImplementedError`` for a setting nblaunch does not do, naming the variable; the rest is
    checked with the plugin's own fields when the Accelerator reads it.

    Example::

        fsdp_plugin_from_environment({"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"})
        # FullyShardedDataParallelPlugin(cpu_offload=True, ...)
    """
    environ = os.environ if environ is None else environ
    if not flag_value(ACCELERATE_USE_FSDP, environ.get(ACCELERATE_USE_FSDP, "false")):
        return None
    fields = {}
    for key, (field, read) in _SETTINGS.items():
        name = FSDP_VARIABLES[key]
        text = environ.get(name)
        if text is None or text == "":
            continue
        value = read(name, text)
        if key in _REFUSED and value:
            raise NotImplementedError(f"{name}={text} ({key}) is not supported by nblaunch: {_REFUSED[key]}")
        fields[field] = value
    return FullyShardedDataParallelPlugin(**fields)
