"""Accelerate's memory helpers: ``release_memory`` and ``find_executable_batch_size``, which
retries a function with half the batch size after every out-of-memory error (in a launch of
several ranks, every rank together: ``batch_search``).

Example::

    model, optimizer = release_memory(model, optimizer)   # both None, the CUDA cache emptied
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
from typing import Any, Callable

import torch

from nblaunch.training.runtime.batch_search import BatchSearch
from nblaunch.worker.reports import caused_by_peer

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


def _outcome_of(error: Exception) -> str:
    """How an attempt that raised ends, for the vote: "oom" (retry smaller), "lost" (a collective
    whose peer let go: most likely that peer ran out of memory) or "error" (the user's own)."""
    if _out_of_memory(error):
        return "oom"
    return "lost" if caused_by_peer(error) else "error"


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable:
    """Decorator: call ``function(batch_size, ...)`` from ``starting_batch_size``, halving the
    batch size after each out-of-memory error, as Accelerate's decorator of that name. In a launch
    of several ranks an out-of-memory error on any rank makes every rank retry the same smaller
    size together (no rank waits for ever in a collective, none trains on another size), and the
    cell says the sizes tried.

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
        search = BatchSearch.here()
        if search is not None:
            return _search_together(search, function, args, kwargs)
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

    def _search_together(search: BatchSearch, function: Callable, args: tuple, kwargs: dict) -> Any:
        nonlocal batch_size
        for attempt in itertools.count():
            if batch_size == 0:
                raise RuntimeError("no executable batch size found on every rank: it reached zero")
            search.tried.append(batch_size)
            result, failure, outcome = None, None, "ok"
            try:
                result = function(batch_size, *args, **kwargs)
            except Exception as error:
                failure, outcome = error, _outcome_of(error)
                if outcome == "error":
                    # Raised as without the search, the group kept: this rank's report reaches the
                    # launcher before its connections close, so the launch names this rank, not a
                    # peer that then loses it. Its vote tells peers that they cannot retry.
                    search.leave(attempt)
                    raise
                if outcome == "oom":
                    release_memory()
                search.ran_out()  # a peer waiting on this rank in a collective raises now, and votes
            verdicts = search.vote(attempt, outcome)
            short = sorted(r for r, verdict in verdicts.items() if verdict == "oom")
            if not short or "error" in verdicts.values():
                if failure is not None:
                    raise failure  # this rank lost a peer that raised its own error: nothing to retry
                tried = ", ".join(map(str, search.tried))
                search.say(f"every rank trained with batch size {batch_size} (tried {tried})")
                return result
            failed_at, batch_size = batch_size, shrink()
            search.say(f"out of memory at batch size {failed_at} on rank {', '.join(map(str, short))}: "
                       f"every rank retries with {batch_size}")
            release_memory()
            search.retry_together(attempt)
        raise AssertionError("unreachable")

    return wrapper
