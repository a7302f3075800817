"""Checkpoints are interchangeable with Accelerate's, both ways: a run trained 3 steps under one
tool, saved, and resumed for 3 more under the other ends with the weights of 6 uninterrupted
steps, and sees the batches the uninterrupted run saw.

Real ``accelerate`` under its own launcher (``accelerate.notebook_launcher``, 2 CPU processes, in
a subprocess that runs this file), nblaunch's side under ``nblaunch.notebook_launcher`` (2 CPU
ranks). The resume code is what Accelerate's examples do (``load_state``, then
``skip_first_batches`` for the rest of the interrupted epoch): an Accelerate checkpoint has no
data position, and nblaunch's ``skip_first_batches`` counts from the start of the epoch, so the
same code resumes either checkpoint under either tool.

FSDP: Accelerate 1.15 trains with DDP on the CPU (its plugin is ignored there), so the sharded
part runs nblaunch's FSDP2 and Accelerate's own FSDP checkpoint functions
(``accelerate.utils.fsdp_utils.save_fsdp_model`` / ``load_fsdp_model`` and the optimizer's): each
reads what the other wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys

import pytest

accelerate = pytest.importorskip("accelerate")

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.slow

SAVE_AT, TOTAL = 3, 6  # 4 steps per epoch (16 samples, 2 ranks x 2): saved mid-epoch 0, ends in epoch 1


class Counter:
    """A registered object: the steps done."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def rng_fingerprint() -> tuple:
    """The process's Python, NumPy and torch RNG states, comparable across processes."""
    import numpy as np

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:16]

    return (digest(repr(random.getstate()).encode()), digest(np.random.get_state()[1].tobytes()),
            digest(torch.get_rng_state().numpy().tobytes()))


def train_steps(accelerator, model, optimizer, scheduler, loader, steps: int, seen: list):
    """Two epochs of training from ``steps`` optimizer steps in, resumed as Accelerate's examples
    resume (``skip_first_batches`` for the rest of the interrupted epoch), with either tool's
    Accelerator; yields the count after each step and records every batch's sample ids in ``seen``."""
    start_epoch, skip = divmod(steps, len(loader))
    for epoch in range(start_epoch, 2):
        batches = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for ids, x, y in batches:
            seen.append(ids.tolist())
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            steps += 1
            yield steps


def train(library: str, checkpoint: str, resume: bool) -> dict:
    """Six steps, saving at step 3; or (``resume``) loading that checkpoint and doing the last three.

    A shuffled loader, AdamW, a schedule and a registered counter; the same seed either way (the
    resumed script is the same script)."""
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import set_seed
    else:
        from nblaunch import Accelerator
        from nblaunch.utils import set_seed
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(16, 5, generator=g)
    data = TensorDataset(torch.arange(16), inputs, inputs @ torch.randn(5, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=2, shuffle=True), scheduler)
    result: dict = {"seen": []}
    if resume:
        accelerator.load_state(checkpoint)
        result["loaded"] = {"rng": rng_fingerprint(), "steps": counter.steps, "lr": scheduler.get_last_lr()}
    for steps in train_steps(accelerator, model, optimizer, scheduler, loader, counter.steps, result["seen"]):
        counter.steps = steps  # a registered object: its state is in the checkpoint
        if counter.steps == SAVE_AT and not resume:
            accelerator.save_state(checkpoint)
            result["saved"] = {"rng": rng_fingerprint(), "steps": counter.steps, "lr": scheduler.get_last_lr()}
    result["weights"] = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    result["lr"] = scheduler.get_last_lr()
    return result


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _accelerate_rank(checkpoint: str, resume: bool, out: str) -> None:
    from accelerate import PartialState

    result = train("accelerate", checkpoint, resume)
    torch.save(result, os.path.join(out, f"rank_{PartialState().process_index}.pt"))


def under_accelerate(checkpoint: str, resume: bool, out: str) -> list[dict]:
    """``train`` on 2 CPU processes started by Accelerate's own launcher, in a fresh interpreter
    (Accelerate's launcher forks the calling process). Each rank's result."""
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, __file__, json.dumps([checkpoint, resume, out])]
    # A session of its own: a run that hangs is killed with the ranks Accelerate forked.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    assert process.returncode == 0, stdout[-3000:] + stderr[-6000:]
    return [torch.load(os.path.join(out, f"rank_{r}.pt"), weights_only=False) for r in range(2)]


