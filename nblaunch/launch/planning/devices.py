"""What accelerators this machine has, found without initialising CUDA in the launcher.

``torch.cuda.device_count()`` may initialise the driver, after which forking breaks CUDA in
the children. NVML answers the same question without touching the CUDA runtime.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

from nblaunch.contract.variables import CUDA_VISIBLE_DEVICES


@lru_cache(maxsize=1)
def _nvml_capabilities() -> tuple[tuple[int, int], ...]:
    """Each GPU's CUDA compute capability, through NVML (empty where there is none)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return ()
    if nvml.nvmlInit_v2() != 0:
        return ()
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return ()
        found = []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(0), ctypes.c_int(0)
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
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
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0  # no NVIDIA driver on this machine
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0
        return count.value
    finally:
        nvml.nvmlShutdown()


def _visible_limit(physical: int) -> int:
    """Apply CUDA_VISIBLE_DEVICES as the CUDA runtime does: entries up to the first invalid one."""
    visible = os.environ.get(CUDA_VISIBLE_DEVICES)
    if visible is None:
        return physical
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(count, physical)


def cuda_device_count() -> int:
    """Number of CUDA devices this process may use, without initialising CUDA."""
    return _visible_limit(_nvml_device_count())


def cuda_initialized() -> bool:
    """True if this process has already initialised CUDA (so it must not fork): torch's CUDA,
    or only the driver, which ``torch.cuda.is_available()`` initialises without saying so."""
    torch = sys.modules.get("torch")  # not imported means not initialised
    return bool(torch is not None and torch.cuda.is_initialized()) or _driver_initialized()


_CUDA_SUCCESS = 0  # cuDeviceGetCount before cuInit: CUDA_ERROR_NOT_INITIALIZED (3)


def _driver_initialized() -> bool:
    """Whether the CUDA driver is loaded in this process and initialised (cuInit has run)."""
    try:  # RTLD_NOLOAD: only a library this process already loaded; never loads the driver
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuDeviceGetCount(ctypes.byref(count)) == _CUDA_SUCCESS
