"""Hugging Face Accelerate's own ``Accelerator``, kept as it is, under nblaunch's launcher."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")

import torch
from torch.utils.data import DataLoader, TensorDataset

import nblaunch
from nblaunch import notebook_launcher

NUM_EXAMPLES = 32
BATCH = 4


def accelerate_loop():
    from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    dtypes = set()  # what the layer computes in (Accelerate returns fp32 outputs either way)
    model[0].register_forward_hook(lambda module, inputs, output: dtypes.add(str(output.dtype)))
    inputs = torch.arange(NUM_EXAMPLES, dtype=torch.float32).repeat_interleave(4).reshape(NUM_EXAMPLES, 4)
    loader = DataLoader(TensorDataset(inputs, inputs[:, :1] * 0.5), batch_size=BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen, steps = [], 0
    for x, y in loader:
        seen += x[:, 0].int().tolist()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return {
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.name,
        "mixed_precision": accelerator.mixed_precision,
        "steps": steps,
        "seen": seen,
        "dtypes": dtypes,
        "weight": accelerator.unwrap_model(model)[0].weight.detach().clone(),
    }


def check_real_ddp(results, mixed_precision="no"):
    for r in results:
        assert r["num_processes"] == 2 and r["distributed_type"] == "MULTI_CPU"
        assert r["steps"] == NUM_EXAMPLES // BATCH // 2
        assert r["mixed_precision"] == mixed_precision
    shard0, shard1 = set(results[0]["seen"]), set(results[1]["seen"])
    assert not shard0 & shard1 and shard0 | shard1 == set(range(NUM_EXAMPLES))
    torch.testing.assert_close(results[0]["weight"], results[1]["weight"], rtol=0, atol=0)


@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_accelerates_accelerator_trains_with_ddp_on_two_cpu_ranks(start_method):
    results = notebook_launcher(accelerate_loop, num_processes=2, start_method=start_method, display="none")
    check_real_ddp(results)
    assert results[0]["dtypes"] == {"torch.float32"}
    # Its steps go through Accelerate's own pieces: the launch says, once, what would split them.
    steps = nblaunch.last_steps()
    assert not steps.ranks and steps.notes == (
        "the step split needs nblaunch's Accelerator: these ranks trained through accelerate's Accelerator "
        "(transformers' Trainer uses it); `from nblaunch import Accelerator` (the same names and semantics) "
        "measures every step",), str(steps)


def test_bf16_given_to_the_launcher_reaches_accelerates_accelerator():
    results = notebook_launcher(accelerate_loop, num_processes=2, mixed_precision="bf16", display="none")
    check_real_ddp(results, mixed_precision="bf16")
    assert results[0]["dtypes"] == {"torch.bfloat16"}


def test_an_accelerator_made_in_the_kernel_first_does_not_stop_the_ranks_joining():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    Accelerator()  # as a notebook cell would, before the launch; Accelerate's launcher refuses then
    try:
        check_real_ddp(notebook_launcher(accelerate_loop, num_processes=2, display="none"))
        assert AcceleratorState().num_processes == 1  # the kernel's own state is untouched
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_a_one_process_launch_leaves_the_kernels_accelerate_state_as_it_was():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    [result] = notebook_launcher(accelerate_loop, num_processes=1, display="none")
    assert result["num_processes"] == 1 and result["steps"] == NUM_EXAMPLES // BATCH
    assert PartialState._shared_state == {}  # none before, none after
    kernels = Accelerator()  # made in a cell before the launch
    try:
        notebook_launcher(accelerate_loop, num_processes=1, display="none")
        assert kernels.device.type == "cpu" and kernels.num_processes == 1  # still usable
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
