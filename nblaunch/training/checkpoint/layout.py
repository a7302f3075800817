"""Accelerate's checkpoint layout: the names of the files ``save_state`` writes and reads, and the
two formats that need translating, the weights files and the per-rank random states.

The names are Accelerate 1.x's (``accelerate/utils/constants.py``), so either tool's
``load_state`` reads the other's checkpoint. What nblaunch keeps beyond Accelerate's files (the
exact data position of every prepared DataLoader) is in ``nblaunch_positions_{rank}.pkl``, which
Accelerate never looks at.

Example::

    weights_name(1, safe=True)            # 'model_1.safetensors'
    states = random_states(get_rng_states(), step=0)
    torch.save(states, os.path.join(ckpt, random_states_name(rank)))   # Accelerate's format
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable

import torch

__all__ = ["weights_name", "optimizer_name", "scheduler_name", "custom_name", "random_states_name",
           "positions_name", "CUSTOM_PATTERN", "ACCELERATE_NAMES",
           "ACCELERATE_POSITION_PATTERN",
           "write_weights", "read_weights", "load_weights", "random_states", "from_random_states"]

# Accelerate's names for them (accelerate.utils' constants, which nblaunch.utils re-exports).
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
RNG_STATE_NAME = "random_states"
SCALER_NAME = "scaler.pt"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
WEIGHTS_PATTERN_NAME = MODEL_NAME + "{suffix}.bin"
SAFE_WEIGHTS_PATTERN_NAME = SAFE_MODEL_NAME + "{suffix}.safetensors"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
ACCELERATE_NAMES = ["MODEL_NAME", "SAFE_MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME",
                    "RNG_STATE_NAME", "SCALER_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME",
                    "SAFE_WEIGHTS_INDEX_NAME", "WEIGHTS_PATTERN_NAME", "SAFE_WEIGHTS_PATTERN_NAME",
                    "PROFILE_PATTERN_NAME"]
__all__ += ACCELERATE_NAMES
CUSTOM_PATTERN = r"^custom_checkpoint_\d+\.pkl$"  # how Accelerate counts registered objects' files
# Data positions of Accelerate's (a StatefulDataLoader's state, a pickled seedable sampler), not read
ACCELERATE_POSITION_PATTERN = r"^(dl_state_dict|sampler)(_\d+)?\.bin$"


def _indexed(stem: str, i: int, ext: str) -> str:
    return f"{stem}.{ext}" if i == 0 else f"{stem}_{i}.{ext}"


def weights_name(i: int, safe: bool) -> str:
    """The i-th model's whole weights: ``model.safetensors`` or ``pytorch_model.bin`` (then ``_1``...)."""
    return _indexed(SAFE_MODEL_NAME, i, "safetensors") if safe else _indexed(MODEL_NAME, i, "bin")


def optimizer_name(i: int) -> str:
    return _indexed(OPTIMIZER_NAME, i, "bin")


def scheduler_name(i: int) -> str:
    return _indexed(SCHEDULER_NAME, i, "bin")


def custom_name(i: int) -> str:
    return f"custom_checkpoint_{i}.pkl"


def random_states_name(rank: int) -> str:
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def positions_name(rank: int) -> str:
    """nblaunch's own per-rank file: where each prepared DataLoader is (Accelerate ignores it)."""
    return f"nblaunch_positions_{rank}.pkl"


# -- whole weights --------------------------------------------------------------------------------

def write_weights(state_dict: dict[str, Any], output_dir: str, i: int, save: Callable[[Any, Any], None],
                  safe_serialization: bool = True) -> str:
    """Write the i-th model's ``state_dict`` as Accelerate's ``save_state`` does: safetensors when
    asked for and possible (safetensors installed, every value a tensor), else ``save`` (torch.save,
    or :func:`~nblaunch.training.checkpoint.files.host_saver`'s on XLA) to ``pytorch_model.bin``.
    Tensors sharing memory (tied weights) are written once, under the first name. Returns the path.
    """
    save_file = _safetensors_save_file() if safe_serialization else None
    if save_file is not None and all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        path = os.path.join(output_dir, weights_name(i, safe=True))
        save_file(_one_copy_of_each(state_dict), path, metadata={"format": "pt"})
        return path
    path = os.path.join(output_dir, weights_name(i, safe=False))
    save(state_dict, path)
    return path


