"""The Accelerator on XLA devices, in real launches (torch_xla's xmp.spawn, PJRT_DEVICE=CPU).

XLA's CPU client runs collectives with one device and aborts them with two, so everything with
collectives (training, gather, barriers, checkpoints) runs on one device, and two devices show
the per-thread state without collectives.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from nblaunch import RankFailedError, notebook_launcher
from nblaunch.events import Metrics


def launch(function, *args, recorder="none", **kwargs):
    return notebook_launcher(function, args=args, start_method="xla", display=recorder, **kwargs)


def regression_loader(batch_size=8, samples=64):
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 0.25
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def train(epochs):
    """An Accelerate-style loop, unchanged; the optimizer is made before prepare on purpose.
    Mixed precision comes from the launcher's ``mixed_precision=``."""
    from nblaunch.training import Accelerator, set_seed

    set_seed(0)
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, regression_loader(), scheduler)
    dtypes = set()
    # The layer's output, inside autocast (the model's own output is made fp32 again).
    model[0].register_forward_hook(lambda module, inputs, output: dtypes.add(str(output.dtype)))
    losses = []
    for _ in range(epochs):
        total = 0.0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total += loss.item()
        losses.append(total / len(loader))
        accelerator.log({"loss": losses[-1]})
    return {
        "losses": losses,
        "type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "batch_device": str(x.device),
        "ranks": (accelerator.process_index, accelerator.local_process_index, accelerator.num_processes),
        "model": type(model).__name__,
        "optimizer_on": {str(p.device) for g in optimizer.param_groups for p in g["params"]},
        "dtypes": dtypes,
        "mixed_precision": accelerator.mixed_precision,
    }


def test_a_plain_training_loop_trains_on_the_xla_device(recorder):
    [result] = launch(train, 8, recorder=recorder)
    assert result["type"] == "XLA" and result["ranks"] == (0, 0, 1)
    assert result["device"] == result["batch_device"] == "xla:0"
    assert result["model"] == "Sequential"  # no DDP on XLA
    assert result["optimizer_on"] == {"xla:0"}  # switched to the moved parameters
    losses = result["losses"]
    assert losses[-1] < losses[0] / 20, losses
    assert [m.values["loss"] for m in recorder.of(Metrics)] == pytest.approx(losses)


def test_bf16_autocasts_on_the_device_and_trains():
    [result] = launch(train, 8, mixed_precision="bf16")
    assert result["mixed_precision"] == "bf16" and result["dtypes"] == {"torch.bfloat16"}
    losses = result["losses"]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] / 10, losses


def ask_for_fp16():
    from nblaunch.training import Accelerator

    Accelerator(mixed_precision="fp16")


def test_fp16_is_refused_clearly():
    with pytest.raises(RankFailedError) as info:
        launch(ask_for_fp16)
    assert "'fp16' is not supported on XLA devices" in str(info.value.__cause__)


def collectives():
    from torch.utils.data import DataLoader

    from nblaunch.training import Accelerator

    accelerator = Accelerator()
    device = accelerator.device
    out = {}
    out["gather"] = accelerator.gather(torch.tensor([3, 4], device=device)).cpu().tolist()
    out["gather_0d"] = accelerator.gather(torch.tensor(7.0, device=device)).cpu().tolist()
    out["reduce_sum"] = accelerator.reduce(torch.tensor([1.0, 2.0], device=device)).cpu().tolist()
    out["reduce_mean"] = accelerator.reduce(torch.tensor([4.0], device=device), "mean").cpu().tolist()
    out["broadcast"] = accelerator.broadcast(torch.tensor([5.0], device=device)).cpu().tolist()
    out["padded"] = accelerator.pad_across_processes(torch.ones(2, 3, device=device), dim=1).shape
    out["gather_object"] = accelerator.gather_object(["a"])
    accelerator.wait_for_everyone()
    with accelerator.main_process_first():
        out["first"] = True
    accelerator.set_trigger()
    out["trigger"] = accelerator.check_trigger()
    loader = accelerator.prepare(DataLoader(torch.arange(10.0), batch_size=4))
    seen = [accelerator.gather_for_metrics(batch).cpu().tolist() for batch in loader]
    out["metrics"] = seen
    accelerator.print("printed by", accelerator.process_index)
    return out


