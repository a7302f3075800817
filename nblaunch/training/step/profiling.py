"""``Accelerator.profile``: torch's profiler configured by a ``ProfileKwargs``, each rank's trace
written to ``output_trace_dir/profile_<rank>.json`` (Accelerate's file names).

Example::

    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(output_trace_dir="traces")])
    with accelerator.profile() as prof:
        train_step()
    accelerator.print(prof.key_averages().table(row_limit=5))
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from nblaunch.training.options.kwargs import ProfileKwargs

__all__ = ["build_profiler", "profile"]

_ACTIVITIES = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}


def build_profiler(options: ProfileKwargs) -> torch.profiler.profile:
    """The ``torch.profiler.profile`` that ``options`` describe (its ``activities`` by name)."""
    activities = None
    if options.activities is not None:
        unknown = [a for a in options.activities if a not in _ACTIVITIES]
        if unknown:
            raise ValueError(f"ProfileKwargs(activities=...): unknown {unknown}; use some of {list(_ACTIVITIES)}")
        activities = [_ACTIVITIES[a] for a in options.activities]
    schedule = torch.profiler.schedule(**options.schedule_option) if options.schedule_option else None
    return torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=options.on_trace_ready,
        record_shapes=options.record_shapes, profile_memory=options.profile_memory,
        with_stack=options.with_stack, with_flops=options.with_flops, with_modules=options.with_modules)


@contextlib.contextmanager
def profile(options: ProfileKwargs, process_index: int) -> Iterator[torch.profiler.profile]:
    """Profile the block; afterwards write the Chrome trace if ``options.output_trace_dir`` is set."""
    with build_profiler(options) as profiler:
        yield profiler
    if options.output_trace_dir is not None:
        os.makedirs(options.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(options.output_trace_dir, f"profile_{process_index}.json"))
