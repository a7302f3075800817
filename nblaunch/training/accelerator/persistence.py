"""The ``Accelerator``'s checkpoints and saving (Accelerate's names), a group of
methods of :class:`~nblaunch.training.accelerator.core.Accelerator`: it reads the prepared
objects, ``state`` and ``project_dir`` that :class:`~nblaunch.training.accelerator.host.AcceleratorHost`
declares, and hands checkpoints a :class:`~nblaunch.training.checkpoint.record.Prepared` record:
the work is done in :mod:`nblaunch.training.checkpoint.files`.

Example::

    accelerator.save_state("ckpt")      # every rank; resumes mid-epoch with load_state("ckpt")
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import torch

from nblaunch.training.accelerator.host import AcceleratorHost
from nblaunch.contract import variables as v
from nblaunch.training.checkpoint import files, naming, resume, single
from nblaunch.training.checkpoint.record import Prepared
from nblaunch.training.runtime.memory import release_memory

__all__ = ["PersistenceMethods"]


class PersistenceMethods(AcceleratorHost):
    """save_state/load_state, save/save_model, freeing what was prepared."""

    def _prepared(self) -> Prepared:
        """What a checkpoint saves: the prepared objects (the lists themselves), scaler, device."""
        return Prepared(self._models, self._optimizers, self._schedulers, self._dataloaders,
                        self._custom_objects, self.scaler, self.device, self._strategy)

    def _checkpoint_dir(self, path: Any, saving: bool) -> str:
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            if path is not None and saving:  # Accelerate ignores it silently; say so
                warnings.warn(f"automatic_checkpoint_naming is on: save_state writes under {config.project_dir}"
                              f"/checkpoints, not {os.fspath(path)}", stacklevel=3)
            if saving:
                target = naming.next_checkpoint(config, self.is_main_process)
                self.wait_for_everyone()  # its parent is made before anyone writes
                return target
            if path is None:
                return naming.latest_checkpoint(config)
        if path is not None:
            return os.fspath(path)
        if self.project_dir is None:
            raise ValueError("give a directory, or Accelerator(project_dir=...)")
        return os.path.join(self.project_dir, "checkpoint")

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **kwargs: Any) -> str:
        """Save models, optimizers, schedulers, scaler, every rank's RNG states and data positions,
        in Accelerate's layout (``safe_serialization=False``: ``pytorch_model.bin``, not safetensors).

        Call it on every process (it ends with a barrier). Returns the directory. Without a
        directory it writes ``project_dir/checkpoint``; with ``ProjectConfiguration(
        automatic_checkpoint_naming=True)``, ``project_dir/checkpoints/checkpoint_<iteration>``,
        keeping the last ``total_limit``.
        """
        return self._save_into(self._checkpoint_dir(output_dir, saving=True), safe_serialization)

    def _save_into(self, directory: str, safe_serialization: bool = True) -> str:
        directory = files.save_state(self._prepared(), directory, self.state, self.gradient_state,
                                     safe_serialization=safe_serialization)
        config = self.project_configuration
        if config.automatic_checkpoint_naming and naming.number_of(directory) == config.iteration:
            config.iteration += 1
            if self.is_main_process:
                naming.prune_before(config, directory)  # only now that it is whole
        return directory

    def _save_at_stop(self, steps: int, announce: Callable[[str], None]) -> str:
        """A launch stopped at a common step (``nblaunch.worker.step_stop``): save there, on every
        rank, where ``resume=True`` finds it (``checkpoint.resume``); returns the folder."""
        folder = resume.stop_folder(self.project_configuration, resume.launch_folder())
        self.wait_for_everyone()  # every rank chose the same numbered folder before any makes it
        if folder is None:
            folder = self._checkpoint_dir(None, saving=True)
        folder = os.path.abspath(folder)
        announce(folder)
        return self._save_into(folder)

    def resume(self) -> str | None:
        """Load now what the launch's ``resume=`` names, and return its folder (None: nothing to
        resume, or loaded already). Without this call it is loaded before the first step; call it
        after ``prepare`` to change something the checkpoint restores, such as the learning rate.

        Example::

            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            if accelerator.resume():                # notebook_launcher(..., resume=True)
                for group in optimizer.param_groups:
                    group["lr"] = lr                # the new learning rate from here on
        """
        asked = os.environ.get(v.RESUME)
        if not asked or self._resumed:
            return None
        folder = resume.to_resume(asked, self.project_configuration, resume.launch_folder())
        if folder is None:
            self._resumed = True
            if self.is_main_process:
                print("nblaunch: resume=True found no checkpoint yet: training starts from the first step",
                      file=sys.stderr)
            return None
        resume.check_resumable(folder, self.num_processes)
        self.load_state(folder)
        if self.is_main_process:
            print(f"nblaunch: resumed from {folder}", file=sys.stderr)
        return folder

    def load_state(self, input_dir: str | os.PathLike | None = None, strict: bool = True, **kwargs: Any) -> None:
        """Restore what :meth:`save_state` wrote; prepared DataLoaders resume mid-epoch. With
        automatic checkpoint naming and no directory, the latest checkpoint, and the next save
        is numbered after it."""
        directory = self._checkpoint_dir(input_dir, saving=False)
        files.load_state(self._prepared(), directory, self.state, self.gradient_state, strict=strict)
        self._resumed = True  # resume= then loads nothing more
        config = self.project_configuration
        loaded = naming.number_of(directory) if config.automatic_checkpoint_naming else None
        if loaded is not None and os.path.realpath(os.path.dirname(os.path.normpath(directory))) == os.path.realpath(
                os.path.join(config.project_dir, "checkpoints")):
            # The next save is numbered after the newest there (Accelerate would start at 0 again and
            # refuse): the loaded one, or a newer one not loaded (a save a dying kernel left unfinished).
            config.iteration = max(config.iteration, naming.number_after_the_newest(config))

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save/load these objects (each needs ``state_dict`` and ``load_state_dict``)."""
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"{type(obj).__name__} has no state_dict/load_state_dict")
            self._custom_objects.append(obj)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The model's state dict, unwrapped. For a model spread over the ranks (FSDP, ZeRO-3,
        tensor parallel): the whole weights on the CPU of the main process, an empty dict on the
        others; call it on every process."""
        whole = self._strategy.full_state_dict(model)
        if whole is not None:
            return whole
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors) on the main process only; call it on every process
        (on XLA tensors are copied to the CPU first, ``xm.save``'s way)."""
        single.save(obj, f, safe_serialization=safe_serialization)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike,
                   max_shard_size: Any = None, safe_serialization: bool = True) -> str:
        """Write the unwrapped model's weights (main process): ``model.safetensors`` when
        ``safetensors`` is installed and asked for, else ``pytorch_model.bin``. Returns the path."""
        save_directory = os.fspath(save_directory)
        state_dict = self.get_state_dict(model)
        save = files.host_saver(self.state)
        save_file = None
        if safe_serialization:
            try:  # optional: safetensors
                from safetensors.torch import save_file
            except ImportError:
                warnings.warn("safetensors is not installed: writing pytorch_model.bin", stacklevel=2)
        if save_file is not None:
            path = os.path.join(save_directory, "model.safetensors")
        else:
            path = os.path.join(save_directory, "pytorch_model.bin")
        if self.is_main_process:
            os.makedirs(save_directory, exist_ok=True)
            if save_file is not None:
                save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, path,
                          metadata={"format": "pt"})
            else:
                save(state_dict, path)
        self.wait_for_everyone()
        return path

    def free_memory(self, *objects: Any) -> tuple:
        """Drop references to everything prepared (and empty the CUDA cache)."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._custom_objects.clear()
        self._replaced_parameters.clear()
        self._accumulate_context = None
        self._strategy.release()  # DeepSpeed's engine goes; a next prepare makes a new one
        release_memory()
        return tuple(None for _ in objects)

    clear = free_memory
