"""Seeding and saving/restoring the random number generators of one process.

Example::

    from nblaunch.training import set_seed
    set_seed(42)                          # same seed on every rank
    set_seed(42, device_specific=True)    # 42 + rank: different dropout masks per rank

On XLA the device's own RNG (which ``torch.manual_seed`` does not reach) is seeded and saved too.
The CPU generators (``random``, NumPy, torch) belong to the process, which XLA device threads
share.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from nblaunch.training.runtime import xla
from nblaunch.training.runtime.environment import xla_requested
from nblaunch.training.runtime.state import PartialState

__all__ = ["set_seed", "get_rng_states", "set_rng_states"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (if imported or installed) and torch (CPU, CUDA, and
    the calling thread's XLA device when training on XLA).

    ``device_specific`` adds the process index to the seed. ``deterministic`` also asks torch
    for deterministic algorithms.
    """
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if xla_requested():
        xla.set_rng_state(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _numpy() -> Any:
    np = sys.modules.get("numpy")
    if np is None:
        try:
            import numpy as np  # type: ignore[no-redef]  # optional: numpy
        except ImportError:
            return None
    return np


def get_rng_states(device: torch.device | None = None) -> dict[str, Any]:
    """Every RNG state of this process (Python, NumPy, torch CPU, torch CUDA), and of ``device``
    if it is an XLA device."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        states["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if device is not None and device.type == "xla":
        states["xla"] = xla.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`get_rng_states` returned (the XLA state onto ``device``)."""
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    np = _numpy()
    if np is not None and "numpy" in states:
        np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda[min(torch.cuda.current_device(), len(cuda) - 1)])
    if "xla" in states and device is not None and device.type == "xla":
        xla.set_rng_state(states["xla"], device)
