"""Lightning inside a launch: what a ``LightningModule`` logs is drawn by the launching cell.

A ``Trainer`` or a ``Fabric`` made inside a function given to ``notebook_launcher`` joins the
launch's ranks as it joins torchrun's (docs/coming-from-lightning.md). This module carries what
Lightning logs to the cell's dashboard, which charts it per rank like ``Accelerator.log``:

* :class:`CellLogger`, a Lightning logger that sends metrics to the launching cell.
* :func:`trainer_callbacks`, which Lightning calls for every ``Trainer`` it makes: nblaunch
  registers it under Lightning's ``lightning.pytorch.callbacks_factory`` entry point. Inside a
  launch it adds a callback that puts a ``CellLogger`` after the Trainer's own loggers, so
  ``self.log`` reaches the dashboard with no change to the code; outside one it adds nothing.

Importing this module imports Lightning; ``import nblaunch`` never does.

Example (inside the launched function)::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp")  # self.log -> the cell
    trainer = L.Trainer(..., logger=CellLogger())   # with no logger of Lightning's, only the cell's
    fabric = L.Fabric(..., loggers=CellLogger())    # fabric.log / fabric.log_dict -> the cell
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger

from nblaunch.worker import channel

# Lightning adds the epoch to every step's metrics "for convenience" (its loggers chart it as a
# staircase); the dashboard's charts are per step already, and their room is better spent.
_ADDED_BY_LIGHTNING = ("epoch",)


class CellLogger(Logger):
    """A Lightning logger whose metrics the launching cell's dashboard draws, one line per rank.

    Every rank sends its own values (``self.log(..., sync_dist=True)`` makes them agree), at
    Lightning's pace (``Trainer(log_every_n_steps=...)``, 50 by default). Outside a launch it
    does nothing. It keeps nothing on disk: hyperparameters are ignored, and as the only
    logger it leaves checkpoints where they go without one (``default_root_dir/checkpoints``).

    A ``Trainer`` made inside a launch gets one by itself next to its own loggers; give it
    yourself with ``logger=False`` (or to ``Fabric``, which has no default logger).

    Example::

        def train():
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=CellLogger())
            trainer.fit(MyModule(), loader)          # self.log("loss", loss) -> the cell's chart

        notebook_launcher(train, num_processes=2)
    """

    @property
    def name(self) -> str:
        return ""  # with version "", a checkpoint path gains no folder for this logger

    @property
    def version(self) -> str:
        return ""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send ``metrics`` (numbers or one-element tensors) for ``step`` to the launching cell."""
        values = {name: value for name, value in metrics.items() if name not in _ADDED_BY_LIGHTNING}
        if values:
            channel.log_metrics(values, step)  # a no-op outside a launch

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Ignored: the dashboard draws metrics."""


class AddCellLogger(Callback):
    """The callback :func:`trainer_callbacks` gives every Trainer made inside a launch (Lightning
    names it in each rank's log): when the Trainer sets up (fit, validate, test, predict), it puts
    a :class:`CellLogger` after the Trainer's loggers, unless one is there. A Trainer with
    ``logger=False`` is left without: that is a choice, and a logger there would also move its
    checkpoints and ``log_dir``.

    Example::

        trainer = L.Trainer(callbacks=[AddCellLogger()])   # what the entry point does
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        loggers = trainer.loggers
        if loggers and not any(isinstance(logger, CellLogger) for logger in loggers):
            trainer.loggers = [*loggers, CellLogger()]  # last: loggers[0] still names the log folders


def trainer_callbacks() -> list[Callback]:
    """Lightning's ``lightning.pytorch.callbacks_factory`` entry point (see pyproject.toml): the
    callbacks every ``Trainer`` gets. Inside a launch, the one that adds a :class:`CellLogger`;
    outside one, none.

    Example::

        >>> trainer_callbacks()   # in the notebook itself, not in a launch
        []
    """
    return [AddCellLogger()] if channel.in_launch() else []
