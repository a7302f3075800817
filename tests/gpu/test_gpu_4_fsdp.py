"""Issue 31, item 4: FSDP2 on CUDA (one rank: world size 1 exercises the path), with a
mixed-precision policy, and a DCP (torch.distributed.checkpoint) checkpoint that resumes exactly.

Two ways in: ``Accelerator(fsdp_plugin=...)`` as Accelerate's users write it, compared with
Accelerate's own Accelerator in the same kind of rank (on a GPU, Accelerate treats a launched
rank as MULTI_GPU even alone, and shards); and a model the user sharded with ``fully_shard``
(bf16 ``MixedPrecisionPolicy``) that nblaunch's Accelerator prepares, saves and loads.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from gpu_common import GPU_MARKS
from nblaunch import notebook_launcher

pytestmark = GPU_MARKS

MICRO_STEPS = 8


class Block(torch.nn.Module):
    """One transformer layer: the unit ``transformer_based_wrap`` shards on its own."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(64, 8))


def train(library: str, sharding: str, stop_after: int | None = None, save_to: str | None = None,
          resume_from: str | None = None) -> dict:
    """``sharding``: "plugin" (the Accelerator shards, bf16) or "by_hand" (``fully_shard`` with a
    bf16 policy, on the rank's own NCCL group). Returns the full weights, dtypes, what was sharded."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
    else:
        from nblaunch import Accelerator
        from nblaunch.utils import FullyShardedDataParallelPlugin, set_seed
    # The math attention kernels: flash attention's backward may sum in any order, and a resumed
    # run must equal the uninterrupted one to the bit.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    set_seed(0)
    if sharding == "plugin":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Block"],
                                                state_dict_type="SHARDED_STATE_DICT")
        accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
        model = build_model()
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        accelerator = Accelerator()
        model = build_model().to(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model[:2]:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(MICRO_STEPS * 4, 6, 64, generator=g),
                         torch.randint(0, 8, (MICRO_STEPS * 4,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    # Not Adam: see tests/training/test_fsdp.py (a zero-gradient bias would amplify rounding noise).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if resume_from:
        accelerator.load_state(resume_from)
    compute = []
    accelerator.unwrap_model(model)[0].layer.linear1.register_forward_pre_hook(
        lambda module, args: compute.append((str(module.weight.dtype), str(args[0].dtype))))
    losses = []
    for micro_step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x).float().mean(dim=1), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if stop_after is not None and micro_step + 1 == stop_after:
            accelerator.save_state(save_to)
            return {"losses": losses, "files": sorted(os.listdir(save_to))}
    weights = {k: v.detach().float().cpu() for k, v in accelerator.get_state_dict(model).items()}
    return {
        "weights": weights, "losses": losses, "compute": compute[0] if compute else None,
        "parameter_types": sorted({type(p).__name__ for p in model.parameters()}),
        "parameter_devices": sorted({str(p.device) for p in model.parameters()}),
        "parameter_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
    }


def launch(*args) -> dict:
    return notebook_launcher(train, args=args, num_processes=1, display="none", timeout=240)[0]


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_the_fsdp_plugin_shards_one_gpu_rank_as_accelerate_does(record_property):
    ours = launch("nblaunch", "plugin")
    record_property("nblaunch", repr({k: v for k, v in ours.items() if k != "weights"}))
    if importlib.util.find_spec("accelerate") is not None:
        theirs = launch("accelerate", "plugin")
        record_property("accelerate", repr({k: v for k, v in theirs.items() if k != "weights"}))
        record_property("max_weight_difference", max_difference(ours["weights"], theirs["weights"]))
        assert ours["parameter_types"] == theirs["parameter_types"], (
            f"nblaunch's FSDP on one GPU rank: {ours['parameter_types']}, {ours['distributed_type']}; "
            f"Accelerate's: {theirs['parameter_types']}, {theirs['distributed_type']}")
    assert ours["parameter_types"] == ["DTensor"] and ours["parameter_devices"] == ["cuda:0"]
    assert ours["compute"] == ("torch.bfloat16", "torch.bfloat16")
    assert ours["parameter_dtypes"] == ["torch.float32"]


def test_a_sharded_model_saves_a_dcp_checkpoint_on_the_gpu_and_resumes_exactly(tmp_path, record_property):
    whole = launch("nblaunch", "by_hand")
    assert whole["parameter_types"] == ["DTensor"] and whole["parameter_devices"] == ["cuda:0"]
    assert whole["compute"] == ("torch.bfloat16", "torch.bfloat16")  # the policy's param_dtype
    checkpoint = str(tmp_path / "checkpoint")
    first = launch("nblaunch", "by_hand", MICRO_STEPS // 2, checkpoint)
    assert "pytorch_model_fsdp_0" in first["files"] and "optimizer_0" in first["files"], first["files"]
    assert any(name.endswith(".distcp") for name in os.listdir(os.path.join(checkpoint, "pytorch_model_fsdp_0")))
    resumed = launch("nblaunch", "by_hand", None, None, checkpoint)
    assert first["losses"] + resumed["losses"] == pytest.approx(whole["losses"], abs=1e-6)
    difference = max_difference(resumed["weights"], whole["weights"])
    record_property("max_weight_difference_resumed", difference)
    assert difference <= 1e-6  # the same kernels on the same data: only a lost state could differ
