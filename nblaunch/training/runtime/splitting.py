"""``split_between_processes``: each process's share of a collection of inputs."""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["split_inputs"]


def split_inputs(inputs: Any, index: int, count: int, apply_padding: bool) -> Any:
    """Process ``index`` of ``count``'s contiguous share of ``inputs`` (a list, tuple, tensor,
    ``datasets.Dataset``, or a dict of those): the first ``len % count`` get one item more; with
    ``apply_padding`` the others repeat the last item of all, as Accelerate does.

    Example::

        split_inputs(["a", "b", "c"], 1, 2, apply_padding=True)   # ["c", "c"]
    """
    if isinstance(inputs, dict):
        return {k: split_inputs(v, index, count, apply_padding) for k, v in inputs.items()}
    length = len(inputs)
    per, extra = divmod(length, count)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    missing = (per + (1 if extra else 0)) - (end - start) if apply_padding and length else 0
    datasets = sys.modules.get("datasets")
    if datasets is not None and isinstance(inputs, datasets.Dataset):
        # Slicing a datasets.Dataset gives a dict of columns; select keeps it a Dataset.
        return inputs.select(list(range(start, end)) + [length - 1] * missing)
    part = inputs[start:end]
    if missing:  # padded with the last item of all, as Accelerate does
        if isinstance(part, torch.Tensor):
            part = torch.cat([part, inputs[-1:].expand(missing, *inputs.shape[1:])])
        else:
            part = part + type(part)(inputs[-1:]) * missing
    return part
