"""Intra-op threads per worker, so N workers do not oversubscribe the machine's cores."""

from __future__ import annotations

import os

from nblaunch.contract.variables import MKL_NUM_THREADS, OMP_NUM_THREADS

# Variables a user sets to choose thread counts; if any is set, we leave threads alone.
THREAD_VARIABLES = (OMP_NUM_THREADS, MKL_NUM_THREADS)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(num_processes: int) -> int | None:
    """Each worker's share of the cores, or None when the user chose thread counts themselves."""
    if any(name in os.environ for name in THREAD_VARIABLES):
        return None
    return max(1, usable_cores() // num_processes)
