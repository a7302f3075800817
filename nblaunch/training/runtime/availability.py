"""Accelerate's ``is_*_available`` checks, answered for nblaunch: which accelerators and
libraries this process can use. Nothing here starts a device or imports the libraries asked about.

Example::

    from nblaunch.utils import is_bf16_available
    mixed_precision = "bf16" if is_bf16_available() else "no"
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["is_bf16_available", "is_fp16_available", "is_cuda_available", "is_mps_available", "is_xpu_available",
           "is_npu_available", "is_mlu_available", "is_hpu_available", "is_torch_xla_available",
           "is_datasets_available", "is_transformers_available", "is_pytest_available", "is_tqdm_available"]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 compute on this machine's accelerator (CUDA with bf16), or on the CPU."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    return True  # on the CPU as well (with a GradScaler, as on CUDA)


def is_mps_available(min_version: str = "1.12") -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def is_xpu_available(check_device: bool = False) -> bool:
    return bool(getattr(torch, "xpu", None) and torch.xpu.is_available())


def is_npu_available(check_device: bool = False) -> bool:
    return False  # nblaunch does not drive Ascend NPUs


def is_mlu_available(check_device: bool = False) -> bool:
    return False


def is_hpu_available(init_hccl: bool = False) -> bool:
    return False


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return _installed("torch_xla")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_pytest_available() -> bool:
    return _installed("pytest")


def is_tqdm_available() -> bool:
    return _installed("tqdm")
