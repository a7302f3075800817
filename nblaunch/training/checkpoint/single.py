"""``accelerate.utils.save`` and ``load``: one object to one file, written once per run (or
once per node), and read back safely.

Example::

    from nblaunch.utils import load, save
    save(model.state_dict(), "weights.safetensors", safe_serialization=True)  # call on every rank
    state = load("optimizer.bin", map_location="cpu")
"""

from __future__ import annotations

import codecs
from typing import Any, Callable

import torch

from nblaunch.training.checkpoint.files import host_saver
from nblaunch.training.runtime.state import PartialState

__all__ = ["save", "load"]


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Write ``obj`` to ``f`` from the main process, or with ``save_on_each_node`` from the main
    process of each machine (whose disks are not shared). Call it on every process: on XLA each
    runs its pending graph first. ``safe_serialization`` writes a dict of tensors with
    safetensors (which must be installed) instead of ``torch.save``."""
    state = PartialState()
    write = host_saver(state)  # on XLA this runs every rank's pending graph, whichever writer follows
    if safe_serialization:
        write = _safetensors_writer()
    if state.is_local_main_process if save_on_each_node else state.is_main_process:
        write(obj, f)


def _safetensors_writer() -> Callable[[Any, Any], None]:
    try:
        from safetensors.torch import save_file  # deferred: an optional dependency
    except ImportError:
        raise ImportError("save(..., safe_serialization=True) needs safetensors: pip install safetensors, "
                          "or pass safe_serialization=False for torch.save") from None

    def write(obj: Any, f: Any) -> None:
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise TypeError("safe_serialization=True saves a dict of tensors (a state_dict), "
                            f"got {type(obj).__name__}")
        save_file({name: tensor.detach().cpu().contiguous() for name, tensor in obj.items()}, str(f),
                  metadata={"format": "pt"})

    return write


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless told otherwise (tensors, plain Python and
    numpy arrays, nothing that runs code), as Accelerate's ``load`` does."""
    kwargs.setdefault("weights_only", True)
    if not kwargs["weights_only"]:
        return torch.load(f, map_location=map_location, **kwargs)
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(f, map_location=map_location, **kwargs)


def _numpy_globals() -> list[Any]:
    """What an array or a numpy RNG state in a checkpoint needs (RNG states hold numpy arrays)."""
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core  # numpy 2 renamed numpy.core
    dtypes = [getattr(numpy.dtypes, name) for name in dir(numpy.dtypes) if name.endswith("DType")]
    return [core.multiarray._reconstruct, core.multiarray.scalar, numpy.ndarray, numpy.dtype, codecs.encode, *dtypes]
