"""Collectives over tensors and nested structures of tensors (tuples, lists, dicts).

Every function works with one process too (then it returns its input, as Accelerate does).
On XLA every collective goes through XLA (``nblaunch.training.runtime.xla``), with one device too.
Gathers, reduces and broadcasts first exchange the shapes (one small all_gather; Accelerate does
this only in its debug mode), so tensors of different shapes on different ranks raise the same
clear ``ShapeMismatchError`` on every rank, naming each rank's shape, instead of aborting inside
gloo, hanging, or (a broadcast) silently copying the wrong bytes.

Example::

    from nblaunch.training.runtime import collectives
    predictions = ops.gather(logits.argmax(-1))   # every rank gets all ranks' predictions
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from nblaunch.training.runtime import xla
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.runtime.tree import recursively_apply
from nblaunch.worker import step_clock

__all__ = ["gather", "gather_object", "reduce", "pad_across_processes", "broadcast", "copy_tensor_to_devices",
           "broadcast_object_list", "synchronize_rng_state", "synchronize_rng_states", "DistributedOperationException",
           "ShapeMismatchError", "CannotPadNestedTensorWarning"]

_MAX_DIMS = 8  # the shape header holds this many dimensions
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


class DistributedOperationException(Exception):
    """A collective was called with inputs that differ between ranks (Accelerate's name)."""


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested tensor and left it as it was."""


class ShapeMismatchError(DistributedOperationException, ValueError):
    """Tensors handed to a collective differ in shape or dtype between ranks."""


def _counted(kind: str) -> Callable:
    """Count the collective and time it as communication (``nblaunch.worker.step_clock``)."""
    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with step_clock.collective(kind):
                return function(*args, **kwargs)
        return counted
    return decorate


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.ndim > _MAX_DIMS:
        raise ValueError(f"gather supports tensors of up to {_MAX_DIMS} dimensions")
    values = [tensor.ndim, _DTYPE_CODE.get(tensor.dtype, -1)] + list(tensor.shape)
    values += [-1] * (_MAX_DIMS + 2 - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def _on_xla(state: PartialState) -> bool:
    return state.distributed_type is DistributedType.XLA


def _skip(state: PartialState) -> bool:
    """One process and no XLA: a collective would return its input unchanged."""
    return state.num_processes == 1 and not _on_xla(state)


def _all_gather(tensor: torch.Tensor, state: PartialState) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in rank order."""
    if _on_xla(state):
        return list(xla.all_gather(tensor).chunk(state.num_processes))
    parts = [torch.empty_like(tensor) for _ in range(state.num_processes)]
    dist.all_gather(parts, tensor)
    return parts


def _exchange_headers(tensor: torch.Tensor, state: PartialState) -> list[tuple[int, ...]]:
    """Every rank's (dtype, shape) of ``tensor``; one small all_gather, one read to the host."""
    headers = torch.stack(_all_gather(_header(tensor, state.device), state)).tolist()
    return [(values[1],) + tuple(values[2:2 + values[0]]) for values in headers]


def _describe(headers: list[tuple[int, ...]]) -> str:
    parts = []
    for rank, h in enumerate(headers):
        dtype = _DTYPES[h[0]] if 0 <= h[0] < len(_DTYPES) else "?"
        parts.append(f"rank {rank}: shape {tuple(h[1:])} {dtype}")
    return "; ".join(parts)


def _check_same(tensor: torch.Tensor, state: PartialState, operation: str) -> None:
    headers = _exchange_headers(tensor, state)
    if any(h != headers[0] for h in headers):
        raise ShapeMismatchError(
            f"{operation} needs tensors of the same shape and dtype on every process, got "
            f"{_describe(headers)}.")


def _gather_one(tensor: torch.Tensor, state: PartialState, allow_uneven_dim0: bool) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    tensor = tensor.contiguous()
    headers = _exchange_headers(tensor, state)
    first = headers[0]
    if all(h == first for h in headers):
        return torch.cat(_all_gather(tensor, state), dim=0)
    same_rest = all(h[0] == first[0] and h[2:] == first[2:] and len(h) == len(first)
                    for h in headers)
    if not (allow_uneven_dim0 and same_rest):
        raise ShapeMismatchError(
            "gather needs tensors of the same shape and dtype on every process, got "
            f"{_describe(headers)}. Use accelerator.pad_across_processes first, or "
            "gather_for_metrics (which accepts different lengths along dimension 0)."
        )
    # Different lengths along dim 0: pad to the longest, gather, cut each part back.
    lengths = [h[1] for h in headers]
    longest = max(lengths)
    padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = _all_gather(padded, state)
    return torch.cat([p[:n] for p, n in zip(parts, lengths)], dim=0)


@_counted('gather')
def gather(data: Any, *, allow_uneven_dim0: bool = False) -> Any:
    """Concatenate every process's tensors along dimension 0, on every process.

    0-d tensors become one element per process. Nested tuples/lists/dicts are gathered leaf by
    leaf. With one process the input is returned unchanged (on XLA it is gathered all the same).

    Example (2 processes)::

        gather(torch.tensor([rank]))   # tensor([0, 1]) on both
    """
    state = PartialState()
    if _skip(state):
        return data
    return recursively_apply(lambda t: _gather_one(t, state, allow_uneven_dim0), data)


@_counted('gather')
def gather_object(obj: Any) -> list:
    """Gather picklable objects from every process.

    A list (or tuple) from each process is flattened into one list in rank order; any other
    object gives a list with one entry per process. With one process ``obj`` is returned as is.
    """
    state = PartialState()
    if state.num_processes == 1:
        return obj
    if _on_xla(state):
        parts = xla.gather_objects(obj)
    else:
        parts = [None] * state.num_processes
        dist.all_gather_object(parts, obj)
    if isinstance(obj, (list, tuple)):
        return [item for part in parts for item in part]
    return parts


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


@_counted('reduce')
def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum, average, maximum or minimum (``"sum"``, ``"mean"``, ``"max"``, ``"min"``) of tensors
    over processes, element-wise; the input is not changed."""
    if reduction not in ("sum", "mean", "max", "min", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean', 'max', 'min' or 'none', not {reduction!r}")
    state = PartialState()

    def one(t: torch.Tensor) -> torch.Tensor:
        if reduction != "none" and _on_xla(state):
            out = xla.all_reduce(_REDUCE_OPS[reduction], t)
        else:
            out = t.clone()
            if state.num_processes > 1 and reduction != "none":
                _check_same(t, state, "reduce")
                dist.all_reduce(out, op=getattr(dist.ReduceOp, _REDUCE_OPS[reduction]))
        if reduction == "mean" and state.num_processes > 1:
            out /= state.num_processes
        if scale != 1.0:
            out *= scale
        return out

    return recursively_apply(one, data)


@_counted('gather')
def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad tensors along ``dim`` to the largest size over all processes (so they can be gathered)."""
    state = PartialState()
    if _skip(state):
        return data

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.is_nested:  # its parts have their own lengths: nothing to pad to, as in Accelerate
            warnings.warn("pad_across_processes leaves nested tensors as they are", CannotPadNestedTensorWarning,
                          stacklevel=4)
            return t
        if t.ndim == 0:
            return t
        d = dim if dim >= 0 else t.ndim + dim
        sizes = torch.tensor([t.ndim, t.shape[d] if d < t.ndim else -1], device=state.device)
        all_sizes = torch.stack(_all_gather(sizes, state)).tolist()  # one read to the host
        ndims = {s[0] for s in all_sizes}
        if len(ndims) != 1 or d >= t.ndim:
            raise ShapeMismatchError(
                f"pad_across_processes(dim={dim}) needs tensors with the same number of "
                f"dimensions on every process, got {sorted(ndims)}")
        longest = max(s[1] for s in all_sizes)
        if longest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = longest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.ndim
        index[d] = slice(longest - t.shape[d], longest) if pad_first else slice(0, t.shape[d])
        out[tuple(index)] = t
        return out

    return recursively_apply(one, data)


@_counted('broadcast')
def broadcast(data: Any, from_process: int = 0) -> Any:
    """Copy tensors of ``from_process`` into the same tensors on every process (in place)."""
    state = PartialState()
    if _skip(state):
        return data

    def one(t: torch.Tensor) -> torch.Tensor:
        if _on_xla(state):
            return xla.broadcast_(t, from_process)
        _check_same(t, state, "broadcast")
        dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(one, data)


@_counted('broadcast')
def broadcast_object_list(objects: list, from_process: int = 0) -> list:
    """Replace the items of ``objects`` by those of ``from_process`` (in place, picklable items)."""
    state = PartialState()
    if state.num_processes > 1 and _on_xla(state):
        objects[:] = xla.broadcast_object(list(objects), from_process)
    elif state.num_processes > 1:
        dist.broadcast_object_list(objects, src=from_process)
    return objects


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor that exactly one process holds (the others pass None), on every process; the
    others need not know its shape or dtype."""
    state = PartialState()
    if state.num_processes == 1:
        return tensor
    described = gather_object([None if tensor is None else (tuple(tensor.shape), tensor.dtype)])
    holders = [i for i, d in enumerate(described) if d is not None]
    if len(holders) != 1:
        raise ValueError(f"copy_tensor_to_devices needs the tensor on exactly one process, got {len(holders)}")
    shape, dtype = described[holders[0]]
    out = tensor.to(state.device) if tensor is not None else torch.zeros(shape, dtype=dtype, device=state.device)
    return broadcast(out, from_process=holders[0])


def synchronize_rng_state(rng_type: str | None = None, generator: torch.Generator | None = None) -> None:
    """:func:`synchronize_rng_states` for one RNG."""
    if rng_type is not None:
        synchronize_rng_states([rng_type], generator)


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """Give every process rank 0's state of each RNG in ``rng_types``: "torch" (CPU), "cuda"
    (this process's device), "generator" (``generator``), as Accelerate's function of that name.

    Example::

        synchronize_rng_states(["torch"])   # torch.rand(...) now draws the same on every rank
    """
    state = PartialState()
    if state.num_processes == 1:
        return
    for kind in rng_types:
        kind = getattr(kind, "value", kind)  # RNGType (ours or Accelerate's) or its string
        if kind == "torch":
            torch.set_rng_state(_rank0_rng_state(torch.get_rng_state(), state))
        elif kind == "cuda":
            if torch.cuda.is_available():  # the same answer on every rank of one launch
                torch.cuda.set_rng_state(_rank0_rng_state(torch.cuda.get_rng_state(), state))
        elif kind == "generator":
            if generator is None:
                raise ValueError("synchronize_rng_states(['generator']) needs generator=")
            generator.set_state(_rank0_rng_state(generator.get_state(), state))
        else:
            raise ValueError(f"rng type {kind!r}: nblaunch synchronises 'torch', 'cuda' and 'generator'")


def _rank0_rng_state(local: torch.Tensor, state: PartialState) -> torch.Tensor:
    """Rank 0's RNG state: one broadcast of the state's bytes, no pickling and no shape check (an
    RNG of one kind has a state of one size). A prepared DataLoader asks this every epoch, where
    broadcast_object_list's pickling and second round trip cost 4 ms against 0.7 ms. On XLA the
    state travels by rendezvous as before: its broadcast is an all-reduce, not made for bytes."""
    if _on_xla(state):
        return xla.broadcast_object(local, 0)
    shipped = local.to(state.device)
    dist.broadcast(shipped, src=0)
    return shipped.cpu()
