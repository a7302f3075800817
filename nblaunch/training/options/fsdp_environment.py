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

from nblaunch.training.options.fsdp_plugin import FullyShardedDataParallelPlugin

__all__ = ["fsdp_plugin_from_environment", "FSDP_VARIABLES", "flag_value"]

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


# Each variable Accelerate's launcher sets, the plugin field it fills, and how its text is read.
FSDP_VARIABLES: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "FSDP_VERSION": ("fsdp_version", _whole_number),
    "FSDP_SHARDING_STRATEGY": ("sharding_strategy", _text),
    "FSDP_RESHARD_AFTER_FORWARD": ("reshard_after_forward", _text),
    "FSDP_OFFLOAD_PARAMS": ("cpu_offload", flag_value),
    "FSDP_MIN_NUM_PARAMS": ("min_num_params", _whole_number),
    "FSDP_AUTO_WRAP_POLICY": ("auto_wrap_policy", _text),
    "FSDP_TRANSFORMER_CLS_TO_WRAP": ("transformer_cls_names_to_wrap", _text),
    "FSDP_BACKWARD_PREFETCH": ("backward_prefetch", _text),
    "FSDP_STATE_DICT_TYPE": ("state_dict_type", _text),
    "FSDP_FORWARD_PREFETCH": ("forward_prefetch", flag_value),
    "FSDP_USE_ORIG_PARAMS": ("use_orig_params", flag_value),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": ("cpu_ram_efficient_loading", flag_value),
    "FSDP_SYNC_MODULE_STATES": ("sync_module_states", flag_value),
    "FSDP_ACTIVATION_CHECKPOINTING": ("activation_checkpointing", flag_value),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": ("activation_checkpointing_offload", flag_value),
    "FSDP_IGNORED_MODULES": ("ignored_modules", _text),  # a regular expression over module names
}

# What nblaunch refuses, said for each way the variable is set (flag, config file key).
_REFUSED_FLAGS = {
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "set it to false (--fsdp_activation_checkpointing_offload false) "
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
    if not flag_value("ACCELERATE_USE_FSDP", environ.get("ACCELERATE_USE_FSDP", "false")):
        return None
    fields = {}
    for name, (field, read) in FSDP_VARIABLES.items():
        text = environ.get(name)
        if text is None or text == "":
            continue
        value = read(name, text)
        if name in _REFUSED_FLAGS and value:
            key = "fsdp_" + name[len("FSDP_"):].lower()  # its name in a config file's fsdp_config
            raise NotImplementedError(f"{name}={text} ({key}) is not supported by nblaunch: {_REFUSED_FLAGS[name]}")
        fields[field] = value
    return FullyShardedDataParallelPlugin(**fields)
