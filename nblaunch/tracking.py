"""Accelerate's ``accelerate.tracking`` names: the trackers ``Accelerator(log_with=...)`` opens,
and ``GeneralTracker`` for a tracker of your own.

Port by replacing ``accelerate.tracking`` with ``nblaunch.tracking``::

    from nblaunch.tracking import GeneralTracker, TensorBoardTracker

    accelerator = Accelerator(log_with=[TensorBoardTracker("digits", "runs", flush_secs=5)])
"""

from __future__ import annotations

from nblaunch.training.tracking.backends import MLflowTracker, TensorBoardTracker, TrackioTracker, WandBTracker
from nblaunch.training.tracking.general_tracker import GeneralTracker, LoggerType
from nblaunch.training.tracking.choose import available_trackers

__all__ = ["GeneralTracker", "LoggerType", "TensorBoardTracker", "WandBTracker", "MLflowTracker", "TrackioTracker",
           "get_available_trackers"]

get_available_trackers = available_trackers
