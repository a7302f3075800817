"""Issue 31, item 2: one rank on the GPU as a real launch (a process of its own, not the test's).

The Accelerator places the model, the optimizer's state and every prepared batch on the rank's
GPU; the process group is NCCL (the rank's own ``init_process_group("nccl")`` adopted by the
Accelerator, and the group warm ranks form by themselves); ``gather``, ``reduce``, ``broadcast``
and ``pad_across_processes`` take and return CUDA tensors. With one rank nblaunch's collectives
return their input (as Accelerate's do), so the NCCL group is also used directly.
Accelerate's own Accelerator runs in the same kind of rank, for comparison.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gpu_common import GPU_MARKS
from nblaunch import WarmRanks, notebook_launcher

pytestmark = GPU_MARKS


def placed(library: str, own_group: bool) -> dict:
    """Prepare a model, an AdamW and a loader, take two steps; say where everything lives."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    if own_group:  # what scripts written for torchrun do first; the Accelerator adopts the group
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    if library == "accelerate":
        from accelerate import Accelerator
    else:
        from nblaunch import Accelerator
    accelerator = Accelerator()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    batch_devices = set()
    for step, (x, y) in enumerate(loader):
        batch_devices |= {str(x.device), str(y.device)}
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            break
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "device": str(accelerator.device),
        "parameters": sorted({str(p.device) for p in model.parameters()}),
        "optimizer_state": sorted({str(v.device) for v in state}),
        "batches": sorted(batch_devices),
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "group_backend": dist.get_backend() if dist.is_initialized() else None,
        "wrapped": type(model).__name__,
        "loss": float(loss),
    }


def collectives() -> dict:
    """nblaunch's collectives on CUDA tensors, then an all_reduce through the NCCL group itself."""
    import torch.distributed as dist

    from nblaunch import Accelerator
    from nblaunch.utils import broadcast, gather, pad_across_processes, reduce

    accelerator = Accelerator()
    t = torch.arange(4.0, device=accelerator.device)
    out = {
        "gather": gather(t), "reduce": reduce(t, "sum"), "broadcast": broadcast(t),
        "pad": pad_across_processes(t[:3], dim=0), "accelerator_gather": accelerator.gather(t),
        "accelerator_reduce": accelerator.reduce(t, "mean"),
    }
    summed = t.clone()
    dist.all_reduce(summed)  # NCCL, on the GPU
    torch.cuda.synchronize()
    return {
        "backend": dist.get_backend(), "device": str(accelerator.device), "world": dist.get_world_size(),
        "adopted": accelerator.state.backend,
        "devices": {k: str(v.device) for k, v in out.items()},
        "values": {k: v.cpu().tolist() for k, v in out.items()}, "all_reduce": summed.cpu().tolist(),
    }


def own_group_then_collectives() -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", device_id=device)
    return collectives()


@pytest.mark.parametrize("own_group", [False, True], ids=["no-group", "own-nccl-group"])
def test_one_rank_places_model_optimizer_state_and_batches_on_the_gpu(own_group, record_property):
    [ours] = notebook_launcher(placed, args=("nblaunch", own_group), num_processes=1, display="none", timeout=180)
    assert ours["device"] == "cuda:0"
    assert ours["parameters"] == ours["optimizer_state"] == ours["batches"] == ["cuda:0"], ours
    assert ours["group_backend"] == ("nccl" if own_group else None)
    record_property("nblaunch", repr(ours))
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: nothing to compare with")
    [theirs] = notebook_launcher(placed, args=("accelerate", own_group), num_processes=1, display="none", timeout=180)
    record_property("accelerate", repr(theirs))
    assert theirs["parameters"] == theirs["optimizer_state"] == theirs["batches"] == ["cuda:0"], theirs
    # Same seed, data and steps in fp32 (no TF32 by default): the same kernels, up to DDP's copy of
    # the gradients in Accelerate's world of one.
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


def test_collectives_take_and_give_cuda_tensors_through_an_nccl_group():
    [result] = notebook_launcher(own_group_then_collectives, num_processes=1, display="none", timeout=180)
    assert result["backend"] == result["adopted"] == "nccl" and result["world"] == 1
    assert set(result["devices"].values()) == {"cuda:0"}, result["devices"]
    values = result["values"]
    assert values["gather"] == values["reduce"] == values["broadcast"] == values["accelerator_gather"] == [0, 1, 2, 3]
    assert values["accelerator_reduce"] == [0, 1, 2, 3] and values["pad"] == [0, 1, 2]
    assert result["all_reduce"] == [0, 1, 2, 3]


def test_warm_ranks_form_an_nccl_group_on_the_gpu_and_the_accelerator_adopts_it():
    with WarmRanks(num_processes=1, display="none") as ranks:
        [result] = ranks.run(collectives, timeout=180)
    assert result["backend"] == result["adopted"] == "nccl" and result["device"] == "cuda:0"
    assert set(result["devices"].values()) == {"cuda:0"}
    assert result["all_reduce"] == [0, 1, 2, 3]


class _SeesItsGpu:
    """A display that keeps what a rank's row would show, and lets the rank go once NVML named it."""

    def __init__(self, flag: str) -> None:
        self.flag, self.devices, self.usages = flag, [], []

    def on_event(self, event) -> None:
        from nblaunch.events import GpuUsage, RankDevice

        if isinstance(event, RankDevice):
            self.devices.append(event)
        elif isinstance(event, GpuUsage):
            self.usages.append(event)
            if event.own_memory:
                open(self.flag, "w").close()

    def close(self) -> None:
        pass


def holds_memory_until_seen(flag: str) -> int:
    import os
    import time

    from nblaunch import Accelerator

    accelerator = Accelerator(mixed_precision="auto")
    held = torch.empty(256 << 20, dtype=torch.uint8, device=accelerator.device)  # 256 MiB
    deadline = time.monotonic() + 60  # a backstop: the launcher samples every 2 s
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held.numel()


def test_the_ranks_row_shows_its_device_precision_and_its_gpus_memory(tmp_path, record_property):
    seen = _SeesItsGpu(str(tmp_path / "seen"))
    notebook_launcher(holds_memory_until_seen, args=(seen.flag,), num_processes=1, display=seen, timeout=120)
    [device] = seen.devices
    own = [u for u in seen.usages if u.own_memory]
    record_property("row", f"{device.device} · {device.precision} | {own[0].line if own else seen.usages}")
    assert device.device == "cuda:0" and device.precision in ("bf16", "fp16")
    assert own and own[0].memory_used >= 256 << 20 and own[0].memory_total > own[0].memory_used
