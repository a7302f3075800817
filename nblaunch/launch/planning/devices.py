"""What accelerators this machine has, found without initialising CUDA in the launcher.

``torch.cuda.device_count()`` may initialise the driver, after which forking breaks CUDA in
the children. NVML answers the same question without touching the CUDA runtime.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

from nblaunch.contract.variables import CUDA_VISIBLE_DEVICES
from nblaunch.machine.cuda import cuda_initialized  # noqa: F401  (the planner asks it here)
from nblaunch.machine.nvml import NVML_SUCCESS as _NVML_SUCCESS, open_nvml


@lru_cache(maxsize=1)
def _nvml_capabilities() -> tuple[tuple[int, int], ...]:
    """Each GPU's CUDA compute capability, through NVML (empty where there is none)."""
    opened = open_nvml()
    if opened is None:
        return ()
    nvml, handles = opened
    try:
        found = []
        for handle in handles:
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != _NVML_SUCCESS:
                return ()
            found.append((major.value, minor.value))
        return tuple(found)
    finally:
        nvml.nvmlShutdown()


def cuda_capability() -> tuple[int, int] | None:
    """The lowest CUDA compute capability among this machine's GPUs, without initialising CUDA
    (None where NVML cannot tell): what ``mixed_precision="auto"`` decides by."""
    capabilities = _nvml_capabilities()
    return min(capabilities) if capabilities else None


@lru_cache(maxsize=1)
def _nvml_device_count() -> int:
    opened = open_nvml()
    if opened is None:
        return 0
    nvml, handles = opened
    nvml.nvmlShutdown()
    return len(handles)


def visible_gpus(physical: int) -> list[int | None]:
    """The GPUs CUDA shows this process, in CUDA's order, as NVML's indices among ``physical``
    GPUs; None for one that ``CUDA_VISIBLE_DEVICES`` names by UUID (not resolved here). As the
    CUDA runtime does, the variable is read up to its first invalid entry (empty, negative, out
    of range), so ``"0,1,-1,2"`` shows two GPUs and ``""`` none."""
    visible = os.environ.get(CUDA_VISIBLE_DEVICES)
    if visible is None:
        return list(range(physical))
    found: list[int | None] = []
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < physical:
            found.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            found.append(None)
        else:
            break
    return found[:physical]


def cuda_device_count() -> int:
    """Number of CUDA devices this process may use, without initialising CUDA."""
    return len(visible_gpus(_nvml_device_count()))
