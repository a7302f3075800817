"""Where a stopped launch saves its work, and which checkpoint ``resume=`` loads before the first
step: one rule for both, so what an interrupt saved is what the next launch finds.

- the Accelerator has a ``project_dir`` and automatic checkpoint naming: the series,
  ``project_dir/checkpoints/checkpoint_<n>``; the latest is resumed;
- a ``project_dir`` without it: ``project_dir/checkpoint`` (``save_state()``'s own default);
- no ``project_dir``: the launch's own folder (``$NBLAUNCH_CHECKPOINTS``, under the user's state
  folder, named after the function), ``checkpoint_<n>`` there; the latest is resumed.

``resume=PATH`` loads that folder. Every folder is checked whole (``completeness``) and saved by
as many processes as this launch starts before anything is loaded: the data positions and random
states are per rank, so another count would not continue the same run.

Example (what the Accelerator does at the rank's first step)::

    folder = to_resume(os.environ["NBLAUNCH_RESUME"], accelerator.project_configuration, launch_folder())
"""

from __future__ import annotations

import os

from nblaunch.contract import variables as v
from nblaunch.training.checkpoint import completeness, naming
from nblaunch.training.options.project import ProjectConfiguration

__all__ = ["launch_folder", "stop_folder", "to_resume", "check_resumable"]


def launch_folder() -> str | None:
    """The launch's own checkpoint folder (None outside a launch of nblaunch)."""
    return os.environ.get(v.CHECKPOINTS) or None


def stop_folder(config: ProjectConfiguration, launch: str | None) -> str | None:
    """Where a stop saves when the Accelerator's automatic naming does not decide (None: it does)."""
    if config.project_dir is not None:
        return None if config.automatic_checkpoint_naming else os.path.join(config.project_dir, "checkpoint")
    if launch is None:
        raise ValueError("nowhere to save: give Accelerator(project_dir=...)")
    existing = naming.numbered(launch)
    return os.path.join(launch, f"checkpoint_{existing[-1][0] + 1 if existing else 0}")


def to_resume(asked: str, config: ProjectConfiguration, launch: str | None) -> str | None:
    """The folder ``resume=`` loads (``asked``: "latest" or a path); None when "latest" finds none."""
    if asked != "latest":
        if not os.path.isdir(asked):
            raise FileNotFoundError(f"resume={asked!r}: no such checkpoint folder")
        return asked
    if config.project_dir is not None:
        if config.automatic_checkpoint_naming:
            found = naming.numbered(os.path.join(config.project_dir, "checkpoints"))
            return found[-1][1] if found else None
        single = os.path.join(config.project_dir, "checkpoint")
        return single if os.path.isdir(single) else None
    found = naming.numbered(launch) if launch is not None else []
    return found[-1][1] if found else None


def check_resumable(folder: str, num_processes: int) -> None:
    """Refuse, before anything is loaded, a folder that is not whole or was saved by another
    number of processes."""
    completeness.check_complete(folder)
    saved = completeness.saved_by(folder)
    if saved is not None and saved != num_processes:
        raise ValueError(
            f"checkpoint {folder} was saved by {saved} processes and this launch starts {num_processes}: each rank's "
            "data position and random states are its own, so another count would not continue the same run. "
            f"Launch with num_processes={saved} to resume it (or load its weights alone into a new run)")
