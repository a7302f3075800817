"""Hugging Face Accelerate's config files (what ``accelerate config`` writes) as the options of
``nblaunch launch``.

``nblaunch launch --config_file PATH`` reads one (YAML, or JSON when the name ends in ``.json``,
as Accelerate decides). Without ``--config_file``, Accelerate's default file is read when it
exists, as ``accelerate launch`` does (and, like it, not with ``--cpu``):
``$HF_HOME/accelerate/default_config.yaml``, where ``HF_HOME`` defaults to
``$XDG_CACHE_HOME/huggingface``, then ``~/.cache/huggingface``. Flags given on the command line win
over the file.

Honoured: ``num_processes`` (Accelerate's count over every machine), ``num_machines``,
``machine_rank``, ``main_process_ip``, ``main_process_port``, ``mixed_precision``, ``use_cpu``,
``gpu_ids`` (as ``CUDA_VISIBLE_DEVICES``), ``distributed_type`` (NO: one process; MULTI_CPU: on the
CPU; FSDP: ``fsdp_config`` reaches every rank's Accelerator as Accelerate's ``FSDP_*`` variables),
and keys with nothing to do here; DEEPSPEED: ``deepspeed_config`` reaches every rank as Accelerate's
``ACCELERATE_DEEPSPEED_*`` variables (``cli/deepspeed_file``); ``dynamo_config``: ``ACCELERATE_DYNAMO_*``
(``cli/dynamo_options``). Megatron-LM and the like are refused with
what to do; keys nblaunch does not know are named in one warning.

Example::

    config = read_config("default_config.yaml")
    config.options   # {"num_processes": 2, "mixed_precision": "bf16", "cpu": True}
    rank_environ = apply_config(options, config)   # options: launch's parsed command line
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from nblaunch.cli.deepspeed_file import deepspeed_environ
from nblaunch.cli.dynamo_options import dynamo_from_file
from nblaunch.contract.precision import AUTO, fast_precision, parse_precision
from nblaunch.contract.variables import ACCELERATE_USE_FSDP, FSDP_VARIABLES
from nblaunch.launch.planning.devices import cuda_capability, cuda_device_count

__all__ = ["AccelerateConfig", "ConfigError", "apply_config", "config_to_read", "default_config_path",
           "read_config", "visible_devices", "write_basic_config"]


class ConfigError(ValueError):
    """A config file (or a flag) ``nblaunch launch`` cannot honour; the message says what to do."""


# Keys the file maps straight onto launch's options (its argparse destinations).
_OPTIONS = {"num_machines": "num_nodes", "machine_rank": "node_rank", "main_process_ip": "master_addr",
            "main_process_port": "port", "gpu_ids": "gpu_ids"}
# Every other key nblaunch knows: read in read_config, checked in _refusals, or with nothing to do
# here whatever its value.
_KNOWN = {"mixed_precision", "fp16", "use_cpu", "num_processes", "distributed_type", "fsdp_config",
          "compute_environment", "deepspeed_config", "megatron_lm_config", "dynamo_config", "dynamo_backend",
          "fp8_config", "parallelism_config", "mpirun_config", "tpu_use_cluster", "rdzv_backend",
          "debug", "downcast_bf16", "enable_cpu_affinity", "same_network", "main_training_function", "tpu_env",
          "tpu_use_sudo", "tpu_name", "tpu_zone", "tpu_vm", "command_file", "commands"}
_DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED", "XLA", "TPU")
_ELSEWHERE = ("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
_OTHER_CONFIG = "use a config without it (accelerate config --config_file other.yaml, then --config_file other.yaml)"


@dataclass
class AccelerateConfig:
    """What one config file asks of ``nblaunch launch``, keyed by launch's option names; a key
    the file does not give is absent. ``total_processes`` is Accelerate's ``num_processes`` (all
    machines together); ``fsdp`` holds ``fsdp_config`` under Accelerate's flag names."""

    path: str
    options: dict[str, Any] = field(default_factory=dict)
    distributed_type: str | None = None
    total_processes: int | None = None
    fsdp: dict[str, Any] = field(default_factory=dict)
    deepspeed: dict[str, str] = field(default_factory=dict)  # the variables of its deepspeed_config
    dynamo: dict[str, Any] = field(default_factory=dict)  # its dynamo_config (cli/dynamo_options)
    unknown: list[str] = field(default_factory=list)


