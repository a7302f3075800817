"""torch.compile as the last step of ``prepare`` (``dynamo_backend``, ``TorchDynamoPlugin``) on
2 CPU ranks: Inductor's C++ code trains like eager DDP, the model stays the user's for
checkpoints, the ranks compile into the documented cache and their rows say "compiling" (never
"stalled"); a compile that fails names the line and what to try; the plugin reads Accelerate's
variables and objects."""

from __future__ import annotations

import os

import pytest
import torch

from nblaunch.training import Accelerator
from nblaunch.utils import TorchDynamoPlugin


@pytest.fixture
def compiles_here(monkeypatch, tmp_path):
    """For a test that compiles in this process: torch's first compile writes its default cache
    folder into os.environ where none is set (torch 2.9); give it one, taken back after."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor_here"))


def build_model() -> torch.nn.Module:
    """A Sequential: all of it torch's own code, which dynamo compiles only where the model's own
    forward is compiled (under DDP's compiled wrapper nothing would be)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train(backend: str, checkpoint: str | None = None) -> dict:
    accelerator = Accelerator(dynamo_backend=backend)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
    from torch._dynamo.utils import counters

    counters.clear()
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.mse_loss(prepared(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if checkpoint:
        accelerator.save_state(checkpoint)
    weights = {name: value.tolist() for name, value in accelerator.get_state_dict(prepared).items()}
    return {"losses": losses, "type": type(prepared).__name__, "weights": weights,
            "graphs": counters["stats"]["unique_graphs"],
            "unwrapped_is_model": accelerator.unwrap_model(prepared) is model,
            "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


def resumed_eagerly(checkpoint: str) -> dict:
    """A plain model and optimizer loading the compiled run's checkpoint."""
    accelerator = Accelerator()
    model, _ = accelerator.prepare(build_model(), torch.optim.SGD(build_model().parameters(), lr=0.1))
    accelerator.load_state(checkpoint)
    return {name: value.tolist() for name, value in accelerator.get_state_dict(model).items()}


def eager_then_compiled(checkpoint: str) -> dict:
    eager, compiled = train("no"), train("inductor", checkpoint)
    return {"eager": eager, "compiled": compiled, "resumed": resumed_eagerly(checkpoint)}


@pytest.mark.slow
def test_inductor_on_two_ranks_trains_like_eager_ddp_shows_compiling_and_keeps_its_code(tmp_path, monkeypatch, capfd):
    from nblaunch import notebook_launcher

    monkeypatch.setenv("NBLAUNCH_COMPILE_CACHE", str(tmp_path / "cache"))
    results = notebook_launcher(eager_then_compiled, args=(str(tmp_path / "ckpt"),), num_processes=2,
                                display="text", stall_after=1.0)
    shown = capfd.readouterr().out
    for rank in results:
        eager, compiled = rank["eager"], rank["compiled"]
        assert compiled["graphs"] >= 1 and eager["graphs"] == 0  # compiled for real, and only when asked
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-4)
        assert compiled["losses"][-1] < compiled["losses"][0]
        # Its forward compiled in place: DDP stays DDP around the user's model, the keys are eager's.
        assert compiled["type"] == "DistributedDataParallel" and compiled["unwrapped_is_model"]
        assert sorted(compiled["weights"]) == sorted(eager["weights"])
        assert rank["resumed"] == compiled["weights"]  # its checkpoint loads into the plain model
        assert compiled["cache"] == str(tmp_path / "cache" / f"torch-{torch.__version__}")
    assert any((tmp_path / "cache").rglob("*.py")), "Inductor wrote no code into the launch's cache"
    assert "[rank 0] compiling (torch.compile)..." in shown and "compiled in" in shown
    assert "stalled" not in shown  # waiting for g++ is compiling, not a stall


class GraphBreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        if y.sum().item() > 1e9:  # data-dependent control flow: a graph break
            y = y * 2
        return y


def compile_with_fullgraph() -> None:
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager", fullgraph=True))
    model = accelerator.prepare(GraphBreak())
    model(torch.randn(2, 4))


def test_a_compile_that_fails_names_the_line_and_what_to_try_on_every_rank(launch):
    from nblaunch.launch.errors import RankFailedError

    with pytest.raises(RankFailedError) as raised:
        launch(compile_with_fullgraph)
    text = str(raised.value)
    assert "torch.compile could not compile the model (backend 'eager')" in text
    assert "if y.sum().item() > 1e9" in text and "test_compile.py" in text
    assert "TorchDynamoPlugin(fullgraph=False)" in text and "dynamo_backend='no'" in text


def test_the_plugin_reads_accelerates_variables_and_objects(monkeypatch, compiles_here):
    for name, value in {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_MODE": "max-autotune",
                        "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true", "ACCELERATE_DYNAMO_USE_DYNAMIC": "false",
                        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1"}.items():
        monkeypatch.setenv(name, value)
    plugin = TorchDynamoPlugin()
    assert (plugin.backend, plugin.mode, plugin.fullgraph, plugin.dynamic, plugin.use_regional_compilation) == \
        ("inductor", "max-autotune", True, False, True)
    assert plugin.to_kwargs() == {"backend": "inductor", "mode": "max-autotune", "fullgraph": True, "dynamic": False}
    assert Accelerator().state.dynamo_plugin.backend == "inductor"  # the variables reach Accelerator()
    accelerate = pytest.importorskip("accelerate")
    theirs = accelerate.utils.TorchDynamoPlugin(backend="aot_eager", mode="default", fullgraph=False)
    assert Accelerator(dynamo_plugin=theirs).state.dynamo_plugin.backend == "aot_eager"


def test_bad_compile_settings_are_refused_when_the_accelerator_is_made(compiles_here):
    with pytest.raises(ValueError, match="not a torch.compile backend here; these are: .*inductor"):
        Accelerator(dynamo_backend="no_such_backend")
    with pytest.raises(ValueError, match="give dynamo_backend or dynamo_plugin, not both"):
        Accelerator(dynamo_backend="inductor", dynamo_plugin=TorchDynamoPlugin())
    assert not Accelerator(dynamo_backend="no")._compile_step.enabled


def regional(backend: str) -> dict:
    from nblaunch.training.precision.compiling import is_compiled

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x)

    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend=backend, use_regional_compilation=True))
    model = accelerator.prepare(Blocks())
    from torch._dynamo.utils import counters

    counters.clear()
    model(torch.randn(2, 8)).sum().backward()
    return {"compiled_calls": counters["stats"]["calls_captured"],"blocks": [is_compiled(b) for b in model.blocks], "head": is_compiled(model.head),
            "keys": sorted(model.state_dict())}


def test_regional_compilation_compiles_each_block_and_keeps_the_keys(compiles_here):
    result = regional("eager")
    assert result["blocks"] == [True, True, True] and not result["head"]
    assert result["compiled_calls"] > 0
    assert result["keys"] == sorted(f"blocks.{i}.{p}" for i in range(3) for p in ("weight", "bias")) + \
        ["head.bias", "head.weight"]


def compiled_and_eager_under(stack: str) -> dict:
    """The same training eagerly and compiled (aot_eager: dynamo and AOT autograd, no C++) under
    FSDP2 or fp8 (torchao, emulated on the CPU)."""
    import warnings

    from nblaunch.utils import FullyShardedDataParallelPlugin

    warnings.simplefilter("ignore")  # fp8 on the CPU says it is emulated
    losses = {}
    for backend in ("no", "aot_eager"):
        options = ({"fsdp_plugin": FullyShardedDataParallelPlugin()} if stack == "fsdp"
                   else {"mixed_precision": "fp8"})
        accelerator = Accelerator(dynamo_backend=backend, **options)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        generator = torch.Generator().manual_seed(accelerator.process_index)
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        losses[backend] = []
        for _ in range(5):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[backend].append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["fsdp", "fp8"])
def test_compiling_composes_with_fsdp2_and_fp8(launch, stack):
    if stack == "fp8":
        pytest.importorskip("torchao.float8")
    for rank in launch(compiled_and_eager_under, stack):
        assert rank["aot_eager"] == pytest.approx(rank["no"], abs=1e-4)


def test_a_copy_of_a_compiled_model_computes_with_its_own_weights(compiles_here):
    """An EMA or a teacher made with ``copy.deepcopy`` after ``prepare``: its compiled forward is
    its own, not the original's."""
    import copy

    model = Accelerator(dynamo_backend="eager").prepare(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    assert twin(torch.ones(1, 4)).abs().sum() == 0 and model(torch.ones(1, 4)).abs().sum() > 0
