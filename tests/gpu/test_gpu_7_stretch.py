"""Issue 45 (was issue 31's stretch item 7): DeepSpeed ZeRO-2 and fp8 training on the GPU, through
nblaunch's Accelerator. Each needs its package on the GPU machine (tools/gpu_wheels.sh carries
them); where one is missing its test skips and says so.
"""

from __future__ import annotations

import importlib.util

import pytest

from gpu_common import GPU_MARKS
from nblaunch import notebook_launcher

pytestmark = GPU_MARKS


def zero2_against_deepspeeds_own() -> dict:
    import deepspeed
    import torch

    from nblaunch import Accelerator
    from nblaunch.utils import DeepSpeedPlugin

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 8))

    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)).cuda()
    y = torch.randint(0, 8, (16,), generator=torch.Generator().manual_seed(2)).cuda()
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    net = model()
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3), config=config)
    own = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        own.append(loss.item())
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2), mixed_precision="bf16")
    net = model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=16)
    engine, optimizer, loader = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), loader)
    ours = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(engine(x.bfloat16()).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ours.append(loss.item())
    return {"own": own, "ours": ours, "type": accelerator.distributed_type.value}


def test_deepspeed_zero2_trains_on_one_gpu_as_deepspeeds_own_api():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not on the GPU machine: run tools/gpu_wheels.sh and carry .whl")
    [result] = notebook_launcher(zero2_against_deepspeeds_own, num_processes=1, display="none", timeout=300)
    assert result["type"] == "DEEPSPEED"
    assert result["ours"] == result["own"]
    assert result["ours"][-1] < 0.5 * result["ours"][0]


def fp8_against_accelerates() -> dict:
    """The same loop three times from the same start: Accelerate's fp8 (eager), ours eager
    (``dynamo_backend="no"``), ours as a user gets it (compiled by default on an fp8 GPU).
    Accelerate is given ``enable_fsdp_float8_all_gather=False``: its default config gives the
    converted layers new Parameters that its optimizer, made before ``prepare``, never steps."""
    import torch

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                   torch.nn.GELU(), torch.nn.Linear(1024, 8))

    def train(accelerator):
        net = model()
        net, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).cuda()
        y = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(2)).cuda()
        losses = []
        for _ in range(30):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        kinds = [type(m).__name__ for m in accelerator.unwrap_model(net).modules() if isinstance(m, torch.nn.Linear)]
        return kinds, losses

    import accelerate
    from accelerate.utils import AORecipeKwargs as Theirs
    from torchao.float8 import Float8LinearConfig

    from nblaunch import Accelerator
    from nblaunch.utils import AORecipeKwargs

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=False, pad_inner_dim=True)
    theirs = train(accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[Theirs(config=config)]))
    accelerate.state.AcceleratorState._reset_state(True)
    ours = train(Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=config)],
                             dynamo_backend="no"))
    compiled = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=config)])
    return {"theirs": theirs, "ours": ours, "compiled": train(compiled),
            "compiles_by_default": compiled.state.dynamo_plugin.backend}


def test_fp8_trains_through_torchao_where_accelerate_puts_float8_linear():
    """What must agree with Accelerate's fp8 on the same loop and recipe: the layers converted,
    and the losses within fp8's noise (their own step-to-step change, at least 0.05), eager both;
    ours compiled by default trains to the same losses within that noise."""
    from nblaunch.launch.planning.devices import cuda_capability

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not on the GPU machine: run tools/gpu_wheels.sh and carry .whl")
    capability = cuda_capability()  # through NVML: torch.cuda here would start CUDA in the test process
    if capability is None or capability < (8, 9):
        pytest.skip("this GPU has no fp8 units (compute capability under 8.9)")
    [result] = notebook_launcher(fp8_against_accelerates, num_processes=1, display="none", timeout=400)
    (their_kinds, their_losses), (our_kinds, our_losses) = result["theirs"], result["ours"]
    assert our_kinds == their_kinds and "Float8Linear" in our_kinds
    noise = max(max(abs(a - b) for a, b in zip(their_losses[:5], their_losses[1:6])), 0.05)
    assert all(abs(a - b) <= noise for a, b in zip(our_losses, their_losses))
    assert result["compiles_by_default"] == "inductor"
    assert all(abs(a - b) <= noise for a, b in zip(result["compiled"][1], our_losses))
