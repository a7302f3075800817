"""``save_state`` / ``load_state``: everything needed to resume a run where it stopped.

Layout of a checkpoint directory (files of the main process unless marked per rank)::

    model.bin, model_1.bin, ...          state dicts of the unwrapped models
    optimizer.bin, optimizer_1.bin, ...
    scheduler.bin, ...
    scaler.pt                            the fp16 GradScaler
    custom_checkpoint_0.pkl, ...         objects passed to register_for_checkpointing
    rank_{r}.pkl                         per rank: RNG states, data positions, accumulation step
    sharded_model/, sharded_optimizer/   a sharded (FSDP) model and its optimizer, instead of
                                         model.bin/optimizer.bin: every rank writes its shards
                                         through torch.distributed.checkpoint

The data position of every prepared DataLoader (epoch, shuffle seed, batches consumed) is
restored too, so the next ``for batch in loader`` continues the interrupted epoch exactly.

On XLA every rank first runs its pending graph (``torch_xla.sync()``), then the main rank copies
the tensors to the CPU and writes them (``xm.save``'s way), so a checkpoint loads without
torch_xla; the rank files also hold each device's XLA RNG seed.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from nblaunch.training.checkpoint.record import Prepared
from nblaunch.training.model.fsdp import is_sharded, load_sharded_state, sharded_model_of, sharded_state
from nblaunch.training.model.unwrap import unwrap_model
from nblaunch.training.runtime import xla
from nblaunch.training.runtime.seed import get_rng_states, set_rng_states
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.runtime.tree import recursively_apply

if TYPE_CHECKING:
    from nblaunch.training.step.gradient_state import GradientState

__all__ = ["save_state", "load_state", "host_saver"]


def _name(stem: str, i: int, ext: str) -> str:
    return f"{stem}.{ext}" if i == 0 else f"{stem}_{i}.{ext}"


def host_saver(state: PartialState) -> Callable[[Any, Any], None]:
    """``torch.save`` for this rank's tensors: on XLA it runs the pending graph of *this* rank
    (call it on every rank) and saves CPU copies; elsewhere it is ``torch.save``.

    Example::

        save = host_saver(accelerator.state)
        if accelerator.is_main_process:
            save(model.state_dict(), "model.bin")
    """
    if state.distributed_type is not DistributedType.XLA:
        return torch.save

    xla.sync()  # every rank: the main rank's copies below then run no collective alone

    def save(obj: Any, path: Any) -> None:
        torch.save(_cpu_copy(obj), path)

    return save


def _cpu_copy(data: Any) -> Any:
    """``data`` with every XLA tensor copied to the CPU (``xm.save``'s way). Every rank must have
    run :func:`~nblaunch.training.runtime.xla.sync` first, so no rank runs a graph with
    collectives alone."""
    return recursively_apply(lambda t: t.cpu() if t.device.type == "xla" else t, data)


def _sharded_dir(output_dir: str, stem: str, i: int) -> str:
    return os.path.join(output_dir, f"sharded_{stem}" if i == 0 else f"sharded_{stem}_{i}")


def _optimizer_owners(prepared: Prepared) -> list[torch.nn.Module | None]:
    """For each prepared optimizer, the sharded model it trains (None: it trains none)."""
    return [sharded_model_of(prepared.models, opt.optimizer) for opt in prepared.optimizers]


def _save_sharded(prepared: Prepared, output_dir: str, owners: list[torch.nn.Module | None]) -> None:
    """Every rank writes its shards of the sharded models and their optimizers (collectives)."""
    import torch.distributed.checkpoint as dcp  # deferred: ~50 ms to import, for sharded models only
    for i, model in enumerate(prepared.models):
        if is_sharded(model):
            dcp.save(sharded_state(model), checkpoint_id=_sharded_dir(output_dir, "model", i))
    for i, (opt, model) in enumerate(zip(prepared.optimizers, owners)):
        if model is not None:
            dcp.save(sharded_state(model, opt.optimizer), checkpoint_id=_sharded_dir(output_dir, "optimizer", i))


def _load_sharded(prepared: Prepared, input_dir: str, strict: bool, owners: list[torch.nn.Module | None]) -> None:
    import torch.distributed.checkpoint as dcp  # deferred: ~50 ms to import, for sharded models only
    for i, model in enumerate(prepared.models):
        if is_sharded(model):
            path = _sharded_dir(input_dir, "model", i)
            if not os.path.isdir(path):
                raise FileNotFoundError(f"{input_dir!r} has no {os.path.basename(path)}/: it was saved from a model "
                                        "that was not sharded (no fsdp_plugin, or one process); load it the same way")
            state = sharded_state(model)
            dcp.load(state, checkpoint_id=path)
            load_sharded_state(model, state, strict=strict)
    for i, (opt, model) in enumerate(zip(prepared.optimizers, owners)):
        if model is not None:
            state = sharded_state(model, opt.optimizer)
            dcp.load(state, checkpoint_id=_sharded_dir(input_dir, "optimizer", i))
            load_sharded_state(model, state, optimizer=opt.optimizer)


def save_state(prepared: Prepared, output_dir: str | os.PathLike, state: PartialState,
               gradient_state: GradientState) -> str:
    """Write ``prepared`` to ``output_dir`` (see the module docstring); call it on every rank.
    Returns the directory.

    Example (what ``Accelerator.save_state`` does)::

        save_state(record, "ckpt", accelerator.state, accelerator.gradient_state)
    """
    output_dir = os.fspath(output_dir)
    if gradient_state.step != 0:
        warnings.warn(f"save_state inside a gradient accumulation window ({gradient_state.step} of "
                      f"{gradient_state.num_steps} micro-steps done): the gradients accumulated so far are not "
                      "saved, so a run resumed from here differs; save when accelerator.sync_gradients is True",
                      stacklevel=3)
    rng = get_rng_states(state.device)  # before the syncs below: each one moves the XLA seed
    save = host_saver(state)
    owners = _optimizer_owners(prepared)
    _save_sharded(prepared, output_dir, owners)
    if state.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        for i, model in enumerate(prepared.models):
            if not is_sharded(model):
                save(unwrap_model(model).state_dict(), os.path.join(output_dir, _name("model", i, "bin")))
        for i, (opt, owner) in enumerate(zip(prepared.optimizers, owners)):
            if owner is None:
                save(opt.optimizer.state_dict(), os.path.join(output_dir, _name("optimizer", i, "bin")))
        for i, sched in enumerate(prepared.schedulers):
            save(sched.scheduler.state_dict(), os.path.join(output_dir, _name("scheduler", i, "bin")))
        if prepared.scaler is not None:
            save(prepared.scaler.state_dict(), os.path.join(output_dir, "scaler.pt"))
        for i, obj in enumerate(prepared.custom_objects):
            save(obj.state_dict(), os.path.join(output_dir, f"custom_checkpoint_{i}.pkl"))
    else:
        os.makedirs(output_dir, exist_ok=True)  # a per-node disk has no main process writing it
    rank_state = {
        "rng": rng,
        "dataloaders": [loader.state_dict() for loader in prepared.dataloaders],
        "step": gradient_state.step,
        "num_processes": state.num_processes,
    }
    with open(os.path.join(output_dir, f"rank_{state.process_index}.pkl"), "wb") as f:
        pickle.dump(rank_state, f)
    state.wait_for_everyone()  # nobody reads the checkpoint before it is complete
    if "xla" in rng:
        # Undo what this function's syncs did to the XLA seed: the run goes on with the random
        # numbers a resumed run gets.
        xla.set_rng_state(rng["xla"], state.device)
    return output_dir


def _load(path: str, map_location: Any) -> Any:
    return torch.load(path, map_location=map_location, weights_only=False)


def load_state(prepared: Prepared, input_dir: str | os.PathLike, state: PartialState,
               gradient_state: GradientState, strict: bool = True) -> None:
    """Restore what :func:`save_state` wrote into ``prepared`` (the same objects, prepared in the
    same order); prepared DataLoaders resume mid-epoch."""
    input_dir = os.fspath(input_dir)
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"checkpoint directory {input_dir!r} does not exist")
    owners = _optimizer_owners(prepared)
    _load_sharded(prepared, input_dir, strict, owners)
    for i, model in enumerate(prepared.models):
        if not is_sharded(model):
            path = os.path.join(input_dir, _name("model", i, "bin"))
            if not os.path.exists(path) and os.path.isdir(_sharded_dir(input_dir, "model", i)):
                raise FileNotFoundError(f"{input_dir!r} holds a sharded model (saved with fsdp_plugin on several "
                                        "ranks): load it the same way")
            sd = _load(path, "cpu")
            unwrap_model(model).load_state_dict(sd, strict=strict)
    for i, (opt, owner) in enumerate(zip(prepared.optimizers, owners)):
        if owner is None:
            # Optimizer.load_state_dict moves the state onto each parameter's device.
            opt.optimizer.load_state_dict(_load(os.path.join(input_dir, _name("optimizer", i, "bin")), "cpu"))
    for i, sched in enumerate(prepared.schedulers):
        sched.scheduler.load_state_dict(_load(os.path.join(input_dir, _name("scheduler", i, "bin")), "cpu"))
    scaler_path = os.path.join(input_dir, "scaler.pt")
    if prepared.scaler is not None and os.path.exists(scaler_path):
        prepared.scaler.load_state_dict(_load(scaler_path, "cpu"))
    for i, obj in enumerate(prepared.custom_objects):
        obj.load_state_dict(_load(os.path.join(input_dir, f"custom_checkpoint_{i}.pkl"), prepared.device))
    rank_path = os.path.join(input_dir, f"rank_{state.process_index}.pkl")
    if not os.path.exists(rank_path):
        warnings.warn(f"{rank_path} is missing (saved with fewer processes?): this rank's random "
                      "states and data positions are not restored", stacklevel=3)
        return
    with open(rank_path, "rb") as f:
        rank_state = pickle.load(f)
    if rank_state.get("num_processes") != state.num_processes:
        warnings.warn(f"checkpoint saved with {rank_state.get('num_processes')} processes, loading "
                      f"with {state.num_processes}: data positions are not restored", stacklevel=3)
    else:
        positions = rank_state["dataloaders"]
        if len(positions) != len(prepared.dataloaders):
            warnings.warn(f"checkpoint has {len(positions)} DataLoader positions, "
                          f"{len(prepared.dataloaders)} DataLoaders are prepared: restoring in order",
                          stacklevel=3)
        for loader, position in zip(prepared.dataloaders, positions):
            loader.load_state_dict(position)
    gradient_state.step = rank_state.get("step", 0)
    set_rng_states(rank_state["rng"], state.device)
