"""NVML, NVIDIA's management library: what the GPUs are and hold, asked without starting CUDA.

The launcher counts and samples GPUs through it (a launcher that started CUDA could not fork),
and each rank's row shows its GPU's use through it.

Example::

    opened = open_nvml()
    if opened is not None:
        nvml, handles = opened
        free, used, total = memory_info(nvml, handles[0])
        nvml.nvmlShutdown()
"""

from __future__ import annotations

import ctypes

NVML_SUCCESS = 0


class Memory(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def open_nvml() -> tuple[ctypes.CDLL, list[ctypes.c_void_p]] | None:
    """NVML, initialised, with a handle for each GPU in NVML's order; None where there is no
    NVIDIA driver or NVML lists no GPU. The caller ends the session: ``nvml.nvmlShutdown()``."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None  # no NVIDIA driver on this machine
    if nvml.nvmlInit_v2() != NVML_SUCCESS:
        return None
    count, handles = ctypes.c_uint(0), []
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == NVML_SUCCESS:
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != NVML_SUCCESS:
                break
            handles.append(handle)
    if not handles:
        nvml.nvmlShutdown()
        return None
    return nvml, handles


def memory_info(nvml: ctypes.CDLL, handle: ctypes.c_void_p) -> tuple[int, int, int] | None:
    """(free, used, total) bytes of one GPU, or None where NVML cannot say."""
    memory = Memory()
    if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != NVML_SUCCESS:
        return None
    return memory.free, memory.used, memory.total


def handle_by_uuid(nvml: ctypes.CDLL, uuid: str) -> ctypes.c_void_p | None:
    """The handle of the GPU whose UUID is ``uuid`` ("GPU-..." as NVML writes it), or None."""
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != NVML_SUCCESS:
        return None
    return handle


def handle_by_pci_bus_id(nvml: ctypes.CDLL, address: str) -> ctypes.c_void_p | None:
    """The handle of the GPU at PCI address ``address`` ("00000000:3B:00.0"), or None."""
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByPciBusId_v2(address.encode(), ctypes.byref(handle)) != NVML_SUCCESS:
        return None
    return handle
