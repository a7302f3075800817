"""DeepSpeed through the Accelerator: real ranks, a real gloo group, DeepSpeed's CPU accelerator.

The reference is DeepSpeed's own API (``deepspeed.initialize``, ``engine.backward``,
``engine.step``) on the same loop, in the same ranks: the Accelerator must train exactly as it
does at every ZeRO stage, and its checkpoints must be DeepSpeed's (``engine.load_checkpoint(dir,
"pytorch_model")`` is what Accelerate's DeepSpeed path calls).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from nblaunch.training import Accelerator  # noqa: E402
from nblaunch.utils import DeepSpeedPlugin, DummyOptim, FullyShardedDataParallelPlugin  # noqa: E402

STEPS = 2  # micro-batches per optimizer step
LR = 0.01


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(layer, torch.nn.Linear(32, 8))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(64, 6, 32, generator=generator),
                                          torch.randint(0, 8, (64,), generator=generator))


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).mean(dim=1), y)


def my_batches():
    """This rank's batches as a prepared loader deals them: batch i goes to rank i % world."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = list(torch.utils.data.DataLoader(dataset(), batch_size=4))
    return batches[rank::world]


def deepspeeds_own(stage: int, batches, load_from=None, save_to=None):
    """DeepSpeed's own API on the loop; returns the losses."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": STEPS,
              "train_batch_size": 4 * STEPS * int(os.environ["WORLD_SIZE"]), "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    model = build_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    if load_from:
        engine.load_checkpoint(load_from, "pytorch_model")
    losses = []
    for x, y in batches:
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 6))
    if save_to:
        engine.save_checkpoint(save_to, "pytorch_model")
    return losses


def accelerators(stage: int, skip: int = 0, stop: int | None = None, load_from=None, save_to=None):
    """The same loop through ``Accelerator(deepspeed_plugin=...)``; returns losses and what it holds."""
    from nblaunch.utils import set_seed

    set_seed(0)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage), gradient_accumulation_steps=STEPS)
    model = build_model()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR), loader)
    if load_from:
        with pytest.warns(UserWarning, match="random states"):  # DeepSpeed's own API writes none
            accelerator.load_state(load_from)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i < skip:
            continue
        with accelerator.accumulate(model):
            loss = loss_of(model, x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
        if stop is not None and i + 1 == stop:
            break
    if save_to:
        accelerator.save_state(save_to)
    return {"losses": losses, "held": held(model), "weights": accelerator.get_state_dict(model),
            "type": str(accelerator.distributed_type), "optimizer": type(optimizer).__name__,
            "unwrapped": type(accelerator.unwrap_model(model)).__name__}


def held(engine) -> dict:
    """Elements of parameters and optimizer state this rank holds (ZeRO-3 partitions both)."""
    params = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    state = sum(v.numel() for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"params": params, "state": state}


def every_stage(folder: str) -> dict:
    rank = os.environ["RANK"]
    batches = my_batches()
    results = {}
    for stage in (1, 2, 3):
        results[stage] = {"own": deepspeeds_own(stage, batches), "ours": accelerators(stage)}
    # Checkpoints both ways at ZeRO-3 (the partitioned layout): stop after 4 micro-batches, resume.
    ours_saved, own_saved = os.path.join(folder, "ours"), os.path.join(folder, "own")
    accelerators(3, stop=4, save_to=ours_saved)
    results["own resumes ours"] = deepspeeds_own(3, batches[4:], load_from=ours_saved)
    deepspeeds_own(3, batches[:4], save_to=own_saved)
    results["ours resumes own"] = accelerators(3, skip=4, load_from=own_saved)["losses"]
    results["files"] = sorted(os.listdir(ours_saved)) if rank == "0" else None
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.training.conftest import run_launch

    return run_launch(every_stage, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_zero_stage_trains_exactly_as_deepspeeds_own_api(trained, stage):
    """The first DeepSpeed launch on a machine takes about 30 s: DeepSpeed compiles its CPU
    communication op with g++ (once, into ~/.cache/torch_extensions); later ones take 4 s."""
    for rank in trained:
        ours = rank[stage]["ours"]
        assert ours["losses"] == rank[stage]["own"], f"ZeRO-{stage}"
        assert ours["type"] == "DistributedType.DEEPSPEED" and ours["optimizer"] == "DeepSpeedOptimizerWrapper"
        assert ours["unwrapped"] == "Sequential"
    assert trained[0][stage]["ours"]["losses"] != trained[1][stage]["ours"]["losses"]  # each rank its own batches


def test_zero3_holds_half_the_parameters_and_optimizer_state_per_rank_and_gives_the_whole_weights(trained):
    whole = sum(p.numel() for p in build_model().parameters())
    for rank in trained:
        held_1, held_3 = rank[1]["ours"]["held"], rank[3]["ours"]["held"]
        assert held_1["params"] == whole  # ZeRO-1: parameters whole, optimizer state partitioned
        assert abs(held_3["params"] - whole / 2) <= 8 and abs(held_1["state"] - whole) <= 16
        assert abs(held_3["state"] - whole) <= 16  # exp_avg + exp_avg_sq of half the parameters
    weights = trained[0][3]["ours"]["weights"]
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in build_model().state_dict().items()}
    assert trained[1][3]["ours"]["weights"] == {}  # whole weights on the main process only
    for key, value in trained[0][2]["ours"]["weights"].items():  # ZeRO-2 and ZeRO-3 trained the same weights
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-6)


def test_checkpoints_resume_in_deepspeeds_own_api_and_the_other_way(trained):
    for rank in trained:
        rest = rank[3]["ours"]["losses"][4:]
        assert rank["own resumes ours"] == rest
        assert rank["ours resumes own"] == rest
    files = trained[0]["files"]
    assert "pytorch_model" in files and "latest" in files and "random_states_0.pkl" in files
    assert not any(f.startswith("model") for f in files)  # the weights are in DeepSpeed's folder only


def test_a_config_that_contradicts_the_accelerator_is_refused_with_both_values_before_deepspeed_starts():
    def prepare(config, **options):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), **options)
        model = build_model()
        loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
        try:
            accelerator.prepare(model, torch.optim.AdamW(model.parameters()), loader)
        finally:
            assert accelerator._models == [] and accelerator._optimizers == []  # nothing half-prepared

    zero = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu is 8, the DataLoader gives 4"):
        prepare({**zero, "train_micro_batch_size_per_gpu": 8})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps is 4, the Accelerator's 2"):
        prepare({**zero, "gradient_accumulation_steps": 4}, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"train_batch_size is 100, but 4 per process x 1 .* is 4"):
        prepare({**zero, "train_batch_size": 100})
    with pytest.raises(ValueError, match=r"mixed_precision='fp16' but the DeepSpeed config enables bf16"):
        prepare({**zero, "bf16": {"enabled": True}}, mixed_precision="fp16")
    with pytest.raises(ValueError, match="optimizer section and prepare.. got a torch optimizer"):
        prepare({**zero, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    with pytest.raises(ValueError, match="no zero_optimization section"):
        DeepSpeedPlugin(hf_ds_config={"train_batch_size": 4})
    with pytest.raises(ValueError, match="DummyOptim stands for"):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
        accelerator.prepare(build_model(), DummyOptim([]), torch.utils.data.DataLoader(dataset(), batch_size=4))


def test_two_stacks_at_once_and_megatron_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="fsdp_plugin and deepspeed_plugin: one stack"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(), deepspeed_plugin=DeepSpeedPlugin())
    with pytest.raises(NotImplementedError, match="Megatron-LM .* parallelism_config=ParallelismConfig"):
        Accelerator(megatron_lm_plugin=object())


@pytest.mark.slow
def test_accelerates_own_plugin_and_variables_are_read():
    from accelerate.utils import DeepSpeedPlugin as AcceleratesPlugin

    accelerator = Accelerator(deepspeed_plugin=AcceleratesPlugin(zero_stage=3, gradient_clipping=0.5))
    assert accelerator.deepspeed_plugin.zero_stage == 3
    assert accelerator.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.5
    environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1",
               "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}
    code = ("from nblaunch import Accelerator; a = Accelerator(); "
            "print(a.distributed_type.value, a.deepspeed_plugin.zero_stage, a.deepspeed_plugin.offload_optimizer_device)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **environ}, capture_output=True, text=True)
    assert out.stdout.split()[-3:] == ["DEEPSPEED", "1", "cpu"], out.stderr[-2000:]  # DeepSpeed prints before


def test_without_deepspeed_the_error_names_the_extra_to_install():
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from nblaunch import Accelerator\nfrom nblaunch.utils import DeepSpeedPlugin\n"
            "Accelerator(deepspeed_plugin=DeepSpeedPlugin())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert 'pip install "nblaunch[deepspeed]"' in out.stderr, out.stderr[-2000:]


def second_chances() -> dict:
    """What a notebook user does after a first prepare: free it and prepare again, prepare the
    model alone, hand the engine's model another optimizer; and a config without accumulation steps,
    a DummyScheduler over the config's scheduler."""
    from nblaunch.utils import DummyScheduler

    seen = {}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2), gradient_accumulation_steps=4)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
    model = build_model()
    with pytest.raises(ValueError, match="prepared with its optimizer .* in one prepare"):
        accelerator.prepare(model)
    engine, optimizer, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    seen["clipping"] = accelerator.deepspeed_plugin.deepspeed_config["gradient_clipping"]  # filled: 1.0
    with pytest.raises(ValueError, match="optimizer trains the DeepSpeed engine's model"):
        accelerator.prepare(torch.optim.SGD(engine.module.parameters(), lr=0.1))
    accelerator.free_memory()
    model = build_model()
    engine, optimizer, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    seen["again"] = type(engine).__name__
    config = {"zero_optimization": {"stage": 1}, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=4)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    engine, optimizer, scheduler, _ = accelerator.prepare(model, optimizer, DummyScheduler(optimizer, warmup_num_steps=5),
                                                          loader)
    filled = accelerator.deepspeed_plugin.deepspeed_config
    seen["steps"] = (filled["gradient_accumulation_steps"], accelerator.gradient_accumulation_steps)
    seen["scheduler"] = (type(scheduler).__name__, filled["scheduler"]["params"])
    return seen


def test_a_second_prepare_after_free_memory_and_what_cannot_be_prepared_apart():
    from tests.training.conftest import run_launch

    [seen] = run_launch(second_chances, num_processes=1)
    assert seen["clipping"] == 1.0 and seen["again"] == "DeepSpeedEngine"
    assert seen["steps"] == (4, 4)  # no accumulation steps in the config: the Accelerator's
    assert seen["scheduler"] == ("DeepSpeedSchedulerWrapper",
                                 {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 5})


def test_a_refused_prepare_changes_nothing():
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4,
                      "train_micro_batch_size_per_gpu": 8}))
    model = build_model()
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu is 8"):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()),
                            torch.utils.data.DataLoader(dataset(), batch_size=4))
    assert accelerator.gradient_accumulation_steps == 1  # the config's 4 is taken only once DeepSpeed started
    assert "train_batch_size" not in accelerator.deepspeed_plugin.deepspeed_config  # the filled copy was dropped
