"""Issue 61 on a GPU: a rank's steps are split from CUDA events, read once they completed, never
by synchronising each step (the host's clock would time only the launch of the kernels)."""

from __future__ import annotations

import pytest

from gpu_common import GPU_MARKS
from nblaunch import notebook_launcher

pytestmark = GPU_MARKS

STEPS = 300


def train_counting_waits(steps: int) -> dict:
    """A GPU-bound MLP in bf16 for ``steps`` steps; how often anything waited on a CUDA event."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nblaunch import Accelerator

    waits = [0]
    synchronize = torch.cuda.Event.synchronize

    def counted(event):
        waits[0] += 1
        return synchronize(event)

    torch.cuda.Event.synchronize = counted
    accelerator = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(steps * 64, 2048), torch.randn(steps * 64, 2048))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=64))
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    return {"device": accelerator.device.type, "waits": waits[0]}


def test_a_gpu_ranks_steps_are_split_from_cuda_events_without_a_wait_per_step():
    launch = notebook_launcher(train_counting_waits, args=(STEPS,), num_processes=1, display="none", block=False,
                               timeout=240)
    [done] = launch.result()
    assert done["device"] == "cuda"
    # Events are read once they completed: a wait only past 64 steps unread, and for the last ones.
    assert done["waits"] <= STEPS // 64 + 8, done
    rank = launch.steps[0]
    assert rank.count == STEPS, str(launch.steps)
    assert rank.compute > 0 and rank.optimizer > 0 and rank.communication == 0, str(launch.steps)
    assert rank.compute > rank.optimizer  # a GPU-bound model: its forward and backward are the step
    assert sum(rank.parts().values()) == pytest.approx(rank.step, rel=0.5), str(launch.steps)
