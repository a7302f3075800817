"""``Accelerator(log_with=...)`` read into the trackers ``init_trackers`` will open, checked when
the Accelerator is made, so a missing package or directory fails before any training step.

Example::

    choose_trackers(["tensorboard", my_tracker], logging_dir="runs")
    # ["tensorboard", my_tracker]; with "all": every built-in tracker that is installed
"""

from __future__ import annotations

import importlib.util
from enum import Enum
from typing import Any

from nblaunch.training.tracking.backends import BUILT_IN
from nblaunch.training.tracking.general_tracker import LoggerType

__all__ = ["choose_trackers", "is_tracker_object", "available_trackers"]

# Accelerate's trackers nblaunch does not build in: a tracker object brings them.
_BRING_YOUR_OWN = {"aim": "AimTracker", "comet_ml": "CometMLTracker", "clearml": "ClearMLTracker",
                   "dvclive": "DVCLiveTracker", "swanlab": "SwanLabTracker"}


def is_tracker_object(candidate: Any) -> bool:
    """A tracker instance (nblaunch's, Accelerate's or the user's own), not a name."""
    return not isinstance(candidate, str) and all(
        hasattr(candidate, method) for method in ("name", "start", "log", "finish"))


def available_trackers() -> list[LoggerType]:
    """The built-in trackers whose package is installed (what ``log_with="all"`` opens)."""
    return [LoggerType(name) for name, (_, package, _) in BUILT_IN.items() if importlib.util.find_spec(package)]


def choose_trackers(log_with: Any, logging_dir: str | None) -> list[Any]:
    """Names (lower case) and tracker objects, in the order given, without repeats.

    Raises ``ValueError`` for an unknown name or a tracker that needs a directory when there is
    none, ``ImportError`` naming the package to install for a missing backend.
    """
    if log_with is None:
        return []
    wanted = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    chosen: list[Any] = []
    for entry in wanted:
        if is_tracker_object(entry):
            chosen.append(entry)
            continue
        name = _name_of(entry)
        if name == "all":
            chosen.extend(str(tracker) for tracker in available_trackers())
            continue
        if name in _BRING_YOUR_OWN:
            raise ValueError(f"log_with={name!r} is not built into nblaunch: pass a tracker object instead, "
                             f"e.g. log_with=[accelerate.tracking.{_BRING_YOUR_OWN[name]}(...)]")
        if name not in BUILT_IN:
            raise ValueError(f"unknown tracker {entry!r} in log_with: choose from {', '.join(BUILT_IN)}, \"all\", "
                             "or pass a tracker object (a GeneralTracker)")
        tracker_class, package, install = BUILT_IN[name]
        if importlib.util.find_spec(package) is None:
            raise ImportError(f"log_with={name!r} needs the {package} package, which is not installed: {install}")
        if tracker_class.requires_logging_directory and logging_dir is None:
            raise ValueError(f"log_with={name!r} writes files: give Accelerator(project_dir=...) or "
                             "project_config=ProjectConfiguration(logging_dir=...)")
        chosen.append(name)
    unique: list[Any] = []
    for entry in chosen:
        if not any(entry is kept or (isinstance(entry, str) and entry == kept) for kept in unique):
            unique.append(entry)
    return unique


def _name_of(entry: Any) -> str:
    if isinstance(entry, Enum):  # ours or Accelerate's LoggerType
        return str(entry.value).lower()
    if isinstance(entry, str):
        return entry.lower()
    raise TypeError(f"log_with takes tracker names ({', '.join(LoggerType.list())}) or tracker objects, "
                    f"not {type(entry).__name__}")
