"""Accelerate's ``is_*_available`` checks, answered for nblaunch: which accelerators and
libraries this process can use. Nothing here starts a device or imports the libraries asked about.

Example::

    from nblaunch.utils import is_bf16_available
    is_bf16_available()   # True on a T4 too, where bf16 is emulated (as Accelerate says);
                          # mixed_precision="auto" picks what each device computes fast
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import operator
from typing import Any

import torch
from torch.torch_version import TorchVersion

__all__ = ["is_bf16_available", "is_fp16_available", "is_fp8_available", "is_cuda_available", "is_mps_available",
           "is_xpu_available", "is_npu_available", "is_mlu_available", "is_hpu_available", "is_torch_xla_available",
           "is_datasets_available", "is_transformers_available", "is_pytest_available", "is_tqdm_available",
           "is_tensorboard_available", "is_wandb_available", "is_mlflow_available", "is_trackio_available",
           "is_comet_ml_available", "is_aim_available", "is_clearml_available", "is_dvclive_available",
           "is_swanlab_available", "is_pandas_available", "is_matplotlib_available", "is_rich_available",
           "is_timm_available", "is_torchvision_available", "is_peft_available", "is_boto3_available",
           "is_safetensors_available", "is_pynvml_available", "is_triton_available", "is_torchdata_available",
           "is_deepspeed_available", "is_bnb_available", "is_torch_version", "compare_versions",
           "is_rocm_available", "is_musa_available", "is_sdaa_available", "is_neuron_available", "is_habana_gaudi1",
           "is_weights_only_available", "is_torchdata_stateful_dataloader_available", "is_schedulefree_available",
           "is_lomo_available", "is_pippy_available", "is_torchao_available", "get_torch_accelerator_backend"]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


_NATIVE = {"cuda": is_cuda_available, "mps": lambda: is_mps_available(), "xpu": lambda: is_xpu_available()}


def get_torch_accelerator_backend(check_available: bool = True) -> tuple[str | None, Any]:
    """The accelerator this machine computes on and torch's module for it (Accelerate's name):
    ``("cuda", torch.cuda)``, ``("mps", torch.mps)``, ``("xpu", torch.xpu)``, another kind with
    ``torch.accelerator``; ``(None, None)`` where there is none. ``check_available=False`` names
    the kind this torch is built for without asking whether a device is there.

    Example::

        device_type, module = get_torch_accelerator_backend()   # (None, None) on a CPU machine
    """
    try:
        device = torch.accelerator.current_accelerator()
    except RuntimeError:  # torch 2.6 raises where a CPU-only build has none; later ones return None
        device = None
    if device is None:
        return None, None
    available = _NATIVE.get(device.type, torch.accelerator.is_available)
    if check_available and not available():
        return None, None
    return device.type, torch.get_device_module(device.type) if device.type in _NATIVE else torch.accelerator


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 compute on this machine's accelerator (CUDA with bf16, emulated counts: Accelerate's
    answer), or on the CPU. For the precision a device computes fast, use mixed_precision="auto"."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    return True  # on the CPU as well (with a GradScaler, as on CUDA)


def is_fp8_available() -> bool:
    """Whether ``mixed_precision="fp8"`` can train here: torchao, its one backend in nblaunch, is installed."""
    return is_torchao_available()


def is_torchao_available() -> bool:
    """Whether torchao is installed (``mixed_precision="fp8"`` trains through it)."""
    return _installed("torchao")


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


def is_musa_available(check_device: bool = False) -> bool:
    return False


def is_sdaa_available(check_device: bool = False) -> bool:
    return False


def is_neuron_available(check_device: bool = False) -> bool:
    return False


def is_habana_gaudi1() -> bool:
    return False


def is_rocm_available() -> bool:
    """Whether this torch is built for AMD GPUs (ROCm); they are driven as CUDA devices."""
    return torch.version.hip is not None


def is_weights_only_available() -> bool:
    return True  # torch.load(weights_only=True): every torch nblaunch supports has it


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


# Libraries that are only asked "is it installed?" (none is imported here).
def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_trackio_available() -> bool:
    return _installed("trackio")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml")


def is_aim_available() -> bool:
    return _installed("aim")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_swanlab_available() -> bool:
    return _installed("swanlab")


def is_pandas_available() -> bool:
    return _installed("pandas")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")


def is_rich_available() -> bool:
    return _installed("rich")


def is_timm_available() -> bool:
    return _installed("timm")


def is_torchvision_available() -> bool:
    return _installed("torchvision")


def is_peft_available() -> bool:
    return _installed("peft")


def is_boto3_available() -> bool:
    return _installed("boto3")


def is_safetensors_available() -> bool:
    return _installed("safetensors")


def is_pynvml_available() -> bool:
    return _installed("pynvml")


def is_triton_available() -> bool:
    return _installed("triton")


def is_torchdata_available() -> bool:
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    return _installed("torchdata") and importlib.util.find_spec("torchdata.stateful_dataloader") is not None


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_lomo_available() -> bool:
    return _installed("lomo_optim")


def is_pippy_available() -> bool:
    return True  # pipelining ships with torch (torch.distributed.pipelining)


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (``Accelerator(deepspeed_plugin=...)`` needs it)."""
    return _installed("deepspeed")


def is_bnb_available(min_version: str | None = None) -> bool:
    return _installed("bitsandbytes") and (min_version is None or compare_versions("bitsandbytes", ">=", min_version))


_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
               "<": operator.lt}


def compare_versions(library_or_version: str | TorchVersion, operation: str, requirement_version: str) -> bool:
    """Compare an installed library's version (by its distribution name) or a version string
    with ``requirement_version``.

    Example::

        compare_versions("torch", ">=", "2.9")      # True here
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {', '.join(_OPERATIONS)}, got {operation!r}")
    version = library_or_version
    if isinstance(version, str) and not version[:1].isdigit():
        version = importlib.metadata.version(version)
    return _OPERATIONS[operation](TorchVersion(str(version)), requirement_version)


def is_torch_version(operation: str, version: str) -> bool:
    """``is_torch_version(">=", "2.9")``: compare the running torch with ``version``."""
    return compare_versions(torch.__version__, operation, version)
