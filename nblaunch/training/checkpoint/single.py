"""``accelerate.utils.save``: one object to one file, written once per run (or once per node).

Example::

    from nblaunch.utils import save
    save(model.state_dict(), "weights.safetensors", safe_serialization=True)  # call on every rank
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nblaunch.training.checkpoint.files import host_saver
from nblaunch.training.runtime.state import PartialState

__all__ = ["save"]


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
