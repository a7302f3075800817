"""``nblaunch launch``'s torch.compile options, as ``accelerate launch`` takes them: the
``--dynamo_*`` flags and a config file's ``dynamo_config``, handed to every rank's Accelerator as
Accelerate's ``ACCELERATE_DYNAMO_*`` variables (flags given win over the file). A backend torch
does not have is refused before any process starts.

Example::

    nblaunch launch --num-processes 2 --dynamo_backend inductor --dynamo_mode max-autotune train.py
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_dynamo_flags", "dynamo_from_file", "dynamo_environ"]

# Flag (and config key) -> the variable TorchDynamoPlugin reads.
_VARIABLES = {
    "dynamo_backend": "ACCELERATE_DYNAMO_BACKEND",
    "dynamo_mode": "ACCELERATE_DYNAMO_MODE",
    "dynamo_use_fullgraph": "ACCELERATE_DYNAMO_USE_FULLGRAPH",
    "dynamo_use_dynamic": "ACCELERATE_DYNAMO_USE_DYNAMIC",
    "dynamo_use_regional_compilation": "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
}


def add_dynamo_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("torch.compile (accelerate launch's flags)")
    group.add_argument("--dynamo_backend", "--dynamo-backend", default=None, metavar="B",
                       help="compile every rank's prepared models with this torch.compile backend (inductor, "
                            "aot_eager, ...; no: never, not even fp8's default)")
    group.add_argument("--dynamo_mode", "--dynamo-mode", default=None, metavar="M",
                       help="default, reduce-overhead or max-autotune")
    for flag, what in (("fullgraph", "no graph breaks: the whole forward in one graph"),
                       ("dynamic", "trace with dynamic shapes"),
                       ("regional_compilation", "compile each repeated block (a ModuleList's) on its own: faster "
                                                "to compile")):
        group.add_argument(f"--dynamo_use_{flag}", f"--dynamo-use-{flag.replace('_', '-')}", action="store_true",
                           default=None, help=what)


def dynamo_from_file(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``dynamo_*`` settings of a config file (its ``dynamo_config``, keys with or without
    the prefix, or an old file's top-level ``dynamo_backend``)."""
    section = raw.get("dynamo_config") if isinstance(raw.get("dynamo_config"), dict) else {}
    found = {(key if key.startswith("dynamo_") else f"dynamo_{key}"): value for key, value in section.items()}
    if raw.get("dynamo_backend") is not None:
        found.setdefault("dynamo_backend", raw["dynamo_backend"])
    return {key: value for key, value in found.items() if key in _VARIABLES and value is not None}


def dynamo_environ(options: argparse.Namespace, from_file: dict[str, Any]) -> dict[str, str]:
    """The ``ACCELERATE_DYNAMO_*`` variables for the ranks: flags given, else the file's; none
    when neither asks (then only fp8 on GPUs with fp8 units compiles). Raises ``ValueError`` for
    a backend torch does not have."""
    settings = dict(from_file)
    settings.update({key: getattr(options, key) for key in _VARIABLES if getattr(options, key, None) is not None})
    if not settings:
        return {}
    backend = str(getattr(settings.get("dynamo_backend"), "value", settings.get("dynamo_backend") or "no")).lower()
    if backend != "no":
        from nblaunch.training.precision.compiling import check_backend  # deferred: imports torch._dynamo
        check_backend(backend)
    return {_VARIABLES[key]: str(value) for key, value in settings.items()}
