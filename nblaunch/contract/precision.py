"""``mixed_precision``'s one vocabulary, for every side that reads it: ``notebook_launcher``,
``nblaunch launch`` and Accelerate config files, ``WarmRanks``, the ``Accelerator`` and
``AcceleratorState`` in the ranks. They accept and refuse the same words.

The words are Accelerate's (``PrecisionType``: no, fp8, fp16, bf16), in any case, a few
spellings people type for them (``bfloat16``, ``float16``, ``half``, ``fp32``, ``none``), and
``auto``: the precision the device computes fast (:func:`fast_precision`), decided where the
device is known (the launcher's plan, or an ``Accelerator`` made outside a launch).
Whether a word can *run* is another matter, decided where it runs: nblaunch's own
``Accelerator`` has no fp8 (Accelerate's does, on GPUs with an fp8 backend), and TPUs have no fp16.

Example::

    >>> parse_precision("BFloat16")
    'bf16'
    >>> precision_from_environ({"NBLAUNCH_MIXED_PRECISION": "fp16"})
    'fp16'
"""

from __future__ import annotations

import enum
import functools
import os
from typing import Any, Mapping

from nblaunch.contract.variables import ACCELERATE_MIXED_PRECISION, MIXED_PRECISION

__all__ = ["ListedEnum", "PrecisionType", "AUTO", "PRECISIONS", "parse_precision", "precision_from_environ",
           "fast_precision", "cpu_computes_bf16", "BF16_HARDWARE", "FP8_HARDWARE", "FP8_EMULATED_ON_CPU"]


class ListedEnum(str, enum.Enum):
    """An enum of strings with Accelerate's ``list()``: every value."""

    @classmethod
    def list(cls) -> list[str]:
        return [member.value for member in cls]


class PrecisionType(ListedEnum):
    """``mixed_precision`` values, as Accelerate names them (FP8 through torchao)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


AUTO = "auto"  # nblaunch's own word: the precision the device computes fast
# Every word, in the order messages list them.
PRECISIONS = (PrecisionType.NO.value, PrecisionType.FP16.value, PrecisionType.BF16.value, PrecisionType.FP8.value,
              AUTO)
BF16_HARDWARE = (8, 0)  # CUDA compute capability with bf16 in hardware (Ampere); a T4 is (7, 5)
FP8_HARDWARE = (8, 9)  # the first with fp8 tensor cores (Ada, Hopper): fp8 is fast from here on
# What the launcher and every rank say where fp8 runs on the CPU.
FP8_EMULATED_ON_CPU = ("mixed_precision='fp8' on the CPU: torchao emulates the float8 matmuls, which trains as on an "
                       "fp8 GPU and is no faster (fp8 is fast on GPUs of compute capability 8.9 and later)")
_ALIASES = {"none": "no", "fp32": "no", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


def parse_precision(value: Any, source: str = "mixed_precision") -> str:
    """``value`` as one of ``PRECISIONS``; ``ValueError`` naming ``source`` and the choices for
    any other word (Accelerate's ``PrecisionType`` members are words too)."""
    word = _ALIASES.get(value.strip().lower(), value.strip().lower()) if isinstance(value, str) else None
    if word not in PRECISIONS:
        raise ValueError(f"{source} must be one of {', '.join(PRECISIONS)} (or bfloat16, float16, half, fp32, "
                         f"none), got {value!r}")
    return word


def fast_precision(device_kind: str, capability: tuple[int, int] | None = None) -> str:
    """What ``mixed_precision="auto"`` is on a device: bf16 where the hardware computes it (TPUs,
    GPUs of compute capability 8.0 and later: A100, H100, L4, RTX 30xx on; CPUs with AMX or
    AVX-512 BF16), fp16 on older GPUs (a T4, 7.5, has fast fp16 and emulates bf16 slowly), none
    on other CPUs (``capability``: the GPU's, None elsewhere).

    Example::

        >>> fast_precision("cuda", (7, 5)), fast_precision("cuda", (9, 0))
        ('fp16', 'bf16')
    """
    if device_kind == "xla":
        return PrecisionType.BF16.value
    if device_kind == "cuda":
        fast_bf16 = capability is not None and tuple(capability) >= BF16_HARDWARE
        return PrecisionType.BF16.value if fast_bf16 else PrecisionType.FP16.value
    return PrecisionType.BF16.value if cpu_computes_bf16() else PrecisionType.NO.value


@functools.lru_cache(maxsize=1)
def cpu_computes_bf16() -> bool:
    """Whether this machine's CPU computes bf16 in hardware (AMX or AVX-512 BF16: recent Xeon
    and EPYC); elsewhere bf16 on the CPU is emulated, slower than float32."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = set(cpuinfo.read().split())
    except OSError:  # not Linux
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def precision_from_environ(environ: Mapping[str, str] | None = None) -> str:
    """The launch's mixed precision as a rank sees it: ``NBLAUNCH_MIXED_PRECISION``, else
    Accelerate's ``ACCELERATE_MIXED_PRECISION`` (set by its launchers), else ``"no"``."""
    environ = os.environ if environ is None else environ
    for name in (MIXED_PRECISION, ACCELERATE_MIXED_PRECISION):
        if environ.get(name):
            return parse_precision(environ[name], source=name)
    return "no"
