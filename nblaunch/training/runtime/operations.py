"""Accelerate's ``accelerate.utils.operations`` helpers on nested tensors (tuples, lists,
namedtuples, mappings) that ``tree`` does not already hold: batch sizes, fp32 outputs, shapes
to rebuild a structure elsewhere, slices, padding a batch for every process.

Example::

    find_batch_size({"input_ids": ids, "mask": mask})      # ids.shape[0]
    listify({"loss": torch.tensor(0.5)})                    # {"loss": 0.5}
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from nblaunch.training.runtime.tree import recursively_apply

__all__ = ["TensorInformation", "is_torch_tensor", "is_tensor_information", "is_namedtuple", "honor_type",
           "find_batch_size", "ignorant_find_batch_size", "listify", "convert_to_fp32", "convert_outputs_to_fp32",
           "get_data_structure", "initialize_tensors", "slice_tensors", "pad_input_tensors", "find_device"]


@dataclass
class TensorInformation:
    """A tensor's shape and dtype, what is needed to make room for it elsewhere."""

    shape: torch.Size
    dtype: torch.dtype


def is_torch_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def is_tensor_information(value: Any) -> bool:
    return isinstance(value, TensorInformation)


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields") and hasattr(value, "_asdict")


def honor_type(like: Any, items: Iterable[Any]) -> Any:
    """``items`` as the sequence type of ``like`` (list, tuple or that namedtuple)."""
    return type(like)(*items) if is_namedtuple(like) else type(like)(items)


def find_batch_size(data: Any) -> int:
    """The size of the first dimension of the first tensor found in ``data``.

    Raises ``ValueError`` for an empty structure and ``TypeError`` where there is no tensor.
    """
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"cannot find the batch size of a {type(data).__name__}: give tensors")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> int | None:
    """:func:`find_batch_size`, or None where it has no answer."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in ``data`` (None where there is none)."""
    if isinstance(data, torch.Tensor):
        return data.device
    items = data.values() if isinstance(data, Mapping) else data if isinstance(data, (tuple, list)) else ()
    for item in items:
        device = find_device(item)
        if device is not None:
            return device
    return None


def listify(data: Any) -> Any:
    """Every tensor in ``data`` as Python numbers (a number, or nested lists of them)."""
    return recursively_apply(lambda t: t.detach().cpu().tolist(), data)


def convert_to_fp32(data: Any) -> Any:
    """Every fp16 or bf16 tensor in ``data`` as fp32; other tensors are left as they are."""
    return recursively_apply(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, data)


def convert_outputs_to_fp32(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` whose outputs come back in fp32 (as a prepared model's do under autocast)."""
    @functools.wraps(forward)
    def in_fp32(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(forward(*args, **kwargs))

    return in_fp32


def get_data_structure(data: Any) -> Any:
    """``data`` with each tensor replaced by its :class:`TensorInformation`."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(structure: Any) -> Any:
    """Empty tensors in place of each :class:`TensorInformation` of ``structure``."""
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), structure,
                             leaf=TensorInformation)


def slice_tensors(data: Any, tensor_slice: slice, process_index: int | None = None,
                  num_processes: int | None = None) -> Any:
    """``tensor[tensor_slice]`` for every tensor in ``data``."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def pad_input_tensors(data: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Every tensor of ``data`` (``batch_size`` long along ``dim``) padded with zeros to the next
    multiple of ``num_processes``, so a batch splits evenly (Accelerate's rule gives a length that
    does not divide for some sizes, 10 on 3 processes: 11).

    Example::

        pad_input_tensors(torch.arange(1, 4), batch_size=3, num_processes=2)    # tensor([1, 2, 3, 0])
    """
    padded_length = -(-batch_size // num_processes) * num_processes  # rounded up

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[dim] != batch_size or padded_length == batch_size:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = padded_length - batch_size
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)

    return recursively_apply(pad, data)