def default_config_path(environ: Mapping[str, str] | None = None) -> str:
    """Where ``accelerate config`` saves, and ``accelerate launch`` looks, by default.

    Example: with ``HF_HOME=/data/hf``, ``"/data/hf/accelerate/default_config.yaml"``.
    """
    environ = os.environ if environ is None else environ
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.expanduser(os.path.join(home, "accelerate", "default_config.yaml"))


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None,
                       use_xpu: bool = False) -> str | bool:
    """Write a config for this machine, as Accelerate's ``write_basic_config`` does (JSON, every
    GPU or one CPU process), to ``save_location`` (default: Accelerate's default file, which
    ``nblaunch launch`` and ``accelerate launch`` read). Returns its path, or False, leaving it as
    it is, where a file is already there.

    Example::

        write_basic_config(mixed_precision="bf16")   # ~/.cache/huggingface/accelerate/default_config.yaml
    """
    mixed_precision = parse_precision(mixed_precision)  # ValueError for a word nblaunch does not know
    if mixed_precision == AUTO:  # Accelerate reads the file too, and knows no "auto": decided here
        mixed_precision = fast_precision("cuda" if cuda_device_count() else "cpu", cuda_capability())
    if use_xpu:
        raise ValueError("write_basic_config(use_xpu=True): nblaunch does not drive XPUs")
    path = os.path.expanduser(save_location) if save_location is not None else default_config_path()
    if os.path.exists(path):
        print(f"Configuration already exists at {path}, will not override. Run `accelerate config` "
              "manually or pass a different `save_location`.")
        return False
    gpus = cuda_device_count()
    config = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": mixed_precision, "debug": False,
              "enable_cpu_affinity": False, "num_processes": max(gpus, 1), "use_cpu": gpus == 0,
              "distributed_type": "MULTI_GPU" if gpus > 1 else "NO"}
    if gpus:
        config["gpu_ids"] = "all"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(config, file, indent=2)
    return path


