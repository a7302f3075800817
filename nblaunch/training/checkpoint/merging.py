"""``merge_fsdp_weights``: a sharded checkpoint's model folder (``pytorch_model_fsdp_0``, written
by every rank through ``torch.distributed.checkpoint``) as one whole weights file, readable
without a process group, as Accelerate's ``merge_fsdp_weights`` (and ``accelerate merge-weights``)
writes it.

Example::

    merge_fsdp_weights("ckpt/pytorch_model_fsdp_0", "merged")   # merged/model.safetensors
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from nblaunch.training.checkpoint.layout import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from nblaunch.training.strategy.sharded_layout import sharded_model_dir
from nblaunch.training.checkpoint.single import save
from nblaunch.training.runtime.state import PartialState

__all__ = ["merge_fsdp_weights"]


def merge_fsdp_weights(checkpoint_dir: str | os.PathLike, output_path: str | os.PathLike,
                       safe_serialization: bool = True, remove_checkpoint_dir: bool = False) -> str:
    """Write the whole model of ``checkpoint_dir`` to ``output_path/model.safetensors`` (or
    ``pytorch_model.bin``) from the main process; call it on every process, or in a plain one.
    Returns the file's path. ``remove_checkpoint_dir`` deletes the sharded folder afterwards."""
    checkpoint_dir, output_path = os.fspath(checkpoint_dir), os.fspath(output_path)
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        inside = os.path.join(checkpoint_dir, sharded_model_dir(0))
        hint = f": pass {inside}, the model's folder" if os.path.isdir(inside) else ""
        raise ValueError(f"{checkpoint_dir} is not a torch.distributed.checkpoint folder{hint}")
    path = os.path.join(output_path, SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME)
    state = PartialState()
    if state.is_main_process:
        weights = _read_whole(checkpoint_dir)
        os.makedirs(output_path, exist_ok=True)
        save(weights, path, safe_serialization=safe_serialization)
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    state.wait_for_everyone()
    return path


def _read_whole(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, whole, on the CPU; a model's keys without their ``model.``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # deferred: heavy

    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(checkpoint_dir, whole)  # needs no process group
        weights = torch.load(whole, map_location="cpu", weights_only=True)
    return weights.get("model", weights)
