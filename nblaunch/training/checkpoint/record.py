"""What a checkpoint holds: :class:`Prepared`, the plain record an ``Accelerator`` hands to
:func:`~nblaunch.training.checkpoint.files.save_state` and ``load_state``, so that checkpoints
never read the Accelerator itself.

Example::

    record = Prepared(models=[model], optimizers=[prepared_optimizer], schedulers=[],
                      dataloaders=[prepared_loader], custom_objects=[], scaler=None,
                      device=torch.device("cpu"), strategy=Replicated(...))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nblaunch.training.data.prepared import PreparedDataLoader
    from nblaunch.training.step.optim import AcceleratedOptimizer, AcceleratedScheduler
    from nblaunch.training.strategy.strategy_interface import Strategy

__all__ = ["Prepared"]


@dataclass
class Prepared:
    """The objects an Accelerator prepared (or registered), each list in preparation order: the
    i-th model is saved as ``model_i``, and loads into the i-th model prepared by the resumed run.

    The lists are the Accelerator's own (not copies): loading restores into those objects.
    ``device`` is where registered objects' tensors are loaded; ``strategy`` writes and reads
    the models and optimizers it spread over the ranks.
    """

    models: list[torch.nn.Module]
    optimizers: list[AcceleratedOptimizer]
    schedulers: list[AcceleratedScheduler]
    dataloaders: list[PreparedDataLoader]
    custom_objects: list[Any]
    scaler: torch.amp.GradScaler | None
    device: torch.device
    strategy: Strategy
