"""What the environment says about this process's part in training: the launch variables,
whether XLA is asked for, Accelerate's debug switch; and :class:`DistributedType`, Accelerate's
names for the kinds of training.

Example::

    from nblaunch.training.runtime.environment import xla_requested
    xla_requested()   # True inside an XLA launch, or with PJRT_DEVICE=TPU
"""

from __future__ import annotations

import enum
import os

from nblaunch.contract import variables as v

__all__ = ["DistributedType", "LAUNCH_VARIABLES", "env_int", "launch_key", "forces_cpu", "xla_requested",
           "uses_xla", "debug_mode"]

# The launch variables; a state built under other values (or in another pid) is stale.
LAUNCH_VARIABLES = (v.RANK, v.LOCAL_RANK, v.WORLD_SIZE, v.LOCAL_WORLD_SIZE, v.NODE_RANK, v.MASTER_ADDR, v.MASTER_PORT,
                    v.FORCE_CPU)
_FORCE_CPU_AT = 1 + LAUNCH_VARIABLES.index(v.FORCE_CPU)  # in the key, after the pid


class DistributedType(str, enum.Enum):
    """How this process takes part in training (the names Accelerate uses)."""

    NO = "NO"  # one process, no process group
    MULTI_CPU = "MULTI_CPU"  # several processes, gloo
    MULTI_GPU = "MULTI_GPU"  # several processes, one CUDA device each, nccl
    XLA = "XLA"  # XLA devices (TPU) through torch_xla, one thread per device
    # Never nblaunch's own state: here so that code comparing against them runs unchanged.
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    MEGATRON_LM = "MEGATRON_LM"


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def launch_key() -> tuple:
    """This process's pid and launch variables: a state built under another key is stale."""
    return (os.getpid(),) + tuple(os.environ.get(name) for name in LAUNCH_VARIABLES)


def xla_requested() -> bool:
    """True when this rank trains on XLA: inside an XLA launch (``NBLAUNCH_XLA=1``), or when
    asked for explicitly (``PJRT_DEVICE=TPU``, ``NBLAUNCH_DISTRIBUTED_TYPE=XLA``).

    torch_xla being installed is not enough, and ``PJRT_DEVICE=CPU`` alone is not a request.
    """
    environ = os.environ
    return (environ.get(v.XLA_LAUNCH) == "1"
            or environ.get(v.DISTRIBUTED_TYPE, "").upper() == "XLA"
            or environ.get(v.PJRT_DEVICE, "").upper() == "TPU")


def forces_cpu(key: tuple) -> bool:
    """True when ``key`` (a :func:`launch_key`) has ``NBLAUNCH_FORCE_CPU`` set (``debug_launcher``)."""
    return key[_FORCE_CPU_AT] not in (None, "", "0")


def uses_xla(cpu: bool) -> bool:
    """True when this rank trains on XLA, given the ``cpu`` it asks for (refused inside an XLA launch)."""
    if not xla_requested():
        return False
    if not cpu:
        return True
    if os.environ.get(v.XLA_LAUNCH) == "1":
        raise ValueError("cpu=True inside an XLA launch: every rank there is an XLA device. "
                         "Launch with start_method='fork' to train on the CPU.")
    return False  # asked for outside a launch: the CPU wins, as in Accelerate


def debug_mode() -> bool:
    """Accelerate's ``ACCELERATE_DEBUG_MODE`` (nblaunch's collectives check shapes always)."""
    return os.environ.get(v.ACCELERATE_DEBUG_MODE, "").strip().lower() in ("1", "true", "yes", "y", "on")