def config_to_read(config_file: str | None, cpu: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """The file to read: ``config_file`` if given (it must exist), else the default one if it
    exists and ``--cpu`` was not given (``accelerate launch``'s rule), else None."""
    if config_file is not None:
        if not os.path.isfile(config_file):
            raise ConfigError(f"no such config file: {config_file!r} (accelerate config --config_file "
                              f"{config_file} writes one)")
        return config_file
    default = default_config_path(environ)
    return default if os.path.isfile(default) and not cpu else None


def read_config(path: str) -> AccelerateConfig:
    """Read and check the file at ``path``; refusals raise :class:`ConfigError` naming the key."""
    raw = _load(path)
    config = AccelerateConfig(path=path, unknown=sorted(set(raw) - _KNOWN - set(_OPTIONS)))
    _refusals(raw, path)
    for key, destination in _OPTIONS.items():
        if raw.get(key) is not None:
            config.options[destination] = raw[key]
    for key, destination, minimum in (("num_machines", "num_nodes", 1), ("machine_rank", "node_rank", 0),
                                      ("main_process_port", "port", 0)):
        if destination in config.options:
            config.options[destination] = _whole(path, key, config.options[destination], minimum)
    if config.options.get("port") == 0:  # Accelerate's "a free one", which is nblaunch's default
        del config.options["port"]
    if "master_addr" in config.options:
        config.options["master_addr"] = str(config.options["master_addr"])
    precision = raw.get("mixed_precision") or ("fp16" if raw.get("fp16") else None)  # fp16: old files
    if precision is not None:
        try:
            config.options["mixed_precision"] = parse_precision(str(precision))
        except ValueError as error:
            raise ConfigError(f"{path}: {error}") from None
    if raw.get("use_cpu"):
        config.options["cpu"] = True
    if raw.get("num_processes") is not None:
        config.total_processes = _whole(path, "num_processes", raw["num_processes"], -1)
    kind = raw.get("distributed_type")
    if kind is not None:
        config.distributed_type = _distributed_type(path, str(kind).upper())
    if config.distributed_type == "DEEPSPEED" or raw.get("deepspeed_config"):
        try:
            config.deepspeed = deepspeed_environ(raw.get("deepspeed_config"), path)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    config.dynamo = dynamo_from_file(raw)
    fsdp = raw.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise ConfigError(f"{path}: fsdp_config: expected fsdp_...: value lines under it, found {fsdp!r}")
    for key, value in fsdp.items():
        name = key if key.startswith("fsdp") else f"fsdp_{key}"  # Accelerate adds the prefix too
        if name in FSDP_VARIABLES:
            config.fsdp[name] = value
        else:
            config.unknown.append(f"fsdp_config.{key}")
    return config


def apply_config(options: argparse.Namespace, config: AccelerateConfig | None) -> dict[str, str]:
    """Fill what the command line left unset (None) from ``config``, then nblaunch's defaults;
    return the variables every rank gets (Accelerate's ``ACCELERATE_USE_FSDP`` and ``FSDP_*``, or
    ``ACCELERATE_USE_DEEPSPEED`` and ``ACCELERATE_DEEPSPEED_*``).

    Example: ``--mixed_precision no`` and a file saying ``bf16`` leave ``options.mixed_precision == "no"``.
    """
    fsdp_flags = [key for key in FSDP_VARIABLES if getattr(options, key) is not None]
    if config is not None:
        _fill(options, config)
    # num_nodes stays None unless given: one node here, every node of a Slurm allocation.
    for name, default in (("mixed_precision", "no"), ("node_rank", 0), ("master_addr", "127.0.0.1")):
        if getattr(options, name) is None:
            setattr(options, name, default)
    deepspeed = dict(config.deepspeed) if config is not None else {}
    if deepspeed and options.use_fsdp:
        raise ConfigError(f"{config.path} asks for DeepSpeed and the command line for FSDP: one stack spreads a "
                          "model; drop --use_fsdp or use a config without deepspeed_config")
    if not options.use_fsdp:
        if fsdp_flags:
            raise ConfigError(f"--{fsdp_flags[0]} only applies to FSDP: add --use_fsdp (or distributed_type: FSDP "
                              "in the config file)")
        return deepspeed
    environ = {ACCELERATE_USE_FSDP: "true"}
    for key, variable in FSDP_VARIABLES.items():
        value = getattr(options, key)
        if value is not None:
            environ[variable] = _as_text(value)
    _check_fsdp(environ, options.mixed_precision, config)
    return environ


def visible_devices(gpu_ids: Any, cpu: bool, cluster: str | None, current: str | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for ``gpu_ids`` (``"0,1"``; ``"all"`` or None: leave it), or None
    when there is nothing to set. Refuses what would not mean what it says.

    Example: ``visible_devices("0,1", cpu=False, cluster=None, current=None)`` is ``"0,1"``.
    """
    if gpu_ids is None or str(gpu_ids).strip().lower() == "all" or cpu:  # --cpu hides every GPU anyway
        return None
    ids = ",".join(part.strip() for part in str(gpu_ids).split(","))
    if not all(re.fullmatch(r"\d+|(GPU|MIG)-[\w./-]+", part) for part in ids.split(",")):
        raise ConfigError(f"gpu_ids: {gpu_ids!r}: give GPU numbers separated by commas (0,1) or all")
    if cluster is not None:
        raise ConfigError(f"gpu_ids cannot choose the GPUs of the nodes of cluster {cluster!r}: leave it out (or all) "
                          "and set CUDA_VISIBLE_DEVICES in the environment of each node's workers")
    if current is not None and current != ids:
        raise ConfigError(f"gpu_ids: {ids} and CUDA_VISIBLE_DEVICES={current} disagree: unset CUDA_VISIBLE_DEVICES, "
                          "or leave gpu_ids out (or all)")
    return ids


def _load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as file:
        text = file.read()
        # Accelerate's rule is JSON by the name, YAML otherwise; JSON is YAML too, so a JSON file
        # under any name (write_basic_config writes one to default_config.yaml) needs no PyYAML.
        if path.endswith(".json") or text.lstrip().startswith("{"):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path} is not valid JSON: {error}") from None
        else:
            try:
                import yaml  # deferred: PyYAML is optional, needed only for a YAML file
            except ImportError:
                raise ConfigError(f"reading {path} needs PyYAML: pip install pyyaml (or give the config as "
                                  "a .json file)") from None
            try:
                raw = yaml.safe_load(text)
            except yaml.YAMLError as error:  # its lines say what and where: one line here
                raise ConfigError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not an Accelerate config: expected key: value lines, found a "
                          f"{type(raw).__name__}")
    return raw


def _refusals(raw: dict[str, Any], path: str) -> None:
    """Refuse what the file asks for that nblaunch does not do, naming the key and what to do."""
    def refuse(what: str, why: str) -> None:
        raise ConfigError(f"{path}: {what} is not supported by nblaunch: {why}")

    if str(raw.get("compute_environment") or "LOCAL_MACHINE").upper() != "LOCAL_MACHINE":
        refuse(f"compute_environment: {raw['compute_environment']}", "nblaunch runs the ranks on this machine "
               "(or a Ray cluster); use accelerate launch for SageMaker")
    kind = str(raw.get("distributed_type") or "").upper()
    if kind == "MEGATRON_LM" or raw.get("megatron_lm_config"):
        refuse("Megatron-LM (distributed_type: MEGATRON_LM, megatron_lm_config)", _OTHER_CONFIG)
    for key, why in (("fp8_config", "give the recipe in the script (Accelerator(mixed_precision='fp8', "
                                    "kwargs_handlers=[...]))"),
                     ("parallelism_config", "give the sizes in the script (Accelerator(parallelism_config="
                                            "ParallelismConfig(tp_size=...))) and remove it from the file"),
                     ("mpirun_config", "nblaunch starts the ranks itself: remove it, and run nblaunch launch on "
                                       "each machine")):
        if raw.get(key):
            refuse(key, why)
    if raw.get("tpu_use_cluster"):
        refuse("tpu_use_cluster: true", "run nblaunch launch on each TPU host (torch_xla is used by itself)")
    if str(raw.get("rdzv_backend") or "static").lower() != "static":
        refuse(f"rdzv_backend: {raw['rdzv_backend']}", "the ranks meet at main_process_ip:main_process_port; set "
               "rdzv_backend: static and each machine's machine_rank")


def _distributed_type(path: str, kind: str) -> str:
    if kind in _ELSEWHERE:
        raise ConfigError(f"{path}: distributed_type: {kind} is not supported by nblaunch: it runs on CUDA GPUs, "
                          "CPUs and TPUs")
    if kind not in _DISTRIBUTED_TYPES:
        raise ConfigError(f"{path}: distributed_type: {kind}: give one of {', '.join(_DISTRIBUTED_TYPES)}")
    return kind


def _whole(path: str, key: str, value: Any, minimum: int) -> int:
    try:
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise ValueError
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: {key}: {value!r}: give a whole number") from None
    if number < minimum:
        raise ConfigError(f"{path}: {key}: {number}: must be at least {minimum}")
    return number


def _fill(options: argparse.Namespace, config: AccelerateConfig) -> None:
    for name, value in config.options.items():
        if name == "cpu":
            options.cpu = options.cpu or value
        elif getattr(options, name) is None:
            setattr(options, name, value)
    # As accelerate launch: --multi_gpu or --use_fsdp on the command line outvote distributed_type.
    kind = None if options.multi_gpu or options.use_fsdp else config.distributed_type
    if kind == "FSDP":
        options.use_fsdp = True
    elif kind == "MULTI_CPU":
        options.cpu = True
    if options.num_processes is None and kind not in ("XLA", "TPU"):  # on TPU every local device takes part
        if kind == "NO":
            options.num_processes = 1  # accelerate launch runs one process, whatever num_processes says
        elif config.total_processes == -1:
            raise ConfigError(f"{config.path} leaves num_processes to the command line: give --num-processes N")
        elif config.total_processes is not None:
            nodes = options.num_nodes or 1
            if config.total_processes % nodes:
                raise ConfigError(f"{config.path}: num_processes: {config.total_processes} counts every machine's "
                                  f"processes, and is not a multiple of num_machines: {nodes}")
            options.num_processes = config.total_processes // nodes
    for key, value in config.fsdp.items():
        if getattr(options, key) is None:
            setattr(options, key, value)


def _as_text(value: Any) -> str:
    """A value as Accelerate's launcher writes it into a variable: booleans lower-case, lists of
    class names joined by commas."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)


def _check_fsdp(environ: dict[str, str], mixed_precision: str, config: AccelerateConfig | None) -> None:
    """Build the plugin every rank will build from ``environ`` and check it, so a setting nblaunch
    refuses stops the command before any rank starts."""
    # deferred: the training side imports torch, which the rest of the command line does not need
    from nblaunch.training.options.fsdp_environment import fsdp_plugin_from_environment
    from nblaunch.training.options.fsdp_plugin import sharding_settings

    where = f"FSDP settings ({f'fsdp_config in {config.path}, ' if config else ''}--fsdp_* flags)"
    try:
        sharding_settings(fsdp_plugin_from_environment(environ), mixed_precision)
    except (ValueError, NotImplementedError) as error:
        raise ConfigError(f"{where}: {error}") from None