def _safetensors_save_file() -> Callable[..., None] | None:
    try:
        from safetensors.torch import save_file  # deferred: an optional dependency
    except ImportError:
        return None
    return save_file


def _one_copy_of_each(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors, an alias of an earlier one (same memory, same view) left out:
    safetensors refuses shared memory, and loading puts aliases back from the model's own ties."""
    seen: set[tuple] = set()
    storages: set[int] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        tensor = tensor.detach().cpu().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in storages:
            tensor = tensor.clone()  # another view of the same memory: its own copy
        storages.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def read_weights(input_dir: str, i: int) -> dict[str, torch.Tensor] | None:
    """The i-th model's whole weights from ``model[_i].safetensors`` or ``pytorch_model[_i].bin``;
    None when there are neither."""
    safe = os.path.join(input_dir, weights_name(i, safe=True))
    if os.path.exists(safe):
        try:
            from safetensors.torch import load_file  # deferred: an optional dependency
        except ImportError:
            raise ImportError(f"{safe} is a safetensors file: pip install safetensors to load it") from None
        return load_file(safe, device="cpu")
    pickled = os.path.join(input_dir, weights_name(i, safe=False))
    if os.path.exists(pickled):
        return torch.load(pickled, map_location="cpu", weights_only=False)
    return None


def load_weights(model: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
    """Load whole weights into the plain (unwrapped) ``model``, tied weights that were written
    once filled in from their twin. Returns ``load_state_dict``'s result."""
    weights = dict(state_dict)
    _fill_tied(weights, model)
    return model.load_state_dict(weights, strict=strict)


def _fill_tied(state_dict: dict[str, Any], model: torch.nn.Module) -> None:
    """Give the names the file left out (another name of a tied parameter or buffer) their twin's
    value. Ties are found by identity: XLA tensors have no storage to compare."""
    expected = model.state_dict().keys()
    names_of: dict[int, list[str]] = {}
    for name, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                        model.named_buffers(remove_duplicate=False)):
        names_of.setdefault(id(tensor), []).append(name)
    for names in names_of.values():
        present = [n for n in names if n in state_dict]
        for name in names:
            if present and name in expected and name not in state_dict:
                state_dict[name] = state_dict[present[0]]


# -- random states --------------------------------------------------------------------------------

# get_rng_states' names -> the keys of Accelerate's random_states_{rank}.pkl
_RNG_KEYS = {"python": "random_state", "numpy": "numpy_random_seed", "torch": "torch_manual_seed",
             "cuda": "torch_cuda_manual_seed", "xla": "xm_seed"}


def random_states(rng: dict[str, Any], step: int) -> dict[str, Any]:
    """Accelerate's ``random_states_{rank}.pkl`` content (write it with ``torch.save``) from
    :func:`~nblaunch.training.runtime.seed.get_rng_states`' dict and the micro-steps counted
    towards the next gradient sync (Accelerate's ``step``: only its remainder matters)."""
    states: dict[str, Any] = {"step": step}
    states.update({theirs: rng[ours] for ours, theirs in _RNG_KEYS.items() if ours in rng})
    return states


def from_random_states(states: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The other way: (``set_rng_states``' dict, ``step``). Accelerate's total count of
    micro-steps is given back as it is; its remainder is the place in the accumulation window."""
    rng = {ours: states[theirs] for ours, theirs in _RNG_KEYS.items() if theirs in states}
    return rng, int(states.get("step", 0))
