"""Accelerate's memory helpers: ``release_memory`` and ``find_executable_batch_size``, which
retries a function with half the batch size after every out-of-memory error.

Example::

    model, optimizer = release_memory(model, optimizer)   # both None, the CUDA cache emptied
"""

from __future__ import annotations

import functools
import gc
import inspect
from typing import Any, Callable

import torch

__all__ = ["release_memory", "find_executable_batch_size"]


def release_memory(*objects: Any) -> list:
    """Drop references, collect garbage and empty the CUDA cache; returns ``[None] * len(objects)``."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return objects


def _out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and ("out of memory" in text.lower() or "DefaultCPUAllocator" in text))


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable:
    """Decorator: call ``function(batch_size, ...)`` from ``starting_batch_size``, halving the
    batch size after each out-of-memory error, as Accelerate's decorator of that name.

    Example::

        @find_executable_batch_size(starting_batch_size=256)
        def train(batch_size):
            ...
        train()   # no batch_size argument: the decorator supplies it
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    shrink = reduce_batch_size_fn or (lambda: batch_size // 2)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        first = next(iter(inspect.signature(function).parameters), None)
        if args and first is not None and len(args) >= len(inspect.signature(function).parameters):
            raise TypeError(f"{function.__name__} gets its first argument ({first}) from "
                            "find_executable_batch_size: do not pass it")
        while True:
            if batch_size == 0:
                raise RuntimeError("no executable batch size found: it reached zero")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not _out_of_memory(error):
                    raise
                release_memory()
                batch_size = shrink()

    return wrapper
