"""Accelerate's automatic checkpoint naming: ``project_dir/checkpoints/checkpoint_<n>``, at most
``total_limit`` kept, and the latest found again for ``load_state()``.

Example::

    directory = next_checkpoint(config, is_main_process=True)   # .../checkpoints/checkpoint_3
"""

from __future__ import annotations

import os
import re
import shutil
import warnings

from nblaunch.training.options.project import ProjectConfiguration

__all__ = ["next_checkpoint", "prune_before", "latest_checkpoint", "number_of", "number_after_the_newest"]


def _checkpoints_dir(config: ProjectConfiguration) -> str:
    if config.project_dir is None:
        raise ValueError("automatic_checkpoint_naming needs a project directory: "
                         "ProjectConfiguration(project_dir=...) or Accelerator(project_dir=...)")
    return os.path.join(config.project_dir, "checkpoints")


def number_of(directory: str) -> int | None:
    """The n of ``checkpoint_<n>``, None for any other name (a folder of the user's own there
    is never counted, pruned or loaded)."""
    found = re.fullmatch(r"checkpoint_([0-9]+)", os.path.basename(os.path.normpath(directory)))
    return int(found[1]) if found else None


def numbered(parent: str) -> list[tuple[int, str]]:
    """The ``checkpoint_<n>`` folders in ``parent`` as ``(n, path)``, oldest first ([] if none)."""
    if not os.path.isdir(parent):
        return []
    entries = [(number_of(name), os.path.join(parent, name)) for name in os.listdir(parent)]
    return sorted((n, path) for n, path in entries if n is not None and os.path.isdir(path))


def next_checkpoint(config: ProjectConfiguration, is_main_process: bool) -> str:
    """The directory the next ``save_state()`` writes (the main process makes its parent; the
    caller waits for it before writing). The oldest beyond ``total_limit`` go only once it is
    complete (:func:`prune_before`): a save cut short must not have cost the last whole one."""
    parent = _checkpoints_dir(config)
    target = os.path.join(parent, f"checkpoint_{config.iteration}")
    existing = numbered(parent)
    if existing and existing[-1][0] >= config.iteration:
        # Saving below the newest would make it the one load_state() never picks and the next prune drops.
        raise ValueError(f"{existing[-1][1]} exists, and this save would be checkpoint_{config.iteration}: call "
                         "load_state() first (the next save then follows the checkpoint it loads), or set "
                         f"accelerator.project_configuration.iteration = {existing[-1][0] + 1}")
    if is_main_process:
        os.makedirs(parent, exist_ok=True)
    return target


def prune_before(config: ProjectConfiguration, saved: str) -> None:
    """After ``saved`` is complete: remove the oldest checkpoints so that ``total_limit`` are kept
    (the main process calls it)."""
    if config.total_limit is None:
        return
    existing = [(n, path) for n, path in numbered(_checkpoints_dir(config))
                if n <= (number_of(saved) or 0)]  # never one newer than the save just made
    doomed = existing[:max(0, len(existing) - config.total_limit)]
    if doomed:
        warnings.warn(f"total_limit={config.total_limit}: removing {', '.join(path for _, path in doomed)}",
                      stacklevel=4)
    for _, path in doomed:
        shutil.rmtree(path)


def number_after_the_newest(config: ProjectConfiguration) -> int:
    """One more than the newest ``checkpoint_<n>`` under ``project_dir/checkpoints`` (0: none)."""
    existing = numbered(_checkpoints_dir(config))
    return existing[-1][0] + 1 if existing else 0


def latest_checkpoint(config: ProjectConfiguration) -> str:
    """The newest ``checkpoint_<n>`` under ``project_dir/checkpoints``."""
    parent = _checkpoints_dir(config)
    existing = numbered(parent)
    if not existing:
        raise FileNotFoundError(f"no checkpoint to load in {parent}: save_state() writes them there")
    return existing[-1][1]
