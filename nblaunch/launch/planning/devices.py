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

_NVML_SUCCESS = 0


def open_nvml() -> tuple[ctypes.CDLL, list[ctypes.c_void_p]] | None:
    """NVML, initialised, with a handle for each GPU in NVML's order; None where there is no
    NVIDIA driver or NVML lists no GPU. The caller ends the session: ``nvml.nvmlShutdown()``.

    Example::

        opened = open_nvml()
        if opened is not None:
            nvml, handles = opened
            ...
            nvml.nvmlShutdown()
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None  # no NVIDIA driver on this machine
    if nvml.nvmlInit_v2() != _NVML_SUCCESS:
        return None
    count, handles = ctypes.c_uint(0), []
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == _NVML_SUCCESS:
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != _NVML_SUCCESS:
                break
            handles.append(handle)
    if not handles:
        nvml.nvmlShutdown()
        return None
    return nvml, handles



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
