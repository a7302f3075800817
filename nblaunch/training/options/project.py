"""``ProjectConfiguration`` (Accelerate's): where a run keeps checkpoints and logs, and how
``save_state`` names checkpoints.

Example::

    config = ProjectConfiguration(project_dir="runs/digits", automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(project_config=config)
    accelerator.save_state()     # runs/digits/checkpoints/checkpoint_0, _1, ... keeping the last 3
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ProjectConfiguration", "project_configuration"]


@dataclass
class ProjectConfiguration:
    """Args:
        project_dir: the run's directory: ``save_state()`` without a directory writes under it.
        logging_dir: where trackers that write files (TensorBoard) write; ``project_dir`` if None.
        automatic_checkpoint_naming: ``save_state()`` writes ``project_dir/checkpoints/checkpoint_<iteration>``
            and ``load_state()`` reads the latest of them.
        total_limit: keep at most this many automatically named checkpoints (the oldest go first).
        iteration: the number the next automatically named checkpoint gets.
        save_on_each_node: accepted for Accelerate's code; nblaunch's main process writes
            everything, so every node must see the directory (a shared file system).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` too where it was not given."""
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def __post_init__(self) -> None:
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"total_limit must be at least 1 (or None to keep every checkpoint), "
                             f"got {self.total_limit}")
        if self.logging_dir is not None:
            self.logging_dir = os.fspath(self.logging_dir)
        self.set_directories(self.project_dir)


def project_configuration(project_config: Any, project_dir: str | os.PathLike | None,
                          logging_dir: str | os.PathLike | None = None) -> ProjectConfiguration:
    """The Accelerator's configuration from its arguments: ``project_config`` (ours or
    Accelerate's, read by its fields), with ``project_dir`` and ``logging_dir`` filling what it
    leaves unset, as Accelerate does."""
    if project_config is None:
        config = ProjectConfiguration(logging_dir=os.fspath(logging_dir) if logging_dir is not None else None)
    elif isinstance(project_config, ProjectConfiguration):
        config = project_config
    else:  # Accelerate's ProjectConfiguration: the same fields
        config = ProjectConfiguration(**{name: getattr(project_config, name)
                                         for name in ProjectConfiguration.__dataclass_fields__})
    if project_dir is not None and config.project_dir is None:
        config.set_directories(project_dir)
    return config
