"""TPU hosts, for XLA launches: is this one, is torch_xla usable, how many local devices.

Everything here runs before any process starts and never initialises the XLA runtime: a
runtime initialised in the launcher breaks every later ``xmp.spawn``.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import os
import sys

from nblaunch.contract import variables as v
from nblaunch.launch.errors import LaunchConfigError

_STRONG_TPU_VARIABLES = ("TPU_NAME", "COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")


def tpu_markers() -> list[str]:
    """What says this machine has TPUs, without touching them (empty on other machines)."""
    found = [name for name in _STRONG_TPU_VARIABLES if os.environ.get(name)]
    if os.environ.get(v.PJRT_DEVICE, "").upper().startswith("TPU"):
        found.append("PJRT_DEVICE=TPU")
    return found + list(_tpu_device_files())


@functools.lru_cache(maxsize=1)
def _tpu_device_files() -> tuple[str, ...]:
    """TPU device files; they do not come and go while a kernel runs, so look once."""
    found = []
    if glob.glob("/dev/accel[0-9]*"):
        found.append("/dev/accel*")
    if glob.glob("/dev/vfio/[0-9]*") and xla_installed():  # TPU v5e/v6e expose chips through VFIO
        found.append("/dev/vfio/*")
    return tuple(found)


def xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def version_problem(torch_version: str, xla_version: str) -> str | None:
    """Why this torch and torch_xla cannot work together, or None if they can.

    torch_xla's wheel declares no torch requirement, and with another torch ``import
    torch_xla`` dies with an undefined symbol; so compare before importing it.
    """
    if _base(torch_version) == _base(xla_version):
        return None
    wanted = _base(xla_version)
    return (
        f"torch_xla {wanted} needs torch {wanted}, but torch {_base(torch_version)} is installed. "
        f"Install matching versions: pip install torch=={wanted} 'torch_xla[tpu]=={wanted}' "
        "(on Colab or Kaggle, then restart the runtime)."
    )


def check_usable() -> None:
    """Raise LaunchConfigError unless torch_xla is installed, matches torch, and the XLA
    runtime is not initialised in this process."""
    if not xla_installed():
        raise LaunchConfigError(
            "this launch needs torch_xla, which is not installed: pip install 'torch_xla[tpu]' with the "
            "same version as torch (or pass start_method='fork' to run on the CPU)."
        )
    problem = version_problem(importlib.metadata.version("torch"), importlib.metadata.version("torch_xla"))
    if problem:
        raise LaunchConfigError(problem)
    if runtime_initialized():
        raise LaunchConfigError(
            "an XLA device was used in this kernel before the launch: restart the runtime, or move that "
            "cell into the function (xmp.spawn cannot start once the XLA runtime runs in this process)."
        )


def runtime_initialized() -> bool:
    torch_xla = sys.modules.get("torch_xla")  # not imported means not initialised
    return bool(torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized())


def local_device_count(requested: int | None) -> tuple[int, dict[str, str]]:
    """How many ranks this host runs, and variables the host process needs for that.

    On TPU every local device takes part (``xmp.spawn`` cannot use a subset); on the CPU
    (``PJRT_DEVICE=CPU``, for tests) ``CPU_NUM_DEVICES`` threads, set from ``num_processes``.
    """
    device = os.environ.get(v.PJRT_DEVICE, "").upper()
    if device == "CPU":
        count = int(os.environ.get(v.CPU_NUM_DEVICES, requested or 1))
        if requested is not None and requested != count:
            raise LaunchConfigError(
                f"num_processes={requested} but CPU_NUM_DEVICES={count}: pass num_processes={count} or None"
            )
        return count, {v.CPU_NUM_DEVICES: str(count)}
    from torch_xla._internal import tpu  # reads PCI ids and metadata; does not start the runtime

    count = tpu.num_local_processes() * tpu.num_logical_cores_per_chip()
    if count == 0:
        raise LaunchConfigError(
            "no TPU chip is attached to this machine (none found on PCI). On Colab/Kaggle choose a TPU "
            "runtime; to run torch_xla on the CPU set PJRT_DEVICE=CPU."
        )
    if requested is not None and requested != count:
        raise LaunchConfigError(
            f"on TPU every local device takes part: this host has {count}; pass num_processes=None "
            f"(or {count})."
        )
    return count, {v.PJRT_DEVICE: os.environ.get(v.PJRT_DEVICE) or "TPU"}
