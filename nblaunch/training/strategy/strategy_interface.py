"""The ``Strategy`` seam: what every way of spreading a model over the ranks answers, with the
answers of a model that is not spread (the defaults). See the package docstring.

Example::

    strategy = pick_strategy(state, "no", DistributedDataParallelKwargs())
    model = strategy.wrap_model(model, device, trainable=True)
    strategy.backward(loss, scaler=None)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nblaunch.training.model.fsdp import full_state_dict, is_sharded, total_norm
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.step.gradient_state import GradientState
from nblaunch.training.strategy import sharded_layout
from nblaunch.training.strategy.saved_by_strategy import SavedByStrategy

__all__ = ["Strategy", "SavedByStrategy", "deepspeed_tag"]


class Strategy:
    """A model that is not spread: each rank holds all of it (the base of ``Replicated``).

    Subclasses override what their stack does differently; every method here is what a plain
    model needs, so a strategy states only its differences.
    """

    #: ``Accelerator.distributed_type`` under this strategy; None: the process state's own.
    distributed_type: DistributedType | None = None

    def places(self, trainable: bool) -> bool:
        """Whether ``prepare`` moves the model to the device before :meth:`wrap_model` (sharding
        places a trained model itself, one unit at a time)."""
        return True

    def autocasts(self, trainable: bool) -> bool:
        """Whether ``prepare`` runs the model's forward under the mixed precision's autocast."""
        return True

    #: The ``DeviceMesh`` a stack lays the ranks on (``accelerator.torch_device_mesh``); None: none.
    device_mesh: Any = None

    def data_ranks(self, num_processes: int, process_index: int) -> tuple[int, int]:
        """How many distinct data shards there are and which this rank reads (tensor parallel
        ranks of one group read the same batches)."""
        return num_processes, process_index

    def check_optimizer(self, models: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer this strategy cannot save (one over a sharded model and more)."""
        sharded_layout.owner_of(models, optimizer)

    def prepare_together(self, args: tuple, gradient_state: GradientState) -> dict[int, Any]:
        """Prepare objects that only make sense together (DeepSpeed's engine: model, optimizer
        and scheduler at once) before ``prepare`` looks at each one: each one's replacement by
        its index in ``args``; nothing by default."""
        return {}

    def wrap_model(self, model: torch.nn.Module, device: torch.device, trainable: bool) -> torch.nn.Module:
        """The model as it trains under this strategy (already placed and autocast)."""
        return model

    def backward(self, loss: torch.Tensor, scaler: Any, **kwargs: Any) -> None:
        """Backward of an already accumulation-divided ``loss``, scaled under fp16."""
        if scaler is not None:
            scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def divides_loss(self) -> bool:
        """Whether ``Accelerator.backward`` divides the loss by the accumulation steps (DeepSpeed's
        engine does it itself)."""
        return True

    def clip_grad_value_(self, parameters: list, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def own_precision(self) -> str | None:
        """The precision this stack computes in by itself ("fp16", "bf16", "no": DeepSpeed's
        config), instead of the Accelerator's autocast and GradScaler; None: the Accelerator's."""
        return None

    def refuses_compile(self) -> str | None:
        """Why this stack cannot have ``prepare`` compile its models (what to do instead), or None."""
        return None

    def clip_grad_norm_(self, parameters: list, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip and return the total norm (over every rank's shards for a sharded model)."""
        return total_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole weights of a model this strategy spread (on the main process; call it on
        every rank); None: the unwrapped model's own ``state_dict`` is whole."""
        return full_state_dict(model) if is_sharded(model) else None

    def save_states(self, models: list, optimizers: list, output_dir: str, state: PartialState) -> SavedByStrategy:
        """Write the models and optimizers that are spread, on every rank; a model that someone
        sharded with ``fully_shard`` is written sharded whatever the strategy."""
        return sharded_layout.save(models, optimizers, output_dir)

    def load_states(self, models: list, optimizers: list, input_dir: str, strict: bool,
                    state: PartialState) -> SavedByStrategy:
        """Read back what :meth:`save_states` wrote."""
        return sharded_layout.load(models, optimizers, input_dir, strict)

    def refuses_plain_checkpoint(self, input_dir: str, i: int) -> str | None:
        """Why a checkpoint without model ``i``'s plain weights cannot load here (what the folder
        holds instead), or None."""
        if os.path.isdir(os.path.join(input_dir, sharded_layout.sharded_model_dir(i))):
            return ("a model saved in pieces (with an fsdp_plugin, or tensor parallel): load it the same way, "
                    "with Accelerator(fsdp_plugin=...) or Accelerator(parallelism_config=...)")
        if os.path.isdir(os.path.join(input_dir, deepspeed_tag(i))):
            return (f"a DeepSpeed checkpoint ({deepspeed_tag(i)}/): load it the same way, with "
                    "Accelerator(deepspeed_plugin=...)")
        return None

    def owns_scheduler(self, scheduler: Any) -> bool:
        """Whether the strategy's checkpoint holds this prepared scheduler (DeepSpeed's engine saves
        the scheduler it steps), so the plain checkpoint leaves it out."""
        return False

    def release(self) -> None:
        """Let go of what the strategy prepared (``free_memory``): the next ``prepare`` starts anew."""

    def describe(self) -> str:
        """One line for ``repr`` and errors."""
        return type(self).__name__


def deepspeed_tag(i: int) -> str:
    """The folder DeepSpeed's ``save_checkpoint`` writes model ``i`` to, as Accelerate names it."""
    return "pytorch_model" if i == 0 else f"pytorch_model_{i}"
