"""Issue 31, item 3: mixed precision on the GPU, against Accelerate's Accelerator on the same loop.

fp16 runs with CUDA's GradScaler: a step whose gradients hold an inf is skipped (the loop forces
one), the scale backs off, and the scaler's state is saved with ``save_state`` and restored by
``load_state``. bf16 runs under autocast without a scaler. Each library trains the same model on
the same data from the same seed, one rank on the GPU each.

Tolerance: both Accelerators run the same CUDA kernels in the same order (autocast around the
model's forward, the loss outside it, ``scaler.scale(loss).backward()``, unscale, step, update),
so nothing but run-to-run nondeterminism of the kernels could separate them, and the GEMMs of a
small MLP on one GPU are deterministic. The bar is torch's own fp32 default (atol 1e-5, rtol
1.3e-6): about a hundred times finer than one fp16 rounding step (~1e-3 relative) or one bf16
step (~8e-3), so an operation run in another precision or order fails it, while identical
arithmetic passes it. Which steps were skipped and the final scale must agree exactly.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from gpu_common import GPU_MARKS
from nblaunch import notebook_launcher

pytestmark = GPU_MARKS

STEPS = 24
INF_AT = 10  # the step whose loss is made infinite on purpose


def train(library: str, mixed_precision: str, checkpoint: str | None = None) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import set_seed
    else:
        from nblaunch import Accelerator
        from nblaunch.utils import set_seed
    set_seed(0)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 8, 32, generator=g)
    data = TensorDataset(x, torch.tanh(x @ torch.randn(32, 8, generator=g)))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
    forward_dtypes, skipped, losses = set(), [], []
    accelerator.unwrap_model(model)[0].register_forward_hook(lambda m, i, out: forward_dtypes.add(str(out.dtype)))
    for step, (inputs, targets) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(inputs).float(), targets)
        if step == INF_AT and mixed_precision == "fp16":
            loss = loss * float("inf")  # an overflow, as a bad batch would make (bf16 has no scaler to catch it)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if accelerator.optimizer_step_was_skipped:
            skipped.append(step)
    scaler = getattr(accelerator, "scaler", None)
    result = {
        "weights": torch.cat([p.detach().float().flatten().cpu() for p in accelerator.unwrap_model(model).parameters()]),
        "skipped": skipped, "losses": losses, "forward_dtypes": sorted(forward_dtypes),
        "scale": None if scaler is None else float(scaler.get_scale()),
        "device": str(accelerator.device), "mixed_precision": accelerator.mixed_precision,
    }
    if checkpoint:
        accelerator.save_state(checkpoint)
        result["files"] = sorted(os.listdir(checkpoint))
    return result


def resume(checkpoint: str) -> dict:
    """A fresh Accelerator, model and optimizer in a fresh rank, loaded from the checkpoint."""
    from nblaunch import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    default_scale = float(accelerator.scaler.get_scale())
    accelerator.load_state(checkpoint)
    return {"default_scale": default_scale, "scale": float(accelerator.scaler.get_scale()),
            "weights": torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])}


def launch(*args) -> dict:
    return notebook_launcher(train, args=args, num_processes=1, display="none", timeout=180)[0]


def test_fp16_skips_the_inf_step_and_keeps_the_scaler_in_the_checkpoint(tmp_path, record_property):
    checkpoint = str(tmp_path / "checkpoint")
    ours = launch("nblaunch", "fp16", checkpoint)
    assert ours["device"] == "cuda:0" and ours["forward_dtypes"] == ["torch.float16"]
    assert INF_AT in ours["skipped"], ours["skipped"]
    assert ours["scale"] < 65536.0  # backed off at least once from GradScaler's initial scale
    assert "scaler.pt" in ours["files"], ours["files"]
    resumed = notebook_launcher(resume, args=(checkpoint,), num_processes=1, display="none", timeout=180)[0]
    assert resumed["default_scale"] == 65536.0 and resumed["scale"] == ours["scale"]
    torch.testing.assert_close(resumed["weights"], ours["weights"], rtol=0, atol=0)
    record_property("skipped_steps", ours["skipped"])
    record_property("final_scale", ours["scale"])


@pytest.mark.parametrize("mixed_precision, dtype", [("fp16", "torch.float16"), ("bf16", "torch.bfloat16")])
def test_the_same_loop_trains_the_same_as_under_accelerate(mixed_precision, dtype, record_property):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: nothing to compare with")
    ours, theirs = launch("nblaunch", mixed_precision), launch("accelerate", mixed_precision)
    assert ours["forward_dtypes"] == theirs["forward_dtypes"] == [dtype]
    assert ours["skipped"] == theirs["skipped"] and ours["scale"] == theirs["scale"]
    difference = (ours["weights"] - theirs["weights"]).abs().max().item()
    record_property(f"max_weight_difference_{mixed_precision}", difference)
    record_property(f"skipped_{mixed_precision}", ours["skipped"])
    torch.testing.assert_close(ours["weights"], theirs["weights"])  # fp32 defaults: see the module's docstring
    assert ours["losses"][-1] < ours["losses"][0]
