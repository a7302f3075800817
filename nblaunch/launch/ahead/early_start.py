"""What nblaunch starts when a notebook imports it: where a GPU is, the launch server, before a
launch needs it.

In a notebook on a machine with a GPU, the kernel is likely to start CUDA (``torch.cuda.
is_available()`` is enough), and every launch after that takes its ranks from the launch server.
Started by that first launch, the server would make it wait for its ``import torch``, and the
ranks for ``torch._dynamo``: seconds. So ``import nblaunch`` in an IPython kernel on Linux starts
it on a thread of its own (NVML is asked there whether a GPU is), with its warm-up: by the time
the first launch comes, its ranks find torch, torch._dynamo and the kernel's libraries loaded.
Nowhere else: a script launches at once, and a CPU machine forks its ranks from the kernel.
``NBLAUNCH_PRELOAD=0`` leaves the server to the first launch that needs it.
"""

from __future__ import annotations

import sys
import threading

from nblaunch.facts.cuda import cuda_initialized
from nblaunch.launch.planning.devices import cuda_device_count
from nblaunch.launch.ahead.launch_server import launch_server
from nblaunch.launch.ahead.ledger import enabled


_thread: threading.Thread | None = None


def start_early() -> None:
    """In a notebook: start the launch server in the background where a launch could soon need
    it (see the module). Cheap: the checks that cost run on the thread."""
    global _thread
    shell = _kernel()
    if not sys.platform.startswith("linux") or not enabled() or shell is None:
        return
    _thread = threading.Thread(target=_start, name="nblaunch-early-start", daemon=True)
    _thread.start()


def wait_started(timeout: float | None) -> None:
    """Wait until the early start has started the server (or decided not to)."""
    if _thread is not None:
        _thread.join(timeout)


def _kernel() -> object | None:
    """The IPython shell this process runs cells for, or None (a script launches at once)."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return None if get_ipython is None else get_ipython()


def _start() -> None:
    try:
        if cuda_device_count() or cuda_initialized():
            launch_server().warm_up_soon()
    except Exception:  # noqa: BLE001  an optimisation only: the first launch that needs it starts it
        pass
