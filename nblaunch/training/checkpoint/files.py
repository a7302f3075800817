"""``save_state`` / ``load_state``: everything needed to resume a run where it stopped, in
Accelerate's layout, so that Accelerate's ``load_state`` reads a checkpoint nblaunch wrote and
nblaunch's reads one Accelerate wrote (names in :mod:`~nblaunch.training.checkpoint.layout`).

A checkpoint directory (files of the main process unless marked per rank)::

    model.safetensors, model_1.safetensors, ...   state dicts of the unwrapped models (tied
                                                  weights once); pytorch_model.bin, ... without
                                                  safetensors or with safe_serialization=False
    optimizer.bin, optimizer_1.bin, ...
    scheduler.bin, ...
    scaler.pt                                     the fp16 GradScaler
    custom_checkpoint_0.pkl, ...                  objects passed to register_for_checkpointing
    random_states_{r}.pkl                         per rank: RNG states and accumulation step,
                                                  Accelerate's format (torch.save of a dict)
    nblaunch_positions_{r}.pkl                    per rank, nblaunch only: the data position of
                                                  every prepared DataLoader
    nblaunch_complete.json                        nblaunch only, written last: every file and its
                                                  size (``completeness``: a half-written folder is
                                                  never loaded)
    what the strategy writes                      a model spread over the ranks and its optimizer,
                                                  instead of the files above, in its stack's layout
                                                  (FSDP: pytorch_model_fsdp_{i}/, optimizer_{i}/;
                                                  DeepSpeed: pytorch_model/; see strategy/)

The data position (epoch, shuffle position, batches consumed) is restored too, so the next
``for batch in loader`` continues the interrupted epoch exactly. A checkpoint Accelerate wrote
has none: the loaders start their epoch 0 as Accelerate's do, and ``skip_first_batches`` skips
what was used, as in Accelerate's examples.

On XLA every rank first runs its pending graph (``torch_xla.sync()``), then the main rank copies
the tensors to the CPU and writes them (``xm.save``'s way), so a checkpoint loads without
torch_xla; the random states also hold each device's XLA RNG seed.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from nblaunch.training.checkpoint import completeness, layout
from nblaunch.training.checkpoint.record import Prepared
from nblaunch.training.model.unwrap import unwrap_model
from nblaunch.training.runtime import xla
from nblaunch.training.runtime.seed import get_rng_states, set_rng_states
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.runtime.tree import recursively_apply

if TYPE_CHECKING:
    from nblaunch.training.step.gradient_state import GradientState

__all__ = ["save_state", "load_state", "host_saver"]


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


def _plain_schedulers(prepared: Prepared) -> list:
    """The schedulers the checkpoint writes itself, numbered as Accelerate numbers them (those the
    strategy saves with its model, DeepSpeed's, are left out first)."""
    return [sched for sched in prepared.schedulers if not prepared.strategy.owns_scheduler(sched)]


def save_state(prepared: Prepared, output_dir: str | os.PathLike, state: PartialState,
               gradient_state: GradientState, safe_serialization: bool = True) -> str:
    """Write ``prepared`` to ``output_dir`` (see the module docstring); call it on every rank.
    ``safe_serialization=False`` writes the weights with torch.save (``pytorch_model.bin``).
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
    os.makedirs(output_dir, exist_ok=True)  # every rank: a per-node disk has no main process writing it
    if state.is_local_main_process:
        completeness.mark_unfinished(output_dir)  # not whole until the record below replaces this one
    written = prepared.strategy.save_states(prepared.models, prepared.optimizers, output_dir, state)
    if state.is_main_process:
        for i, model in enumerate(prepared.models):
            if i not in written.models:
                weights = unwrap_model(model).state_dict()
                if state.distributed_type is DistributedType.XLA:
                    weights = _cpu_copy(weights)
                layout.write_weights(weights, output_dir, i, save, safe_serialization)
        for i, opt in enumerate(prepared.optimizers):
            if i not in written.optimizers:
                save(opt.optimizer.state_dict(), os.path.join(output_dir, layout.optimizer_name(i)))
        for i, sched in enumerate(_plain_schedulers(prepared)):
            save(sched.scheduler.state_dict(), os.path.join(output_dir, layout.scheduler_name(i)))
        if prepared.scaler is not None:
            save(prepared.scaler.state_dict(), os.path.join(output_dir, layout.SCALER_NAME))
        for i, obj in enumerate(prepared.custom_objects):
            save(obj.state_dict(), os.path.join(output_dir, layout.custom_name(i)))
    rank = state.process_index
    torch.save(layout.random_states(rng, gradient_state.step), os.path.join(output_dir, layout.random_states_name(rank)))
    positions = {"num_processes": state.num_processes,
                 "dataloaders": [loader.state_dict() for loader in prepared.dataloaders]}
    with open(os.path.join(output_dir, layout.positions_name(rank)), "wb") as f:
        pickle.dump(positions, f)
    state.wait_for_everyone()  # every rank wrote its part
    if state.is_local_main_process:  # each node's: a per-node disk has its own folder to mark
        completeness.mark_complete(output_dir, state.num_processes)  # last: what is recorded is whole
    state.wait_for_everyone()  # nobody reads the checkpoint before it is complete
    if "xla" in rng:
        # Undo what this function's syncs did to the XLA seed: the run goes on with the random
        # numbers a resumed run gets.
        xla.set_rng_state(rng["xla"], state.device)
    return output_dir


def _load(path: str, map_location: Any) -> Any:
    return torch.load(path, map_location=map_location, weights_only=False)


def _load_weights(prepared: Prepared, input_dir: str, i: int, strict: bool) -> None:
    weights = layout.read_weights(input_dir, i)
    if weights is None:
        why = prepared.strategy.refuses_plain_checkpoint(input_dir, i)
        if why is not None:
            raise FileNotFoundError(f"{input_dir!r} holds {why}")
        if os.path.exists(os.path.join(input_dir, "model.bin")) or os.path.exists(os.path.join(input_dir, "rank_0.pkl")):
            raise FileNotFoundError(
                f"{input_dir!r} is in nblaunch's earlier layout (model.bin, rank_N.pkl), which load_state no longer "
                "reads: load its weights with model.load_state_dict(torch.load('.../model.bin')), or finish that run "
                "with the nblaunch that wrote it")
        raise FileNotFoundError(
            f"{input_dir!r} has no {layout.weights_name(i, safe=True)} or {layout.weights_name(i, safe=False)} "
            f"for prepared model {i} (it holds {sorted(os.listdir(input_dir))}): give the directory save_state "
            "wrote, and prepare as many models as that run did")
    layout.load_weights(unwrap_model(prepared.models[i]), weights, strict=strict)


def load_state(prepared: Prepared, input_dir: str | os.PathLike, state: PartialState,
               gradient_state: GradientState, strict: bool = True) -> None:
    """Restore what :func:`save_state` (or Accelerate's ``save_state``) wrote into ``prepared``
    (the same objects, prepared in the same order); prepared DataLoaders resume mid-epoch when
    the checkpoint has their positions (nblaunch's)."""
    input_dir = os.fspath(input_dir)
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"checkpoint directory {input_dir!r} does not exist")
    completeness.check_complete(input_dir)  # before anything is loaded: a half-written one never is
    custom = [f for f in os.listdir(input_dir) if re.match(layout.CUSTOM_PATTERN, f)]
    if len(custom) != len(prepared.custom_objects):
        raise ValueError(f"{input_dir!r} holds {len(custom)} registered objects' states, "
                         f"{len(prepared.custom_objects)} objects are registered: register_for_checkpointing "
                         "the same objects, in the same order, as the run that saved it")
    written = prepared.strategy.load_states(prepared.models, prepared.optimizers, input_dir, strict, state)
    for i in range(len(prepared.models)):
        if i not in written.models:
            _load_weights(prepared, input_dir, i, strict)
    for i, opt in enumerate(prepared.optimizers):
        if i not in written.optimizers:
            # Optimizer.load_state_dict moves the state onto each parameter's device.
            opt.optimizer.load_state_dict(_load(os.path.join(input_dir, layout.optimizer_name(i)), "cpu"))
    for i, sched in enumerate(_plain_schedulers(prepared)):
        sched.scheduler.load_state_dict(_load(os.path.join(input_dir, layout.scheduler_name(i)), "cpu"))
    scaler_path = os.path.join(input_dir, layout.SCALER_NAME)
    if prepared.scaler is not None and os.path.exists(scaler_path):
        prepared.scaler.load_state_dict(_load(scaler_path, "cpu"))
    for i, obj in enumerate(prepared.custom_objects):
        obj.load_state_dict(_load(os.path.join(input_dir, layout.custom_name(i)), prepared.device))
    _load_rank_files(prepared, input_dir, state, gradient_state)


def _load_rank_files(prepared: Prepared, input_dir: str, state: PartialState, gradient_state: GradientState) -> None:
    """This rank's random states and accumulation step, then its loaders' positions if saved."""
    rng_path = os.path.join(input_dir, layout.random_states_name(state.process_index))
    if not os.path.exists(rng_path):
        warnings.warn(f"{rng_path} is missing (saved with fewer processes?): this rank's random "
                      "states and data positions are not restored", stacklevel=4)
        return
    rng, step = layout.from_random_states(_load(rng_path, "cpu"))
    positions_path = os.path.join(input_dir, layout.positions_name(state.process_index))
    if os.path.exists(positions_path):  # nblaunch's; Accelerate's checkpoints have none
        with open(positions_path, "rb") as f:
            _restore_positions(prepared, pickle.load(f), state)
    elif prepared.dataloaders and any(re.match(layout.ACCELERATE_POSITION_PATTERN, f) for f in os.listdir(input_dir)):
        # Code written for a StatefulDataLoader expects load_state to resume it, and would silently
        # start the epoch again.
        warnings.warn(f"{input_dir!r} holds Accelerate's StatefulDataLoader or sampler state (dl_state_dict.bin, "
                      "sampler.bin), which nblaunch does not read: the prepared DataLoaders start at their epoch 0. "
                      "Skip what the interrupted epoch used with accelerator.skip_first_batches(loader, n)",
                      stacklevel=4)
    gradient_state.step = step % gradient_state.num_steps
    set_rng_states(rng, state.device)


def _restore_positions(prepared: Prepared, saved: dict, state: PartialState) -> None:
    if saved.get("num_processes") != state.num_processes:
        warnings.warn(f"checkpoint saved with {saved.get('num_processes')} processes, loading "
                      f"with {state.num_processes}: data positions are not restored", stacklevel=5)
        return
    positions = saved["dataloaders"]
    if len(positions) != len(prepared.dataloaders):
        warnings.warn(f"checkpoint has {len(positions)} DataLoader positions, "
                      f"{len(prepared.dataloaders)} DataLoaders are prepared: restoring in order", stacklevel=5)
    for loader, position in zip(prepared.dataloaders, positions):
        loader.load_state_dict(position)
