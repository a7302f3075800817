"""The ``Accelerator``'s collectives and per-process helpers (Accelerate's names), a group of
methods of :class:`~nblaunch.training.accelerator.core.Accelerator`: it reads ``state``,
``device``, ``num_processes`` and ``gradient_state``, as
:class:`~nblaunch.training.accelerator.host.AcceleratorHost` declares them.

Example::

    predictions = accelerator.gather_for_metrics(model(batch))   # the dataset exactly, once
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nblaunch.training.accelerator.host import AcceleratorHost
from nblaunch.training.runtime import collectives
from nblaunch.training.runtime.tree import recursively_apply

__all__ = ["CollectiveMethods"]


class CollectiveMethods(AcceleratorHost):
    """Gathering, reducing, broadcasting; main-process helpers; the early-stop trigger (the
    barrier, ``wait_for_everyone``, is the host's: every group uses it)."""

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors of all processes along dim 0 (see :func:`collectives.gather`)."""
        return collectives.gather(tensor)

    def gather_object(self, obj: Any) -> list:
        return collectives.gather_object(obj)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: the samples repeated to even out the last round are dropped,
        so over a whole prepared DataLoader the results match the dataset exactly.

        Tensors may differ in length along dim 0 between processes (``even_batches=False``).
        Non-tensor data (or ``use_gather_object=True``) goes through ``gather_object``. Where
        every rank read the same batches (tensor parallel over all ranks) it is returned as it is.
        """
        shards, _ = self._strategy.data_ranks(self.num_processes, self.process_index)
        if shards == 1:
            return input_data
        as_objects = use_gather_object or not _all_tensors(input_data)
        if as_objects:
            data = collectives.gather_object(input_data if isinstance(input_data, (list, tuple)) else [input_data])
        else:
            data = collectives.gather(input_data, allow_uneven_dim0=True)
        loader = self.gradient_state.active_dataloader
        if loader is not None and loader.end_of_dataloader and self.num_processes > 1:
            real = loader.remainder
            if real >= 0:
                data = data[:real] if as_objects else recursively_apply(lambda t: t[:real], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> Any:
        return collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        return collectives.broadcast(tensor, from_process)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        return self.state.split_between_processes(inputs, apply_padding)

    def main_process_first(self) -> Any:
        return self.state.main_process_first()

    def local_main_process_first(self) -> Any:
        return self.state.local_main_process_first()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.state.local_process_index == 0:
            print(*args, **kwargs)

    def on_main_process(self, function: Callable) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Any:
        return self.state.on_process(function, process_index)

    def set_trigger(self) -> None:
        """Raise a flag on this process; :meth:`check_trigger` tells every process (early stop)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger` (then lowered)."""
        flag = torch.tensor([1.0 if self._trigger else 0.0], device=self.device)
        flag = collectives.reduce(flag, "sum")
        if flag.item() > 0:
            self._trigger = False
            return True
        return False


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (tuple, list)):
        return len(data) > 0 and all(_all_tensors(d) for d in data)
    if isinstance(data, dict):
        return len(data) > 0 and all(_all_tensors(d) for d in data.values())
    return False
