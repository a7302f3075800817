"""Whether this process has started CUDA, and so must not fork (a forked child's CUDA is broken).

Asked by the launcher before it forks ranks, and by every process of the launch server after
each import it makes ahead of the ranks (an import that starts CUDA would break every rank forked
after it). Neither question starts CUDA or loads the driver.

Example::

    import torch; torch.cuda.is_available()   # starts the driver (unless the NVML check is asked for)
    cuda_initialized()                        # True
"""

from __future__ import annotations

import ctypes
import os
import sys

_CUDA_SUCCESS = 0  # cuDeviceGetCount before cuInit: CUDA_ERROR_NOT_INITIALIZED (3)


def cuda_initialized() -> bool:
    """True if this process has already initialised CUDA (so it must not fork): torch's CUDA,
    or only the driver, which ``torch.cuda.is_available()`` initialises without saying so."""
    torch = sys.modules.get("torch")  # not imported means not initialised
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized()) or driver_initialized()


def driver_initialized() -> bool:
    """Whether the CUDA driver is loaded in this process and initialised (cuInit has run)."""
    try:  # RTLD_NOLOAD: only a library this process already loaded; never loads the driver
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuDeviceGetCount(ctypes.byref(count)) == _CUDA_SUCCESS
