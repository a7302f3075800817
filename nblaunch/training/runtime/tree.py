"""Walking nested structures of tensors (tuples, lists, namedtuples, mappings): applying a
function to every tensor, moving them to a device, concatenating equally-shaped structures.

A leaf module: it imports torch only, so every other part of ``nblaunch.training`` can use it.

Example::

    from nblaunch.training.runtime.tree import send_to_device
    batch = send_to_device({"x": x, "y": (y, mask)}, torch.device("cuda", 0))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["recursively_apply", "send_to_device", "concatenate"]


def recursively_apply(function: Callable[[Any], Any], data: Any, leaf: type = torch.Tensor) -> Any:
    """Apply ``function`` to every ``leaf`` (a tensor) in a nested tuple/list/mapping; other
    leaves are kept. Mappings include ``transformers``' ``BatchEncoding`` (not a dict)."""
    if isinstance(data, leaf):
        return function(data)
    if isinstance(data, (tuple, list)):
        items = [recursively_apply(function, d, leaf) for d in data]
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, Mapping):
        items = {k: recursively_apply(function, v, leaf) for k, v in data.items()}
        try:
            return type(data)(items)
        except TypeError:
            return items
    return data


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in ``data`` to ``device``."""
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


def concatenate(parts: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of equally-structured nested tensors."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=dim)
    if isinstance(first, (tuple, list)):
        items = [concatenate([p[i] for p in parts], dim) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)  # namedtuple
    if isinstance(first, Mapping):
        items = {k: concatenate([p[k] for p in parts], dim) for k in first}
        try:
            return type(first)(items)
        except TypeError:
            return items
    raise TypeError(f"cannot concatenate {type(first).__name__}")
