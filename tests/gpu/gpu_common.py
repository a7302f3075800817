"""What the GPU tests share: is there a CUDA device (asked without initialising CUDA here), did
this process initialise the CUDA driver, and the marks every GPU test carries.

The test process must never initialise CUDA itself: its launches fork their ranks, and a fork of a
process that initialised the driver cannot use CUDA. So the device is counted through NVML (what
nblaunch's planning does), never through ``torch.cuda.is_available()``, which calls
``cudaGetDeviceCount`` and so ``cuInit`` (torch's own note: it poisons later forks unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``).

Example::

    pytestmark = GPU_MARKS

    def test_something(record_property):
        ...
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

import nblaunch

CUDA_SUCCESS = 0  # before cuInit the driver answers CUDA_ERROR_NOT_INITIALIZED (3)


def cuda_skip_reason() -> str | None:
    """None where a CUDA device can be used; else one line saying why not."""
    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is built without CUDA"
    if nblaunch.gpu_count() == 0:
        return "no CUDA device: NVML sees no NVIDIA GPU (or CUDA_VISIBLE_DEVICES hides them)"
    return None


SKIP_REASON = cuda_skip_reason()
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]


def cuda_driver_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (``cuInit``), whether or not torch knows.

    ``torch.cuda.is_initialized()`` says only whether torch's lazy init ran; ``is_available()``
    runs ``cuInit`` and leaves it False. Before ``cuInit`` every driver call but a few answers
    ``CUDA_ERROR_NOT_INITIALIZED``; asking the device count initialises nothing. A driver that
    initialised with no device visible (``CUDA_VISIBLE_DEVICES=""``) counts as untouched.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return False  # the driver's library is not even loaded in this process
    count = ctypes.c_int(0)
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) == CUDA_SUCCESS and count.value > 0


# The same probe as source, for a notebook cell or a rank that cannot import this module.
DRIVER_PROBE_SOURCE = '''
def cuda_driver_initialised():
    import ctypes, os
    try:
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
'''


def cuda_state_here() -> dict[str, bool]:
    """torch's view and the driver's view of this process's CUDA."""
    return {"torch_initialised": torch.cuda.is_initialized(), "driver_initialised": cuda_driver_initialised()}
