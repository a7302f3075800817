"""The ``Accelerator``'s experiment tracking (Accelerate's names), a group of methods of
:class:`~nblaunch.training.accelerator.core.Accelerator`: ``log`` always draws metrics in the
launching cell (every rank sends; the display chooses) and, on the main process, also writes
them to the trackers chosen with ``log_with`` (:mod:`nblaunch.training.tracking`).

Example::

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("digits", config={"lr": 3e-4})
    accelerator.log({"loss": loss}, step=step)                  # the cell's chart and TensorBoard
    if accelerator.is_main_process:  # the backend's own object exists on the main process only
        accelerator.get_tracker("tensorboard", unwrap=True).add_histogram("w", model.weight, step)
    accelerator.end_training()
"""

from __future__ import annotations

from typing import Any

from nblaunch.training.accelerator.host import AcceleratorHost
from nblaunch.training.tracking.backends import BUILT_IN
from nblaunch.training.tracking.general_tracker import GeneralTracker, chartable
from nblaunch.worker import channel

__all__ = ["TrackingMethods"]


class TrackingMethods(AcceleratorHost):
    """log, init_trackers, get_tracker, end_training."""

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send metrics to the launching cell's chart and, on the main process, to every tracker
        (``log_kwargs={"wandb": {...}}`` go to one tracker's own ``log``). Tensors are turned
        into numbers; text and other values go to the trackers only. Outside a launch only the
        trackers get them."""
        drawn = chartable(values)
        if drawn:
            channel.log_metrics(drawn, step)  # a no-op outside a launch
        if self.is_main_process:
            for tracker in self.trackers:
                tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def init_trackers(self, project_name: str, config: dict | None = None,
                      init_kwargs: dict | None = None) -> None:
        """Open a run named ``project_name`` in every tracker of ``log_with`` (main process only)
        and record ``config`` as its hyperparameters; ``init_kwargs={"wandb": {...}}`` go to
        one tracker's constructor (for W&B, ``wandb.init``). Call it on every process."""
        self.project_name = project_name
        self.config = config
        if not self.is_main_process:
            return
        init_kwargs = init_kwargs or {}
        for chosen in self.log_with:
            if isinstance(chosen, str):
                tracker_class = BUILT_IN[chosen][0]
                arguments = init_kwargs.get(chosen, {})
                if tracker_class.requires_logging_directory:
                    tracker = tracker_class(project_name, self.logging_dir, **arguments)
                else:
                    tracker = tracker_class(project_name, **arguments)
            else:
                tracker = chosen  # a tracker object: made by the user
            try:
                tracker.start()
            except BaseException:
                self._close_trackers()  # close the runs already open: no half-open W&B run
                raise
            self.trackers.append(tracker)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its backend's own object with ``unwrap=True``, e.g. the
        W&B run). On processes that do not log it is a tracker that does nothing, so
        ``accelerator.get_tracker("wandb").log(...)`` runs on every rank."""
        if not self.trackers:
            return GeneralTracker(_blank=True)
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"no tracker named {name!r}: this Accelerator has "
                         f"{', '.join(repr(t.name) for t in self.trackers)}")

    def end_training(self) -> None:
        """Close every tracker (writing what is pending), then wait for every process. The
        process group stays (Accelerate destroys it): the launch closes it when the function
        returns, and warm ranks keep it for the next cell."""
        self._close_trackers()
        self.wait_for_everyone()

    def _close_trackers(self) -> None:
        """Close every open tracker (this process only), first opened last closed."""
        while self.trackers:
            self.trackers.pop().finish()
