"""``get_logger``: Accelerate's ``accelerate.logging.get_logger``, for code that logs from every rank.

Port by replacing ``accelerate.logging`` with ``nblaunch.logging``::

    from nblaunch.logging import get_logger
    logger = get_logger(__name__, log_level="INFO")
    logger.info("once, from the main process")
    logger.info("from every rank", main_process_only=False)
    logger.info("every rank, in rank order", main_process_only=False, in_order=True)
"""

from __future__ import annotations

from nblaunch.training.runtime.logger import MultiProcessAdapter, get_logger

__all__ = ["get_logger", "MultiProcessAdapter"]