def under_nblaunch(function, *args) -> list:
    from nblaunch import notebook_launcher

    return notebook_launcher(function, args=args, num_processes=2, cpu=True, display="none")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each tool's first run (saving at step 3) and the other tool's resumed run from it."""
    root = tmp_path_factory.mktemp("interchange")
    by_accelerate, by_nblaunch = str(root / "by_accelerate"), str(root / "by_nblaunch")
    first = {"accelerate": under_accelerate(by_accelerate, False, str(root / "out_first")),
             "nblaunch": under_nblaunch(train, "nblaunch", by_nblaunch, False)}
    files = {"accelerate": sorted(os.listdir(by_accelerate)), "nblaunch": sorted(os.listdir(by_nblaunch))}
    resumed = {"nblaunch": under_nblaunch(train, "nblaunch", by_accelerate, True),
               "accelerate": under_accelerate(by_nblaunch, True, str(root / "out_resumed"))}
    return first, resumed, files


def test_the_two_tools_write_the_same_files(runs):
    _, _, files = runs
    shared = ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
              "random_states_1.pkl", "scheduler.bin"]
    assert files["accelerate"] == shared
    assert files["nblaunch"] == sorted(shared + ["nblaunch_complete.json", "nblaunch_positions_0.pkl",
                                                 "nblaunch_positions_1.pkl"])


def test_uninterrupted_runs_of_both_tools_agree(runs):
    first, _, _ = runs
    for rank in (0, 1):
        ours, theirs = first["nblaunch"][rank], first["accelerate"][rank]
        assert ours["seen"] == theirs["seen"]
        assert ours["lr"] == theirs["lr"]
        assert torch.equal(ours["weights"], theirs["weights"])


@pytest.mark.parametrize("saved_by, resumed_by", [("accelerate", "nblaunch"), ("nblaunch", "accelerate")])
def test_a_run_resumed_by_the_other_tool_ends_as_the_uninterrupted_run(runs, saved_by, resumed_by):
    first, resumed, _ = runs
    for rank in (0, 1):
        before, after = first[saved_by][rank], resumed[resumed_by][rank]
        # what was saved is what was loaded: counter, schedule and every RNG (Python, NumPy, torch)
        assert after["loaded"] == before["saved"], rank
        # the next batches are the uninterrupted run's, and so are the final weights: bit for bit
        # (same seed, same CPU arithmetic, gloo's sum of two tensors is exact in either order)
        assert after["seen"] == before["seen"][SAVE_AT:], rank
        assert after["lr"] == before["lr"]
        assert torch.equal(after["weights"], before["weights"]), (after["weights"] - before["weights"]).abs().max()
    # the resume really depends on where it starts
    assert first[saved_by][0]["seen"][:SAVE_AT] != first[saved_by][0]["seen"][SAVE_AT:]


# -- FSDP: nblaunch's sharded checkpoints and Accelerate's FSDP2 checkpoint functions ----------------

def _local(tensors: dict) -> dict:
    """This rank's shards, as plain tensors."""
    return {name: (t.to_local() if hasattr(t, "to_local") else t).detach().clone() for name, t in tensors.items()}