def test_collectives_and_barriers_go_through_xla(recorder):
    [out] = launch(collectives, recorder=recorder)
    assert out == {
        "gather": [3, 4], "gather_0d": [7.0], "reduce_sum": [1.0, 2.0], "reduce_mean": [4.0],
        "broadcast": [5.0], "padded": (2, 3), "gather_object": ["a"], "first": True, "trigger": True,
        "metrics": [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]],
    }
    assert recorder.lines(0) == ["printed by 0"]


def save_and_resume(directory):
    """Train 3 steps, save, train 3 more; load, train the same 3 again: they must match."""
    from nblaunch.training import Accelerator, set_seed

    set_seed(1)
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, regression_loader(batch_size=4))

    def steps(batches, count):
        losses = []
        for _, (x, y) in zip(range(count), batches):
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    epoch = iter(loader)
    steps(epoch, 3)
    accelerator.save_state(directory)
    after_save = steps(epoch, 3)
    accelerator.load_state(directory)
    after_load = steps(iter(loader), 3)  # the loader resumes the saved epoch at batch 3
    return after_save, after_load


def test_save_state_and_load_state_round_trip(tmp_path):
    [(after_save, after_load)] = launch(save_and_resume, str(tmp_path))
    assert after_load == after_save  # weights, Adam moments, data position and dropout RNG restored
    try:  # Accelerate's layout: safetensors when it is installed (the XLA lane may not have it)
        from safetensors.torch import load_file
        weights_file, weights = "model.safetensors", load_file(tmp_path / "model.safetensors")
    except ImportError:
        weights_file, weights = "pytorch_model.bin", torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert {t.device.type for t in weights.values()} == {"cpu"}  # loadable without torch_xla
    moments = torch.load(tmp_path / "optimizer.bin", weights_only=True)["state"][0]["exp_avg"]
    assert moments.device.type == "cpu"
    assert sorted(os.listdir(tmp_path)) == sorted([weights_file, "nblaunch_complete.json", "nblaunch_positions_0.pkl",
                                                   "optimizer.bin", "random_states_0.pkl"])


def who_am_i():
    from torch.utils.data import DataLoader

    from nblaunch.training import Accelerator, PartialState

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    model[1].weight = model[0].weight  # tied, like a language model's embedding and head
    model = accelerator.prepare(model)
    # A sequential sampler needs no shared seed: no collective, which two CPU devices cannot run.
    loader = accelerator.prepare(DataLoader(torch.arange(8), batch_size=2, shuffle=False))
    accelerator.print("main says hi")
    return {
        "ranks": (accelerator.process_index, accelerator.local_process_index, accelerator.num_processes),
        "device": str(accelerator.device),
        "model_device": str(next(model.parameters()).device),
        "still_tied": model[1].weight is model[0].weight,
        "main": accelerator.is_main_process,
        "state": id(PartialState().__dict__),
        "same_state_in_thread": PartialState().__dict__ is accelerator.state.__dict__,
        "batches": [b.cpu().tolist() for b in loader],
        "pid": os.getpid(),
    }


def test_two_devices_in_one_process_are_two_ranks_with_their_own_state(recorder, monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    first, second = launch(who_am_i, recorder=recorder)
    assert first["pid"] == second["pid"]  # two threads of one process...
    assert first["state"] != second["state"]  # ...each with its own state
    assert first["same_state_in_thread"] and second["same_state_in_thread"]
    assert (first["ranks"], second["ranks"]) == ((0, 0, 2), (1, 1, 2))
    assert (first["device"], second["device"]) == ("xla:0", "xla:1")
    assert (first["model_device"], second["model_device"]) == ("xla:0", "xla:1")
    assert first["still_tied"] and second["still_tied"]
    assert (first["main"], second["main"]) == (True, False)
    assert first["batches"] == [[0, 1], [4, 5]] and second["batches"] == [[2, 3], [6, 7]]
    assert recorder.lines(0) == ["main says hi"] and recorder.lines(1) == []
