"""nblaunch: a notebook-first distributed launcher for PyTorch.

Example::

    from nblaunch import notebook_launcher, Accelerator

    def train():
        accelerator = Accelerator()
        ...
        return accelerator.process_index

    notebook_launcher(train, num_processes=2)   # [0, 1]
"""

from nblaunch.launch.api import Launch, debug_launcher, notebook_launcher
from nblaunch.launch.errors import (
    LaunchConfigError,
    LaunchTimeoutError,
    RankFailedError,
    RankFailure,
    LaunchCancelledError,
    LaunchInterrupted,
    RemoteError,
)
from nblaunch.worker.progress import progress

__version__ = "0.1.0"

# The training side (torch.nn, DDP, ...) loads on first use, not when the launcher is imported.
_TRAINING_NAMES = {
    "Accelerator", "PartialState", "GradientState", "DistributedType", "set_seed", "skip_first_batches",
    # Accelerate's configuration classes, so scripts that import them keep working
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradScalerKwargs",
    "GradientAccumulationPlugin", "AutocastKwargs", "InitProcessGroupKwargs", "ProfileKwargs",
    "DDPCommunicationHookType", "AcceleratorState", "prepare_data_loader", "SeedableRandomSampler",
    "DataLoaderDispatcher", "LocalSGD",
}


def __getattr__(name: str):
    if name in _TRAINING_NAMES:
        import nblaunch.training

        return getattr(nblaunch.training, name)
    raise AttributeError(f"module 'nblaunch' has no attribute {name!r}")


__all__ = [
    "notebook_launcher",
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
    "AcceleratorState",
    "prepare_data_loader",
    "SeedableRandomSampler",
    "DataLoaderDispatcher",
    "LocalSGD",
    "debug_launcher",
    "Launch",
    "progress",
    "LaunchCancelledError",
    "LaunchInterrupted",
    "LaunchConfigError",
    "LaunchTimeoutError",
    "RankFailedError",
    "RankFailure",
    "RemoteError",
]
