"""Accelerate's helpers that look into a model (``accelerate.utils.modeling`` and ``other``):
what wraps it, which parameters are tied, how big each part is, and reading weight files.

Example::

    model.lm_head.weight = model.embed.weight
    find_tied_parameters(model)                 # [["embed.weight", "lm_head.weight"]]
    compute_module_sizes(model)[""]             # bytes of the whole model
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from typing import Any, Iterator

import torch

from nblaunch.training.model.unwrap import unwrap_model

__all__ = ["extract_model_from_parallel", "is_compiled_module", "has_compiled_regions", "model_has_dtensor",
           "find_tied_parameters", "retie_parameters", "id_tensor_storage", "named_module_tensors",
           "dtype_byte_size", "convert_file_size_to_int", "compute_module_sizes", "get_module_children_bottom_up",
           "load_state_dict", "is_peft_model"]


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (without importing torch._dynamo)."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether some submodule of ``module`` was compiled on its own."""
    return any(is_compiled_module(sub) for sub in module.modules())


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True, recursive: bool = False) -> torch.nn.Module:
    """The model out of DDP; ``torch.compile``'s wrapper kept around it (``keep_torch_compile``)
    or removed. ``recursive`` is accepted for Accelerate's signature: nblaunch wraps only the top."""
    if keep_torch_compile and is_compiled_module(model):
        model._orig_mod = unwrap_model(model._orig_mod, keep_fp32_wrapper)  # as Accelerate: the wrapper is kept
        return model
    return unwrap_model(model, keep_fp32_wrapper)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (peft's ``PeftModel``); False where peft is not imported."""
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported: never import it here
    return peft is not None and isinstance(model, peft.PeftModel)


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether some parameter is a ``DTensor`` (the model is sharded: FSDP2 or tensor parallel)."""
    from torch.distributed.tensor import DTensor  # deferred: torch.distributed's tensor package is heavy

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def find_tied_parameters(model: torch.nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that are one tensor (sorted names, one list per shared weight)."""
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of[id(parameter)].append(name)
    return [sorted(names) for names in names_of.values() if len(names) > 1]


def retie_parameters(model: torch.nn.Module, tied_params: list[list[str]]) -> None:
    """Make each group of ``tied_params`` one parameter again (the first one not on the meta device)."""
    for group in tied_params:
        owners = [_owner(model, name) for name in group]
        parameters = [getattr(module, attribute) for module, attribute in owners]
        keep = next((p for p in parameters if p.device != torch.device("meta")), parameters[0])
        for module, attribute in owners:
            setattr(module, attribute, keep)


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attribute


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, storage pointer, storage size): equal for tensors that share memory."""
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def named_module_tensors(module: torch.nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters, then (with ``include_buffers``) the buffers of ``module``; a buffer left
    out of the state dict is skipped with ``remove_non_persistent``."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        for name, buffer in module.named_buffers(recurse=recurse):
            path, _, attribute = name.rpartition(".")
            owner = module.get_submodule(path) if path else module
            if remove_non_persistent and attribute in owner._non_persistent_buffers_set:
                continue
            yield name, buffer


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element of ``dtype`` (1/8 for bool, as in a packed state)."""
    if dtype == torch.bool:
        return 1 / 8
    return torch.empty((), dtype=dtype).element_size()


_UNITS = {"KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40,
          "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in ``"5GB"`` (10**9 each) or ``"5GiB"`` (2**30 each); an int is returned as it is."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]I?B)\s*", size.upper())
    if match is None:
        raise ValueError(f"{size!r} is not a size: write it like '5GB', '500MiB' or as a number of bytes")
    value = int(float(match[1]) * _UNITS[match[2]])
    if match[2].endswith("B") and not match[2].endswith("IB") and size.strip()[-1] == "b":
        value //= 8  # '5Gb' is gigabits
    return value


def compute_module_sizes(model: torch.nn.Module, dtype: str | torch.dtype | None = None,
                         special_dtypes: dict[str, str | torch.dtype] | None = None,
                         buffers_only: bool = False) -> dict[str, int]:
    """Bytes of every submodule by name (``""`` is the whole model), counting each tensor in its
    own dtype, or in ``dtype`` (floating tensors only) and ``special_dtypes`` by tensor name."""
    as_dtype = getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype
    special = {name: getattr(torch, d.replace("torch.", "")) if isinstance(d, str) else d
               for name, d in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            size = tensor.numel() * dtype_byte_size(special[name])
        elif as_dtype is not None and tensor.is_floating_point():
            size = tensor.numel() * min(dtype_byte_size(as_dtype), dtype_byte_size(tensor.dtype))
        else:
            size = tensor.numel() * dtype_byte_size(tensor.dtype)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return dict(sizes)


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every submodule in post-order (each after its children, the model last); with
    ``return_fqns``, ``(name, module)`` pairs."""
    ordered: list[tuple[str, torch.nn.Module]] = []

    def visit(name: str, module: torch.nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        ordered.append((name, module))

    visit("", model)
    return ordered if return_fqns else [module for _, module in ordered]


def load_state_dict(checkpoint_file: str | os.PathLike, device_map: Any = None) -> dict[str, torch.Tensor]:
    """The tensors of a weights file on the CPU: ``.safetensors`` (needs safetensors) or a
    ``torch.save`` file (read with ``weights_only=True``). ``device_map`` is not supported here."""
    if device_map is not None:
        raise NotImplementedError("load_state_dict(device_map=...) is for big-model inference: use accelerate's")
    path = os.fspath(checkpoint_file)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file  # deferred: optional

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)
