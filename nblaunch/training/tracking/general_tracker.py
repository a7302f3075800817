"""What every tracker is: Accelerate's ``GeneralTracker`` interface and ``LoggerType`` names.

A tracker of your own subclasses :class:`GeneralTracker` (or Accelerate's: any object with
``name``, ``start``, ``store_init_configuration``, ``log`` and ``finish`` is taken) and is passed
as ``Accelerator(log_with=[MyTracker(...)])``.

Example::

    class PrintTracker(GeneralTracker):
        name = "print"
        requires_logging_directory = False

        @property
        def tracker(self):
            return None

        def log(self, values, step=None, **kwargs):
            print(step, values)
"""

from __future__ import annotations

from typing import Any

import torch

from nblaunch.contract.precision import ListedEnum

__all__ = ["GeneralTracker", "LoggerType", "plain_values", "chartable"]


class LoggerType(ListedEnum):
    """Accelerate's tracker names. nblaunch builds in TENSORBOARD, WANDB, MLFLOW and TRACKIO;
    ALL means every one of those that is installed."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"

    def __str__(self) -> str:
        return self.value


class GeneralTracker:
    """The interface ``Accelerator`` drives: ``start`` at ``init_trackers``, then
    ``store_init_configuration(config)``, ``log(values, step)`` per ``accelerator.log`` and
    ``finish`` at ``end_training``. Subclasses set ``name``, ``requires_logging_directory`` and
    a ``tracker`` property (the backend's own object, what ``get_tracker(name, unwrap=True)``
    returns). ``GeneralTracker(_blank=True)`` is the tracker of processes that do not log: every
    call does nothing."""

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [attribute for attribute in ("name", "requires_logging_directory", "tracker")
                   if not hasattr(type(self), attribute)]
        if missing:
            raise NotImplementedError(f"{type(self).__name__} must define {', '.join(missing)}")

    def start(self) -> None:
        """Open the run (called by ``init_trackers``, on the main process)."""

    def store_init_configuration(self, values: dict) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Close the run, writing what is pending."""


def plain_values(values: dict) -> dict:
    """``values`` with one-element tensors (and numpy scalars) turned into Python numbers, as
    trackers take them; other values are left as they are.

    Example::

        plain_values({"loss": torch.tensor(0.5), "note": "warmup"})   # {"loss": 0.5, "note": "warmup"}
    """
    plain = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        elif hasattr(value, "item") and getattr(value, "shape", None) == ():
            value = value.item()
        elif isinstance(value, dict):
            value = plain_values(value)
        plain[key] = value
    return plain


def chartable(values: dict) -> dict[str, float]:
    """What the cell's chart can draw from ``accelerator.log(values)``: numbers and one-element
    tensors, with a dict of them (TensorBoard's ``add_scalars``) as ``"key/name"``. Text and
    other values are for the trackers only.

    Example::

        chartable({"loss": torch.tensor(0.5), "lr": {"head": 0.1}, "note": "warmup"})
        # {"loss": 0.5, "lr/head": 0.1}
    """
    drawn: dict[str, float] = {}
    for key, value in plain_values(values).items():
        if isinstance(value, dict):
            drawn.update({f"{key}/{name}": number for name, number in chartable(value).items()})
        elif isinstance(value, (int, float)):
            drawn[str(key)] = value
    return drawn