def _local_state(model, optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    moments = get_optimizer_state_dict(model, optimizer)["state"]
    return _local(model.state_dict()), {name: _local(state) for name, state in moments.items()}


def fsdp_train(ours: str, theirs: str, resume: bool) -> dict:
    """nblaunch's FSDP2 on 2 ranks. First run: six steps; at step 3 nblaunch's ``save_state`` to
    ``ours`` and Accelerate's FSDP writers to ``theirs`` (the sharded model and optimizer only).
    Resumed: ``load_state(theirs)`` and the last three steps; then a fresh sharded model and
    optimizer loaded from ``ours`` by Accelerate's FSDP readers."""
    from accelerate import PartialState as AcceleratePartialState
    from accelerate.utils import FullyShardedDataParallelPlugin as AcceleratePlugin
    from accelerate.utils import fsdp_utils

    from nblaunch import Accelerator
    from nblaunch.utils import FullyShardedDataParallelPlugin, set_seed

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        return model, optimizer

    set_seed(0)
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    AcceleratePartialState()  # Accelerate's logging, used by its FSDP functions, needs it
    theirs_plugin = AcceleratePlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(16, 6, generator=g)
    data = TensorDataset(torch.arange(16), inputs, inputs @ torch.randn(6, 2, generator=g))
    model, optimizer = build()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=2, shuffle=True), scheduler)
    result: dict = {"seen": []}
    steps = 0
    if resume:
        accelerator.load_state(theirs)
        steps = SAVE_AT
    for steps in train_steps(accelerator, model, optimizer, scheduler, loader, steps, result["seen"]):
        if steps == SAVE_AT and not resume:
            accelerator.save_state(ours)
            fsdp_utils.save_fsdp_model(theirs_plugin, accelerator, model, theirs, 0)
            fsdp_utils.save_fsdp_optimizer(theirs_plugin, accelerator, optimizer.optimizer, model, theirs, 0)
            result["at_save"] = _local_state(model, optimizer.optimizer)
    result["weights"] = accelerator.get_state_dict(model)
    if resume:
        fresh, fresh_optimizer = build()
        fresh, fresh_optimizer = accelerator.prepare(fresh, fresh_optimizer)
        fsdp_utils.load_fsdp_model(theirs_plugin, accelerator, fresh, ours, 0)
        fsdp_utils.load_fsdp_optimizer(theirs_plugin, accelerator, fresh_optimizer.optimizer, fresh, ours, 0)
        result["read_by_accelerate"] = _local_state(fresh, fresh_optimizer.optimizer)
    return result


def test_sharded_checkpoints_are_read_by_the_other_tool(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    first = under_nblaunch(fsdp_train, ours, theirs, False)
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(os.listdir(ours))
    assert sorted(os.listdir(theirs)) == ["optimizer_0", "pytorch_model_fsdp_0"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # the same keys ("model.0.weight", ...)
        keys = [set(FileSystemReader(os.path.join(d, folder)).read_metadata().state_dict_metadata) for d in (ours, theirs)]
        assert keys[0] == keys[1] and all(k.startswith(("model.", "optimizer.")) for k in keys[0]), folder
    # merge_fsdp_weights: each folder as one whole file, the same weights whoever wrote the shards
    from safetensors.torch import load_file

    from nblaunch.utils import merge_fsdp_weights

    merged = [load_file(merge_fsdp_weights(os.path.join(d, "pytorch_model_fsdp_0"), str(tmp_path / f"merged_{i}")))
              for i, d in enumerate((ours, theirs))]
    assert sorted(merged[0]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])
    with pytest.raises(ValueError, match="pass .*pytorch_model_fsdp_0, the model's folder"):
        merge_fsdp_weights(ours, str(tmp_path / "merged_wrong"))
    # Accelerate's checkpoint: its sharded folders, and the files both tools write alike
    for name in os.listdir(ours):
        if not name.startswith(("pytorch_model_fsdp_", "optimizer_", "nblaunch_")):
            shutil.copy(os.path.join(ours, name), theirs)
    resumed = under_nblaunch(fsdp_train, ours, theirs, True)
    for rank in (0, 1):
        assert resumed[rank]["seen"] == first[rank]["seen"][SAVE_AT:]
        saved_weights, saved_moments = first[rank]["at_save"]
        read_weights, read_moments = resumed[rank]["read_by_accelerate"]
        assert saved_weights.keys() == read_weights.keys() and saved_moments.keys() == read_moments.keys()
        assert all(torch.equal(saved_weights[k], read_weights[k]) for k in saved_weights)
        for name, state in saved_moments.items():
            assert all(torch.equal(v, read_moments[name][k]) for k, v in state.items()), name
    assert first[0]["weights"].keys() == resumed[0]["weights"].keys()
    for name, value in first[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], value), name


if __name__ == "__main__":  # Accelerate's side: this file run by under_accelerate
    checkpoint, resume, out = json.loads(sys.argv[1])
    accelerate.notebook_launcher(_accelerate_rank, args=(checkpoint, resume, out), num_processes=2,
                                 use_port=_free_port())
