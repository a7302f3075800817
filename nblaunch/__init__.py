"""nblaunch: a notebook-first distributed launcher for PyTorch.

Example::

    from nblaunch import notebook_launcher, Accelerator

    def train():
        accelerator = Accelerator()
        ...
        return accelerator.process_index

    notebook_launcher(train, num_processes=2)   # [0, 1]

    ranks = WarmRanks(num_processes=2)          # or, in a notebook: %load_ext nblaunch, %%distributed
    ranks.run(train)                            # [0, 1], on ranks that stay up for the next call
"""

from nblaunch.api import Launch, attach, debug, debug_launcher, last_steps, launches, notebook_launcher, preloaded
from nblaunch.detached.detached_launch import DetachedLaunch, LaunchLostError
from nblaunch.contract.failure import RankFailure, RemoteError
from nblaunch.contract.version import __version__
from nblaunch.launch.errors import (
    LaunchCancelledError,
    LaunchConfigError,
    LaunchInterrupted,
    LaunchTimeoutError,
    RankFailedError,
)
from nblaunch.launch.planning import cuda_culprit
from nblaunch.launch.planning.devices import cuda_device_count
from nblaunch.launch.starting.server_starter import start_early
from nblaunch.warm.ranks import WarmRanks
from nblaunch.worker.progress import progress

cuda_culprit.watch()  # so a launch after CUDA was initialised can name the line that did it
start_early()  # in a notebook that started CUDA: the launch server, before the first launch needs it

# The training side (torch.nn, DDP, ...) loads on first use, not when the launcher is imported.
_TRAINING_NAMES = {
    "Accelerator", "PartialState", "GradientState", "DistributedType", "set_seed", "skip_first_batches",
    # Accelerate's configuration classes, so scripts that import them keep working
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradScalerKwargs",
    "GradientAccumulationPlugin", "AutocastKwargs", "InitProcessGroupKwargs", "ProfileKwargs",
    "DDPCommunicationHookType", "AcceleratorState", "prepare_data_loader", "SeedableRandomSampler",
    "DataLoaderDispatcher", "LocalSGD", "FullyShardedDataParallelPlugin", "reset_process_state",
    "ParallelismConfig",
}


def gpu_count() -> int:
    """The GPUs a launch here would give a rank each (``CUDA_VISIBLE_DEVICES`` respected).

    Counted through NVML, without starting CUDA in this process, so a launch after it can still
    fork. ``num_processes=None`` uses the same count (or 2 CPU ranks where it is 0).

    Example::

        >>> num_processes = nblaunch.gpu_count() or 2   # one rank per GPU, or 2 on the CPU
    """
    return cuda_device_count()


def load_ipython_extension(ipython) -> None:
    """``%load_ext nblaunch``: the ``%%distributed`` cell magic (see nblaunch.warm.magic)."""
    from nblaunch.warm.magic import load_ipython_extension as load  # deferred: IPython's magics, for %load_ext only

    load(ipython)


def __getattr__(name: str):
    if name in _TRAINING_NAMES:
        import nblaunch.training  # deferred: torch.nn and DDP, loaded on first use

        return getattr(nblaunch.training, name)
    raise AttributeError(f"module 'nblaunch' has no attribute {name!r}")


__all__ = [
    "__version__",
    "notebook_launcher",
    "launches",
    "attach",
    "last_steps",
    "preloaded",
    "DetachedLaunch",
    "LaunchLostError",
    "gpu_count",
    "Accelerator",
    "PartialState",
    "GradientState",
    "DistributedType",
    "set_seed",
    "skip_first_batches",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "AutocastKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "DDPCommunicationHookType",
    "FullyShardedDataParallelPlugin",
    "ParallelismConfig",
    "reset_process_state",
    "AcceleratorState",
    "prepare_data_loader",
    "SeedableRandomSampler",
    "DataLoaderDispatcher",
    "LocalSGD",
    "debug_launcher",
    "debug",
    "Launch",
    "WarmRanks",
    "progress",
    "LaunchCancelledError",
    "LaunchInterrupted",
    "LaunchConfigError",
    "LaunchTimeoutError",
    "RankFailedError",
    "RankFailure",
    "RemoteError",
]
