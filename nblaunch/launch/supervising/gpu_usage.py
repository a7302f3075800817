"""Each rank's GPU, as NVML sees it: utilisation and memory, for the rank's row in the cell.

Asked from the launcher, never from the ranks, and through NVML, never CUDA: the launcher must
stay fork-safe, and a rank busy in a kernel still gets its row filled. A rank's GPU is the one
NVML lists its process on (then the memory shown is the rank's own); where NVML names no process
of the rank (a container that hides pids, a rank that has not touched its GPU yet) it is the
GPU of the rank's position among the visible ones, with the GPU's memory.

Example (what the supervisor does every ``SAMPLE_EVERY_S`` while ranks run)::

    sampler = GpuSampler.open()          # None without an NVIDIA driver
    sampler.sample({0: 4242, 1: 4243})   # [GpuUsage(rank=0, gpu=0, utilization=87, ...), ...]
    sampler.close()
"""

from __future__ import annotations

import ctypes

from nblaunch.events import GpuUsage
from nblaunch.launch.planning.devices import visible_gpus
from nblaunch.machine.nvml import Memory, open_nvml

SAMPLE_EVERY_S = 2.0
_SUCCESS, _INSUFFICIENT_SIZE = 0, 7


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Process(ctypes.Structure):  # nvmlProcessInfo_t, as nvmlDeviceGetComputeRunningProcesses_v3 fills it
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class GpuSampler:
    """An open NVML session for one attempt of a launch; ``close()`` ends it."""

    def __init__(self, nvml: ctypes.CDLL, handles: list[ctypes.c_void_p]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._visible = visible_gpus(len(handles))

    @classmethod
    def open(cls) -> GpuSampler | None:
        """A sampler, or None where NVML is missing or lists no GPU."""
        opened = open_nvml()
        return None if opened is None else cls(*opened)

    def close(self) -> None:
        self._nvml.nvmlShutdown()

    def sample(self, pids: dict[int, int]) -> list[GpuUsage]:
        """One ``GpuUsage`` per rank of ``pids`` (rank -> its process id) whose GPU can be told."""
        gpus = []  # (index, utilisation, used, total, {pid: used by it})
        for index, handle in enumerate(self._handles):
            memory, busy = Memory(), _Utilization()
            if (self._nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != _SUCCESS
                    or self._nvml.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(busy)) != _SUCCESS):
                continue
            gpus.append((index, busy.gpu, memory.used, memory.total, self._processes(handle)))
        found = []
        for rank, pid in sorted(pids.items()):
            on = [gpu for gpu in gpus if pid in gpu[4]]
            if on:
                index, busy, _, total, processes = on[0]
                found.append(GpuUsage(rank, index, busy, processes[pid], total, own_memory=True))
                continue
            if rank < len(self._visible):  # local rank r computes on the r-th visible GPU
                for index, busy, used, total, _ in gpus:
                    if index == self._visible[rank]:
                        found.append(GpuUsage(rank, index, busy, used, total, own_memory=False))
        return found

    def _processes(self, handle: ctypes.c_void_p) -> dict[int, int]:
        get = getattr(self._nvml, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        if get is None:
            return {}
        count = ctypes.c_uint(0)
        code = get(handle, ctypes.byref(count), None)
        if code == _SUCCESS:
            return {}
        if code != _INSUFFICIENT_SIZE:
            return {}
        count.value = count.value * 2 + 4  # room for processes that start meanwhile
        table = (_Process * count.value)()
        if get(handle, ctypes.byref(count), table) != _SUCCESS:
            return {}
        return {table[i].pid: table[i].usedGpuMemory for i in range(count.value)}
