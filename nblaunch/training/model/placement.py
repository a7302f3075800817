"""Moving prepared models and optimizers to a device without breaking what ties them together
(tied weights, an optimizer made before the move): needed on XLA, where a move makes new
``Parameter`` objects."""

from __future__ import annotations

import weakref

import torch


def move_keeping_ties(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to(device)``, with parameters shared between modules still shared afterwards.

    Moving to XLA makes a new ``Parameter`` per place a tensor is used, so tied weights (an
    embedding and its output layer) would train apart.
    """
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            places.setdefault(id(param), []).append((module, name))
    model = model.to(device)
    for shared in places.values():
        first_module, first_name = shared[0]
        for module, name in shared[1:]:
            setattr(module, name, getattr(first_module, first_name))
    return model


class ReplacedParameters:
    """Which parameters preparing models replaced (moving to XLA, sharding with FSDP2), so that
    an optimizer made on the old ones can be pointed at the new ones.

    Parameters are held weakly: the record keeps neither the old ones nor the new ones alive.

    Example::

        replaced = ReplacedParameters()
        before = dict(model.named_parameters())
        model = model.to(xla_device)
        replaced.record(before, model)
        replaced.switch(optimizer)          # its groups and state now hold the moved parameters
    """

    def __init__(self) -> None:
        self._new: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def record(self, before: dict[str, torch.nn.Parameter], model: torch.nn.Module) -> None:
        after = dict(model.named_parameters())
        for name, old in before.items():
            new = after.get(name)
            if new is not None and new is not old:
                self._new[id(old)] = (weakref.ref(old), weakref.ref(new))

    def _replacement(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The parameter that replaced ``param``, or ``param`` itself."""
        entry = self._new.get(id(param))
        new = entry[1]() if entry is not None and entry[0]() is param else None
        return param if new is None else new

    def clear(self) -> None:
        self._new.clear()

    def switch(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer``'s groups and state at the new parameters."""
        if not self._new:
            return
        moved_state = [(old, self._replacement(old)) for old in optimizer.state]
        moved_state = [(old, new) for old, new in moved_state if new is not old]
        if any(_is_shard(new) for _, new in moved_state):  # refused before anything is changed
            raise ValueError(
                "the optimizer has already stepped on the model's unsharded parameters: its state "
                "cannot follow them into shards. Prepare the model before training, and its "
                "optimizer with it: accelerator.prepare(model, optimizer, ...)")
        for group in optimizer.param_groups:
            group["params"] = [self._replacement(p) for p in group["params"]]
        for old, new in moved_state:
            optimizer.state[new] = optimizer.state.pop(old)


def _is_shard(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor  # deferred: public from torch 2.5, and only FSDP2 makes them
    return isinstance(param, DTensor)


def check_on_xla(optimizer: torch.optim.Optimizer) -> None:
    stray = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p.device.type != "xla"]
    if stray:
        raise ValueError(
            f"the optimizer holds {len(stray)} parameter(s) that are not on the XLA device (shapes "
            f"{stray[:3]}): moving a model to XLA makes new parameters. Prepare the model and its "
            "optimizer in one call, accelerator.prepare(model, optimizer, ...), or create the "
            "optimizer after preparing the model.")
