"""Everything the training side does through torch_xla, in one place. torch_xla is imported
only when a function here is called, which happens only on XLA.

On XLA, ``notebook_launcher`` runs one *thread* per device, and several threads can share one
process. So nothing here reads a rank from the environment: ranks, devices and RNG states come
from ``torch_xla.runtime`` and belong to the calling thread. Collectives are XLA collectives
(``xm.all_gather``, ``xm.all_reduce``, ``xm.rendezvous``); as in Accelerate they run even with
one device.

Example (inside a function started with ``notebook_launcher(..., start_method="xla")``)::

    from nblaunch.training.runtime import xla
    rank = xla.rank_state()["process_index"]
    total = xla.all_reduce("SUM", torch.ones(1, device=xla.rank_state()["device"]))
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch

__all__ = ["rank_state", "sync", "barrier", "all_gather", "all_reduce", "broadcast_",
           "gather_objects", "broadcast_object", "reduce_gradients", "device_feeder",
           "get_rng_state", "set_rng_state"]


def _xm() -> Any:
    import torch_xla.core.xla_model as xm  # optional: torch_xla, installed on TPU hosts only
    return xm


def rank_state() -> dict[str, Any]:
    """The calling thread's rank: the fields :class:`~nblaunch.training.PartialState` needs.

    Example: with ``CPU_NUM_DEVICES=2`` the second device thread gets
    ``{"process_index": 1, "local_process_index": 1, "num_processes": 2, ..., "device": xla:1}``.
    """
    try:  # optional: torch_xla, installed on TPU hosts only
        import torch_xla
        import torch_xla.runtime as xr
    except ImportError as exc:
        raise RuntimeError(
            "XLA training was asked for (PJRT_DEVICE=TPU, NBLAUNCH_DISTRIBUTED_TYPE=XLA or an XLA "
            f"launch) but torch_xla cannot be imported: {exc}. Install torch_xla with the same "
            "version as torch, or unset those variables to train on CPU/CUDA.") from exc
    return {
        "process_index": xr.global_ordinal(),
        "local_process_index": xr.local_ordinal(),
        "num_processes": xr.world_size(),
        "num_local_processes": xr.local_device_count(),
        "device": torch_xla.device(),
    }


def sync() -> None:
    """Cut the lazy graph of this device and start running it (``torch_xla.sync()``)."""
    import torch_xla  # optional: torch_xla
    torch_xla.sync()


def barrier(tag: str) -> None:
    """Wait until every rank reaches the rendezvous ``tag``."""
    _xm().rendezvous(tag)


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on all), concatenated along dim 0 in rank order."""
    return _xm().all_gather(tensor, dim=0)


def all_reduce(op: str, tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor: ``op`` ("SUM", "MAX" or "MIN") of ``tensor`` over all ranks."""
    xm = _xm()
    return xm.all_reduce(getattr(xm, f"REDUCE_{op}"), tensor)


def broadcast_(tensor: torch.Tensor, from_process: int) -> torch.Tensor:
    """Overwrite ``tensor`` (in place) with rank ``from_process``'s values; returns it."""
    _xm().collective_broadcast([tensor], root_ordinal=from_process)
    return tensor


def gather_objects(obj: Any, tag: str = "nblaunch.gather_object") -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (one rendezvous)."""
    return [pickle.loads(payload) for payload in _xm().rendezvous(tag, pickle.dumps(obj))]


def broadcast_object(obj: Any, from_process: int) -> Any:
    """Rank ``from_process``'s picklable ``obj``, on every rank. The others send nothing."""
    xm = _xm()
    from torch_xla import runtime as xr  # optional: torch_xla
    payload = pickle.dumps(obj) if xr.global_ordinal() == from_process else b""
    return pickle.loads(xm.rendezvous("nblaunch.broadcast_object", payload)[from_process])


def reduce_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Average the optimizer's gradients over all ranks (nothing with one rank)."""
    _xm().reduce_gradients(optimizer)


def device_feeder(device: torch.device) -> Callable[[Any], Any]:
    """What a prepared DataLoader does with every batch on XLA (``MpDeviceLoader``'s two jobs,
    without its read-ahead threads): run the previous step's graph, then copy the batch to the
    device in one transfer.

    Example::

        feed = device_feeder(torch_xla.device())
        for batch in loader:
            batch = feed(batch)
    """
    xm = _xm()
    import torch_xla  # optional: torch_xla

    def feed(batch: Any) -> Any:
        torch_xla.sync()  # one graph per step, like MpDeviceLoader; it runs while we go on
        if isinstance(batch, torch.Tensor):
            return xm.send_cpu_data_to_device(batch, device)[0]
        return xm.send_cpu_data_to_device(batch, device)

    return feed


def get_rng_state(device: torch.device) -> int:
    """The XLA random seed of ``device`` (torch.manual_seed does not touch it)."""
    return _xm().get_rng_state(device)


def set_rng_state(seed: int, device: torch.device | None = None) -> None:
    """Seed the XLA RNG of ``device`` (default: the calling thread's device)."""
    _xm().set_rng_state(seed, device)
