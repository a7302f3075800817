"""Tensor parallelism through ``Accelerator(parallelism_config=ParallelismConfig(tp_size=2))`` on 2
gloo ranks: a ``transformers`` Llama split by its own plan, and a plain torch model split by a
plan the user gives. The reference is one process training the same model on the same batches:
splitting the matmuls must not change the loss (within 1e-5)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from nblaunch.training import Accelerator, ParallelismConfig
from nblaunch.utils import DeepSpeedPlugin

MLP_PLAN = {"*.up": "colwise", "*.down": "rowwise"}
# The torch floor lane has no transformers: the plain model's tests run there, the Llama's skip.
KINDS = ["llama", "mlp"] if importlib.util.find_spec("transformers") else ["mlp"]
needs_transformers = pytest.mark.skipif("llama" not in KINDS, reason="needs transformers (pip install -e '.[test]')")


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(32, 4))


def train(kind: str, tp: int, folder: str | None = None) -> dict:
    """Four steps, clipped; with ``folder``: save after two, resume in a new Accelerator, finish."""
    build = llama if kind == "llama" else mlp
    plan = MLP_PLAN if kind == "mlp" else None

    def prepared():
        accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=tp, tp_plan=plan) if tp > 1 else None)
        assert (accelerator.torch_device_mesh is not None) == (tp > 1)  # before prepare, as Accelerate's
        frozen = accelerator.prepare(build().requires_grad_(False))  # a reference model: whole, never split
        assert not any(hasattr(p, "to_local") for p in frozen.parameters())
        model = build()
        generator = torch.Generator().manual_seed(3)
        data = (torch.randint(0, 128, (32, 12), generator=generator) if kind == "llama"
                else torch.randn(32, 32, generator=generator))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
        return (accelerator, *accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader))

    def loss_of(model, x):
        return model(input_ids=x, labels=x).loss if kind == "llama" else model(x).pow(2).mean()

    def train_on(x):
        loss = loss_of(model, x)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    accelerator, model, optimizer, loader = prepared()
    losses, seen = [], []
    for step, (x,) in enumerate(loader):
        assert accelerator.gather_for_metrics(x).shape == x.shape  # one data shard: nothing repeated
        seen.append(x.sum().item())
        train_on(x)
        if folder and step == 1:
            accelerator.save_state(folder)
            accelerator, model, optimizer, loader = prepared()
            accelerator.load_state(folder)
            break
    if folder:
        for (x,) in loader:  # the loader resumes at batch 2: load_state restored its position
            train_on(x)
    local = {name: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
             for name, p in accelerator.unwrap_model(model).named_parameters()}
    return {"losses": losses, "seen": seen, "local": local, "weights": accelerator.get_state_dict(model),
            "mesh": str(accelerator.torch_device_mesh.mesh_dim_names) if accelerator.torch_device_mesh else None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.training.conftest import run_launch

    folder = str(tmp_path_factory.mktemp("tp"))
    kind = KINDS[0]  # the checkpoint is resumed with the Llama where there is one
    return {kind: {"one": run_launch(train, kind, 1, num_processes=1)[0], "two": run_launch(train, kind, 2)}
            for kind in KINDS} | {"resumed": (kind, run_launch(train, kind, 2, os.path.join(folder, "ckpt")))}


@pytest.mark.parametrize("kind", ["llama", "mlp"])
def test_two_tensor_parallel_ranks_train_as_one_process(runs, kind):
    if kind not in KINDS:
        pytest.skip("needs transformers (pip install -e '.[test]')")
    one, two = runs[kind]["one"], runs[kind]["two"]
    for rank in two:
        assert max(abs(a - b) for a, b in zip(rank["losses"], one["losses"])) < 1e-5
        assert rank["seen"] == one["seen"][:len(rank["seen"])]  # both ranks read every batch, as one process
        assert rank["mesh"] == "('tp',)"


@needs_transformers
def test_each_rank_holds_half_of_each_planned_weight_and_the_whole_weights_come_back(runs):
    one, two = runs["llama"]["one"], runs["llama"]["two"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert one["local"][q] == (64, 64) and two[0]["local"][q] == two[1]["local"][q] == (32, 64)
    assert two[0]["local"]["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert two[0]["local"]["model.norm.weight"] == (64,)  # outside the plan: whole
    whole = two[0]["weights"]
    assert two[1]["weights"] == {}
    reference = llama()
    reference.load_state_dict(whole)  # loads into the plain model
    assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in reference.state_dict().items()}


def test_a_checkpoint_resumes_the_split_model_where_it_stopped(runs):
    kind, resumed = runs["resumed"]
    for rank in resumed:
        assert max(abs(a - b) for a, b in zip(rank["losses"], runs[kind]["one"]["losses"])) < 1e-5
        assert len(rank["losses"]) == len(runs[kind]["one"]["losses"])


def two_d(dp_shard: int) -> dict:
    """The plain model over a (dp_shard, tp) mesh with FSDP2 between the groups, or DDP (dp_shard=0)."""
    from nblaunch.utils import FullyShardedDataParallelPlugin

    if dp_shard:
        accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=dp_shard, tp_size=2, tp_plan=MLP_PLAN),
                                  fsdp_plugin=FullyShardedDataParallelPlugin())
    else:
        accelerator = Accelerator()
    model = mlp()
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    losses = []
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    up = accelerator.unwrap_model(model)[0].up.weight
    if dp_shard:  # Accelerate's mesh ranks: tp innermost
        rank = accelerator.process_index
        assert (accelerator.tensor_parallel_rank, accelerator.data_parallel_shard_rank) == (rank % 2, rank // 2)
        assert accelerator.data_parallel_rank == 0
    return {"losses": losses, "type": accelerator.distributed_type.value,
            "local": tuple(up.to_local().shape) if hasattr(up, "to_local") else tuple(up.shape)}


def test_fsdp2_between_two_tensor_parallel_groups_trains_as_ddp_over_the_groups():
    from tests.training.conftest import run_launch

    ddp = run_launch(two_d, 0)  # 2 ranks: the 2 data shards
    grid = run_launch(two_d, 2, num_processes=4)  # ranks 0, 1 read shard 0; ranks 2, 3 shard 1
    for rank, result in enumerate(grid):
        assert max(abs(a - b) for a, b in zip(result["losses"], ddp[rank // 2]["losses"])) < 1e-5
        assert result["type"] == "FSDP" and result["local"] == (16, 32)  # 64 x 32 split by tp, then by dp_shard


def test_bad_layouts_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"tp_size 2 = 2, but there are 1 processes: make the sizes multiply to 1"):
        Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    with pytest.raises(NotImplementedError, match="context and sequence parallelism are not supported"):
        ParallelismConfig(cp_size=2)
    with pytest.raises(ValueError, match="tp_size=0.*at least 1"):
        ParallelismConfig(tp_size=0)
    with pytest.raises(ValueError, match="one stack spreads a model"):
        Accelerator(parallelism_config=ParallelismConfig(tp_size=2), deepspeed_plugin=DeepSpeedPlugin())


def test_a_plan_that_names_nothing_or_an_unknown_style_is_refused():
    from nblaunch.training.strategy.tensor_parallel import model_plan

    with pytest.raises(ValueError, match=r"Sequential has none: give ParallelismConfig\(tp_plan="):
        model_plan(mlp(), None)
    with pytest.raises(ValueError, match=r"no module of Sequential matches the tp_plan's patterns \['\*.attn'\]"):
        model_plan(mlp(), {"*.attn": "colwise"})
    with pytest.raises(ValueError, match=r"tp_plan\['\*.up'\] = 'diagonal': give one of colwise, rowwise"):
        model_plan(mlp(), {"*.up": "diagonal"})
    if "llama" not in KINDS:
        return
    plan = model_plan(llama(), None)  # transformers' own: its base model's patterns and the head's
    assert {"lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"} <= set(plan)
    assert "model.norm" not in plan
