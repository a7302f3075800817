"""Accelerate's ``accelerate.logging.get_logger``: a logger for code that runs on every rank,
logging on the main process only unless asked otherwise.

Example::

    logger = get_logger(__name__, log_level="INFO")
    logger.info("once, from the main process")
    logger.info("every rank, in rank order", main_process_only=False, in_order=True)
"""

from __future__ import annotations

import logging
import os
from typing import Any

from nblaunch.contract.variables import ACCELERATE_LOG_LEVEL
from nblaunch.training.runtime.state import PartialState

__all__ = ["get_logger", "MultiProcessAdapter"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logs on the main process only unless ``main_process_only=False``; ``in_order=True``
    makes every rank log in turn."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        if main_process_only or not in_order:
            if not main_process_only or state.is_main_process:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger whose calls take ``main_process_only`` (default True) and ``in_order``.
    ``log_level`` (or ``ACCELERATE_LOG_LEVEL``) sets the level of the underlying logger."""
    level = log_level or os.environ.get(ACCELERATE_LOG_LEVEL)
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
