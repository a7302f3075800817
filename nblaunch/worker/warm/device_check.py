"""Whether a warm rank's GPU still works after its call failed.

Some CUDA errors are sticky: after a device-side assert (an index out of range in a kernel), an
illegal address or a lost device, the process's CUDA context is gone for good and every later
CUDA call fails with the same error. A warm rank in that state would fail every cell after. So
after a call fails, a rank that has started CUDA checks its device with a tiny synchronising op
(milliseconds; only after a failure): an error there means the device is lost to this process,
and the pool ends rather than fail every cell (``warm/call_outcome``).

Example::

    lost = lost_device()    # "" where the device works or none is in use, else what CUDA said
"""

from __future__ import annotations

import sys


def lost_device() -> str:
    """What CUDA says when this rank's device is used now ("" where it works, or CUDA never started)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return ""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception as error:  # noqa: BLE001  any failure here is the answer
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return ""
