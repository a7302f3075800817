"""Moving prepared models and optimizers to a device without breaking what ties them together
(tied weights, an optimizer made before the move): needed on XLA, where a move makes new
``Parameter`` objects."""

from __future__ import annotations

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


def moved_parameters(before: list[dict[str, torch.nn.Parameter]],
                      after: list[torch.nn.Module]) -> dict[int, torch.nn.Parameter]:
    """``id(old parameter) -> new parameter`` for models whose parameters were replaced.

    Moving a model to an XLA device makes new ``Parameter`` objects (a CPU and an XLA tensor
    cannot share one), so an optimizer made before still points at the CPU ones.
    """
    moved = {}
    for old, model in zip(before, after):
        new = dict(model.named_parameters())
        for name, param in old.items():
            if name in new and new[name] is not param:
                moved[id(param)] = new[name]
    return moved


def switch_parameters(optimizer: torch.optim.Optimizer, moved: dict[int, torch.nn.Parameter]) -> None:
    """Point ``optimizer`` (its groups and its state) at the moved parameters.

    Example::

        moved = moved_parameters([dict(model.named_parameters())], [model.to(xla_device)])
        switch_parameters(optimizer, moved)
    """
    if not moved:
        return
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in moved]:
        optimizer.state[moved[id(old)]] = optimizer.state.pop(old)


def check_on_xla(optimizer: torch.optim.Optimizer) -> None:
    stray = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p.device.type != "xla"]
    if stray:
        raise ValueError(
            f"the optimizer holds {len(stray)} parameter(s) that are not on the XLA device (shapes "
            f"{stray[:3]}): moving a model to XLA makes new parameters. Prepare the model and its "
            "optimizer in one call, accelerator.prepare(model, optimizer, ...), or create the "
            "optimizer after preparing the model.")
