"""FSDP2 in the Accelerator: real ranks, a real gloo group, a small transformer.

The reference is the same training with DDP: same seed, same data, fp32. Sharding changes where
parameters live, not the arithmetic of an averaged gradient step, so the two must agree.
"""

from __future__ import annotations

import os

import pytest
import torch

from nblaunch.launch.errors import RankFailedError
from nblaunch.training import Accelerator
from nblaunch.utils import FullyShardedDataParallelPlugin

BLOCKS = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]}


class Block(torch.nn.Module):
    """One transformer layer: the unit ``transformer_based_wrap`` shards on its own."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.forward_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_calls += 1
        return self.layer(x)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(32, 8))


def data_loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(64, 6, 32, generator=generator)
    targets = torch.randint(0, 8, (64,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=4,
                                       shuffle=True, generator=torch.Generator().manual_seed(2))


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What this rank holds of the parameters and the optimizer's state."""
    def size(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(size(p) for p in model.parameters()) + sum(size(v) for v in states)


def train(plugin=None, mixed_precision="no", stop_after=None, save_to=None, resume_from=None, model_dir=None):
    """8 micro-batches per rank, 2 per optimizer step, clipped SGD with momentum; returns rank 0's full
    weights, the losses, what this rank holds, and how the model was sharded."""
    from nblaunch.utils import set_seed

    set_seed(0)
    if isinstance(plugin, dict):
        plugin = FullyShardedDataParallelPlugin(**plugin)
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision=mixed_precision, gradient_accumulation_steps=2)
    model = build_model()
    # Not Adam: the attention's key bias has a zero gradient (softmax ignores a constant added to
    # every key), and Adam would turn its rounding noise, which differs between an all-reduce and
    # a reduce-scatter, into full-size steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data_loader())
    if resume_from:
        accelerator.load_state(resume_from)
    dtypes = []
    plain = accelerator.unwrap_model(model)  # DDP's inner model; FSDP's is the model itself
    inner = plain[0].layer.linear1
    inner.register_forward_pre_hook(lambda module, args: dtypes.append((module.weight.dtype, args[0].dtype)))
    losses = []
    for micro_step, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x).mean(dim=1), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_dtypes = {p.grad.dtype for p in model.parameters()}
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if stop_after is not None and micro_step + 1 == stop_after:
            accelerator.save_state(save_to)
            return {"losses": losses}
    if model_dir:
        accelerator.save_model(model, model_dir, safe_serialization=False)
    return {
        "weights": accelerator.get_state_dict(model),
        "losses": losses,
        "bytes": local_bytes(model, optimizer),
        "sharded": [type(p).__name__ for p in model.parameters()],
        "units": [name for name, m in model.named_modules() if type(m).__name__.startswith("FSDP")],
        "distributed_type": str(accelerator.distributed_type),
        "compute": dtypes[0],
        "param_dtypes": {p.dtype for p in model.parameters()},
        "grad_dtypes": grad_dtypes,
        "block_calls": plain[0].forward_calls,
    }


def max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ddp_and_fsdp(tmp_path_factory):
    from tests.training.conftest import run_launch

    model_dir = tmp_path_factory.mktemp("model")
    ddp = run_launch(train)
    fsdp = run_launch(train, BLOCKS, "no", None, None, None, str(model_dir))
    return ddp, fsdp, model_dir


def test_fsdp_training_equals_ddp_training(ddp_and_fsdp):
    ddp, fsdp, _ = ddp_and_fsdp
    assert fsdp[0]["distributed_type"] == "DistributedType.FSDP"
    assert set(fsdp[0]["sharded"]) == {"DTensor"} and set(ddp[0]["sharded"]) == {"Parameter"}
    assert fsdp[0]["units"] == ["", "0", "1"]  # the root and each Block
    for rank in (0, 1):
        assert fsdp[rank]["losses"] == pytest.approx(ddp[rank]["losses"], abs=1e-5)
    assert max_difference(fsdp[0]["weights"], ddp[0]["weights"]) < 1e-5
    assert fsdp[1]["weights"] == {}  # the whole weights are rank 0's


def test_each_rank_holds_about_half_of_what_ddp_holds(ddp_and_fsdp):
    ddp, fsdp, _ = ddp_and_fsdp
    for rank in (0, 1):
        ratio = fsdp[rank]["bytes"] / ddp[rank]["bytes"]
        assert 0.45 < ratio < 0.6, (rank, fsdp[rank]["bytes"], ddp[rank]["bytes"])


def test_the_full_state_dict_and_saved_model_load_into_the_plain_model(ddp_and_fsdp):
    _, fsdp, model_dir = ddp_and_fsdp
    plain = build_model()
    plain.load_state_dict(fsdp[0]["weights"], strict=True)
    saved = torch.load(os.path.join(model_dir, "pytorch_model.bin"), weights_only=True)
    plain.load_state_dict(saved, strict=True)
    assert max_difference(saved, fsdp[0]["weights"]) == 0


