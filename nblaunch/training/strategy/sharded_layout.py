"""A checkpoint's part for models sharded with FSDP2 (by the ``Sharded`` strategy or by the user's
own ``fully_shard``): every rank writes its shards through ``torch.distributed.checkpoint``,
in Accelerate's SHARDED_STATE_DICT layout::

    pytorch_model_fsdp_{i}/    model i's shards, keys "model.<name>"
    optimizer_{i}/             the shards of the optimizer i that trains a sharded model

Example::

    written = save(models, optimizers, "ckpt")     # collectives: every rank
    written.models                                   # {0}: model 0 was sharded
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from nblaunch.training.model.fsdp import is_sharded, load_sharded_state, sharded_state
from nblaunch.training.strategy.saved_by_strategy import SavedByStrategy

__all__ = ["save", "load", "sharded_model_dir", "sharded_optimizer_dir", "optimizer_owners", "owner_of"]


def sharded_model_dir(i: int) -> str:
    """A sharded (FSDP) model's ``torch.distributed.checkpoint`` folder; its keys are ``model.<name>``."""
    return f"pytorch_model_fsdp_{i}"


def sharded_optimizer_dir(i: int) -> str:
    """The folder of the optimizer of a sharded model; its keys are ``optimizer.state.<name>...``."""
    return f"optimizer_{i}"


def owner_of(models: list, optimizer: torch.optim.Optimizer, spread: Callable = is_sharded) -> torch.nn.Module | None:
    """The spread model whose parameters ``optimizer`` trains (None: it trains none); one over a
    spread model and other parameters is refused: its state is saved with that model's."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    found = None
    for model in models:
        mine = {id(p) for p in model.parameters()}
        if spread(model) and ids & mine:
            if found is not None or not ids <= mine:
                raise ValueError("an optimizer trains a sharded model together with other parameters (another "
                                 "model's): give each sharded model an optimizer of its own")
            found = model
    return found


def optimizer_owners(models: list, optimizers: list, spread: Callable = is_sharded) -> list[torch.nn.Module | None]:
    """For each prepared optimizer, the spread model it trains (None: it trains none)."""
    return [owner_of(models, opt.optimizer, spread) for opt in optimizers]


def save(models: list, optimizers: list, output_dir: str, spread: Callable = is_sharded) -> SavedByStrategy:
    """Every rank writes its shards of the spread models (``spread``: FSDP2's by default, tensor
    parallel ones too) and their optimizers (collectives)."""
    written = SavedByStrategy()
    owners = optimizer_owners(models, optimizers, spread)
    if not any(spread(m) for m in models):
        return written
    import torch.distributed.checkpoint as dcp  # deferred: ~50 ms to import, for sharded models only
    for i, model in enumerate(models):
        if spread(model):
            dcp.save({"model": sharded_state(model)}, checkpoint_id=os.path.join(output_dir, sharded_model_dir(i)))
            written.models.add(i)
    for i, (opt, model) in enumerate(zip(optimizers, owners)):
        if model is not None:
            dcp.save({"optimizer": sharded_state(model, opt.optimizer)},
                     checkpoint_id=os.path.join(output_dir, sharded_optimizer_dir(i)))
            written.optimizers.add(i)
    return written


def load(models: list, optimizers: list, input_dir: str, strict: bool, spread: Callable = is_sharded) -> SavedByStrategy:
    """Read back what :func:`save` wrote into the same models and optimizers."""
    written = SavedByStrategy()
    owners = optimizer_owners(models, optimizers, spread)
    if not any(spread(m) for m in models):
        return written
    import torch.distributed.checkpoint as dcp  # deferred: ~50 ms to import, for sharded models only
    for i, model in enumerate(models):
        if spread(model):
            path = os.path.join(input_dir, sharded_model_dir(i))
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"{input_dir!r} has no {os.path.basename(path)}/: it was saved from a model that was not "
                    "sharded (no fsdp_plugin, or Accelerate's FULL_STATE_DICT); load it the same "
                    "way, or save with state_dict_type SHARDED_STATE_DICT")
            state = {"model": sharded_state(model)}
            dcp.load(state, checkpoint_id=path)
            load_sharded_state(model, state["model"], strict=strict)
            written.models.add(i)
    for i, (opt, model) in enumerate(zip(optimizers, owners)):
        if model is not None:
            state = {"optimizer": sharded_state(model, opt.optimizer)}
            dcp.load(state, checkpoint_id=os.path.join(input_dir, sharded_optimizer_dir(i)))
            load_sharded_state(model, state["optimizer"], optimizer=opt.optimizer)
            written.optimizers.add(i)
    return written
