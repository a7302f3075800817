"""The trackers nblaunch builds in, under Accelerate's class names and with its file layouts:
each imports its package in ``start``, so naming one costs nothing until ``init_trackers``.

Example::

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("digits", config={"lr": 3e-4})   # runs/digits/events.out.tfevents...
    accelerator.log({"loss": loss}, step=step)
    accelerator.end_training()
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

from nblaunch.training.tracking.general_tracker import GeneralTracker, plain_values

__all__ = ["TensorBoardTracker", "WandBTracker", "MLflowTracker", "TrackioTracker", "BUILT_IN"]


class TensorBoardTracker(GeneralTracker):
    """Event files in ``logging_dir/run_name`` (``SummaryWriter``'s keyword arguments in ``kwargs``)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # deferred: needs the tensorboard package

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict) -> None:
        # TensorBoard's hparams take numbers, strings, booleans and tensors; show anything else as text.
        shown = {key: value if isinstance(value, (int, float, str, bool)) else str(value)
                 for key, value in plain_values(values).items()}
        self.writer.add_hparams(shown, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in plain_values(values).items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()  # readable while training runs

    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)

    def finish(self) -> None:
        self.writer.close()


class _RunTracker(GeneralTracker):
    """A tracker whose package makes a run with ``<package>.init(project=run_name, **kwargs)``
    and logs, configures and finishes through it (W&B and trackio share this shape)."""

    package = ""

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    def start(self) -> None:
        backend = importlib.import_module(self.package)  # deferred: optional, imported when asked for
        self.run = backend.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(plain_values(values))

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log(plain_values(values), step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class WandBTracker(_RunTracker):
    """A W&B run: ``wandb.init(project=run_name, **kwargs)``; offline with ``WANDB_MODE=offline``
    or ``init_kwargs={"wandb": {"mode": "offline"}}``."""

    name = package = "wandb"
    requires_logging_directory = False

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(plain_values(values), allow_val_change=True)

    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        import wandb  # deferred: optional

        self.run.log({key: [wandb.Image(image) for image in images] for key, images in values.items()},
                     step=step, **kwargs)


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment ``experiment_name`` (created where missing, its artifacts
    under ``logging_dir``). The store is MLflow's own choice: ``MLFLOW_TRACKING_URI``. As in
    Accelerate, ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` (JSON) and
    ``MLFLOW_NESTED_RUN`` override the arguments."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike | None = None,
                 run_id: str | None = None, tags: dict | str | None = None, nested_run: bool = False,
                 run_name: str | None = None, description: str | None = None) -> None:
        super().__init__()
        import json

        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = os.fspath(logging_dir) if logging_dir is not None else None
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = nested.lower() in ("1", "true", "yes", "on") if isinstance(nested, str) else bool(nested)
        self.run_name = run_name
        self.description = description
        self.active_run: Any = None

    def start(self) -> None:
        import mlflow  # deferred: optional

        found = mlflow.get_experiment_by_name(self.experiment_name) if self.experiment_name else None
        if found is not None:
            experiment_id = found.experiment_id
        elif self.experiment_name:
            experiment_id = mlflow.create_experiment(self.experiment_name, artifact_location=self.logging_dir,
                                                     tags=self.tags)
        else:
            experiment_id = None
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: dict) -> None:
        import mlflow  # deferred: optional
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {}
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                warnings.warn(f"MLflow keeps parameters of at most {MAX_PARAM_VAL_LENGTH} characters: "
                              f"{key!r} is not recorded", stacklevel=2)
            else:
                params[key] = value
        items = list(params.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):  # MLflow's limit per call
            mlflow.log_params(dict(items[start:start + MAX_PARAMS_TAGS_PER_BATCH]))

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        import mlflow  # deferred: optional

        metrics, dropped = {}, []
        for key, value in plain_values(values).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[key] = value
            else:
                dropped.append(key)
        if dropped:
            warnings.warn(f"MLflow records numbers only: {', '.join(map(repr, dropped))} not recorded", stacklevel=2)
        mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        import mlflow  # deferred: optional

        mlflow.end_run()


class TrackioTracker(_RunTracker):
    """A trackio run: ``trackio.init(project=run_name, **kwargs)``; local (under ``TRACKIO_DIR``)
    unless a ``space_id`` or server is given."""

    name = package = "trackio"
    requires_logging_directory = False


# name -> (class, the package it needs, how to install it)
BUILT_IN: dict[str, tuple[type[GeneralTracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "pip install tensorboard"),
    "wandb": (WandBTracker, "wandb", "pip install wandb"),
    "mlflow": (MLflowTracker, "mlflow", "pip install mlflow"),
    "trackio": (TrackioTracker, "trackio", "pip install trackio"),
}