def test_save_load_and_continue_equals_the_uninterrupted_run(ddp_and_fsdp, launch, tmp_path):
    _, fsdp, _ = ddp_and_fsdp
    checkpoint = str(tmp_path / "checkpoint")
    first = launch(train, BLOCKS, "no", 6, checkpoint)  # after 3 of 4 optimizer steps, mid-epoch
    assert os.path.isdir(os.path.join(checkpoint, "pytorch_model_fsdp_0"))  # Accelerate's names
    assert os.path.isdir(os.path.join(checkpoint, "optimizer_0"))
    resumed = launch(train, BLOCKS, "no", None, None, checkpoint)
    for rank in (0, 1):
        assert first[rank]["losses"] + resumed[rank]["losses"] == pytest.approx(fsdp[rank]["losses"], abs=1e-6)
    assert max_difference(resumed[0]["weights"], fsdp[0]["weights"]) < 1e-6


def test_a_sharded_checkpoint_loaded_without_sharding_says_how_it_was_saved(launch, tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    launch(train, BLOCKS, "no", 2, checkpoint)
    with pytest.raises(RankFailedError, match=r"holds a model saved in pieces \(with an fsdp_plugin, or tensor parallel\)"):
        launch(train, None, "no", None, None, checkpoint)


@pytest.mark.parametrize("mixed_precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_computes_in_its_dtype_on_fp32_parameters_and_reduces_in_fp32(launch, mixed_precision, dtype):
    results = launch(train, BLOCKS, mixed_precision)  # fp16: with the GradScaler, as without FSDP
    for result in results:
        assert result["compute"] == (dtype, dtype)  # weights and inputs of a Linear
        assert result["param_dtypes"] == {torch.float32} and result["grad_dtypes"] == {torch.float32}
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def test_activation_checkpointing_recomputes_and_trains_the_same(ddp_and_fsdp, launch):
    _, fsdp, _ = ddp_and_fsdp
    results = launch(train, {**BLOCKS, "activation_checkpointing": True})
    assert results[0]["block_calls"] == 2 * len(results[0]["losses"])  # each forward again in its backward
    assert max_difference(results[0]["weights"], fsdp[0]["weights"]) < 1e-6


def test_accelerates_own_plugin_object_is_read_by_its_fields(ddp_and_fsdp, launch):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    _, fsdp, _ = ddp_and_fsdp
    theirs = accelerate_utils.FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
    results = launch(train, theirs)
    assert results[0]["units"] == ["", "0", "1"]
    assert max_difference(results[0]["weights"], fsdp[0]["weights"]) < 1e-6


def test_size_based_wrapping_and_cpu_offload_on_the_cpu(launch):
    # On the CPU the parameters already live in CPU memory: offloading warns and changes nothing.
    results = launch(train, {"auto_wrap_policy": "size_based_wrap", "min_num_params": 5000, "cpu_offload": True})
    # The Blocks (about 8.5k parameters) and their layers pass the bar; the head (264) does not.
    assert results[0]["units"] == ["", "0", "0.layer", "1", "1.layer"]


def test_size_based_wrapping_of_every_module_never_splits_attention(ddp_and_fsdp, launch):
    # min_num_params=0 (Accelerate's default): every module with parameters is a unit, except
    # inside attention, which reads its out_proj's weight without calling out_proj.
    _, fsdp, _ = ddp_and_fsdp
    results = launch(train, {"auto_wrap_policy": "size_based_wrap"})
    units = results[0]["units"]
    assert "0.layer.self_attn" in units and not any("out_proj" in unit for unit in units)
    assert "0.layer.linear1" in units and "2" in units
    assert max_difference(results[0]["weights"], fsdp[0]["weights"]) < 1e-5


def differently_initialised_ranks(options):
    from nblaunch.training.runtime.state import PartialState

    torch.manual_seed(PartialState().process_index)  # each rank its own weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if "ignored_modules" in options:
        model[1].requires_grad_(False)  # trainable ignored modules are refused: they would train apart
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**options))
    model = accelerator.prepare(model)
    torch.manual_seed(0)
    return accelerator.get_state_dict(model), type(model[1].weight).__name__


def test_sync_module_states_starts_every_rank_from_rank_0s_weights_and_ignored_modules_stay_whole(launch):
    torch.manual_seed(0)
    rank_0 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).state_dict()
    synced, kind = launch(differently_initialised_ranks, {"sync_module_states": True})[0]
    assert max_difference(synced, rank_0) == 0 and kind == "DTensor"
    _, kind = launch(differently_initialised_ranks, {"sync_module_states": True, "ignored_modules": r"1"})[0]
    assert kind == "Parameter"


