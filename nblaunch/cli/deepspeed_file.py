"""A config file's DeepSpeed section (``distributed_type: DEEPSPEED`` and ``deepspeed_config``,
as ``accelerate config`` writes it) as the variables every rank's ``Accelerator()`` reads, the
way ``accelerate launch`` hands them over; checked here, before any rank starts.

Example::

    deepspeed_environ({"zero_stage": 3, "offload_optimizer_device": "cpu"}, "cfg.yaml")
    # {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", ...}
"""

from __future__ import annotations

import importlib.util
from typing import Any

from nblaunch.contract.variables import ACCELERATE_USE_DEEPSPEED, DEEPSPEED_VARIABLES

__all__ = ["deepspeed_environ"]

# Keys accelerate config writes that only its own launcher reads (multi-node through DeepSpeed's).
_LAUNCHER_ONLY = ("deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
                  "deepspeed_inclusion_filter")


def deepspeed_environ(section: Any, path: str) -> dict[str, str]:
    """The variables for ``section`` (the file's ``deepspeed_config``); refuses, naming the key,
    what a rank would refuse, and a machine without DeepSpeed (a ``ValueError`` saying which)."""
    section = section or {}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: deepspeed_config: expected key: value lines under it, found {section!r}")
    if importlib.util.find_spec("deepspeed") is None:
        raise ValueError(f'{path} asks for DeepSpeed, which is not installed: pip install "nblaunch[deepspeed]"')
    environ = {ACCELERATE_USE_DEEPSPEED: "true"}
    for key, value in section.items():
        if key in _LAUNCHER_ONLY:
            continue
        if key not in DEEPSPEED_VARIABLES:
            raise ValueError(f"{path}: deepspeed_config.{key} is not a DeepSpeed setting nblaunch knows: give "
                              f"{', '.join(sorted(DEEPSPEED_VARIABLES))}")
        environ[DEEPSPEED_VARIABLES[key]] = str(value).lower() if isinstance(value, bool) else str(value)
    _check(environ, path)
    return environ


def _check(environ: dict[str, str], path: str) -> None:
    """Build the plugin each rank will build, so a bad value stops here."""
    # deferred: the training side imports torch, which the rest of the command line does not need
    from nblaunch.training.options.deepspeed_plugin import deepspeed_plugin_from_environment

    try:
        deepspeed_plugin_from_environment(environ)
    except (ValueError, TypeError, OSError) as error:
        raise ValueError(f"{path}: deepspeed_config: {error}") from None