@pytest.mark.parametrize("options, error, match", [
    ({"param_init_fn": lambda m: None}, NotImplementedError, "param_init_fn"),
    ({"sharding_strategy": "NO_SHARD"}, NotImplementedError, "NO_SHARD is DDP"),
    ({"sharding_strategy": "HYBRID_SHARD"}, NotImplementedError, "HYBRID_SHARD"),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, NotImplementedError, "LOCAL_STATE_DICT"),
    ({"activation_checkpointing": True}, ValueError, "give auto_wrap_policy"),
    ({"activation_checkpointing_offload": True}, NotImplementedError, "activation_checkpointing_offload"),
    ({"mixed_precision_policy": "fp8"}, ValueError, "mixed_precision_policy='fp8'"),
    ({"auto_wrap_policy": "by_magic"}, ValueError, "auto_wrap_policy='by_magic'"),
    ({"fsdp_version": 3}, ValueError, "fsdp_version=3"),
])
def test_what_nblaunch_does_not_do_is_refused_when_the_accelerator_is_made(options, error, match):
    with pytest.raises(error, match=match):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**options))


def unknown_layer_class():
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"]))
    accelerator.prepare(build_model())


def an_optimizer_that_already_stepped():
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 6, 32)).sum().backward()
    optimizer.step()
    Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()).prepare(model, optimizer)


@pytest.mark.parametrize("function, match", [
    (unknown_layer_class, r"no module of class \['LlamaDecoderLayer'\]"),
    (an_optimizer_that_already_stepped, "already stepped"),
])
def test_a_model_that_cannot_be_sharded_as_asked_fails_in_prepare_with_what_to_do(launch, function, match):
    with pytest.raises(RankFailedError, match=match):
        launch(function)


def optimizer_prepared_first():
    from nblaunch.utils import set_seed

    set_seed(0)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**BLOCKS))
    model = build_model()
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    model = accelerator.prepare(model)  # the optimizer, prepared before, follows the shards
    before = accelerator.get_state_dict(model)
    model(torch.randn(2, 6, 32)).sum().backward()
    optimizer.step()
    return before, accelerator.get_state_dict(model)


def test_an_optimizer_prepared_before_its_model_trains_the_shards(launch):
    before, after = launch(optimizer_prepared_first)[0]
    assert max_difference(before, after) > 1e-3


def tied_and_freed(policy_options):
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    model[2].weight = model[0].weight  # tied input and output embeddings
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**policy_options))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    units = [name for name, m in model.named_modules() if type(m).__name__.startswith("FSDP")]
    tied = model[2].weight is model[0].weight
    shard = weakref.ref(model[1].weight)
    model, optimizer = accelerator.free_memory(model, optimizer)
    gc.collect()
    return units, tied, shard() is None


def test_tied_weights_stay_in_one_unit_and_free_memory_lets_the_shards_go(launch):
    # Accelerate's size-based default (0): every module with parameters is a unit, except the
    # two that share the embedding, which the root holds together.
    units, tied, freed = launch(tied_and_freed, {"auto_wrap_policy": "size_based_wrap"})[0]
    assert units == ["", "1"] and tied and freed


def fsdp1_mixed_precision():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    plugin = accelerate_utils.FullyShardedDataParallelPlugin(mixed_precision_policy="bf16")  # FSDP1's object
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = accelerator.prepare(build_model())
    seen = []
    model[0].layer.linear1.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    model(torch.randn(2, 6, 32))  # fp32 inputs: cast by FSDP2 as FSDP1 would
    return seen[0]


def test_accelerates_fsdp1_mixed_precision_object_computes_in_bf16(launch):
    pytest.importorskip("accelerate")
    assert launch(fsdp1_mixed_precision) == [torch.bfloat16] * 2


def two_models_one_optimizer():
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    accelerator.prepare(first, second, optimizer)


def trainable_ignored_module():
    plugin = FullyShardedDataParallelPlugin(ignored_modules="1")
    Accelerator(fsdp_plugin=plugin).prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))


@pytest.mark.parametrize("function, match", [
    (two_models_one_optimizer, "give each sharded model an optimizer of its own"),
    (trainable_ignored_module, r"ignored_modules \['1'\] have trainable parameters"),
])
def test_what_would_train_wrongly_is_refused_in_prepare(launch, function, match):
    with pytest.raises(RankFailedError, match=match):
        launch(function)


def test_one_rank_shards_too_as_accelerate_does_on_one_gpu(launch, tmp_path):
    """An fsdp_plugin on one rank shards (a process group of one): CPU offload can then fit a
    model on one GPU, and the checkpoint is the sharded one Accelerate writes there."""
    checkpoint = str(tmp_path / "checkpoint")
    (whole,) = launch(train, BLOCKS, num_processes=1)
    assert set(whole["sharded"]) == {"DTensor"} and whole["distributed_type"] == "DistributedType.FSDP"
    launch(train, BLOCKS, "no", 6, checkpoint, num_processes=1)
    assert os.path.isdir(os.path.join(checkpoint, "pytorch_model_fsdp_0"))
    (resumed,) = launch(train, BLOCKS, "no", None, None, checkpoint, num_processes=1)
    assert resumed["losses"] == pytest.approx(whole["losses"][6:], abs=1e-6)
    assert max_difference(resumed["weights"], whole["weights"]) < 1e-6
    (plain,) = launch(train, None, num_processes=1)  # without a plugin: the model as it was
    assert set(plain["sharded"]) == {"Parameter"} and plain["distributed_type"] == "DistributedType.NO"
