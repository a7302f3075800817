"""fp8 through torchao on 2 CPU ranks (torchao emulates the float8 matmuls there): the Linear
layers Accelerate's torchao path converts are converted, the model trains, composed with DDP and
FSDP2, and the warning names the device. Accelerate's own torchao path on one process is the
reference for which layers convert."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.float8")

from nblaunch.training import Accelerator  # noqa: E402
from nblaunch.utils import AORecipeKwargs, FullyShardedDataParallelPlugin  # noqa: E402


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10),
                               torch.nn.ReLU(), torch.nn.Linear(10, 32), torch.nn.Linear(32, 4))


def layer_kinds(model: torch.nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)]


def train_fp8(sharded: bool) -> dict:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()],
                                  fsdp_plugin=FullyShardedDataParallelPlugin() if sharded else None)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    x = torch.randn(64, 32, generator=generator)
    y = (x[:, :4] > 0).float()
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"kinds": layer_kinds(accelerator.unwrap_model(model)), "losses": losses,
            "warnings": [str(w.message) for w in caught], "type": str(accelerator.distributed_type)}


@pytest.fixture(scope="module")
def trained():
    from tests.training.conftest import run_launch

    return {"ddp": run_launch(train_fp8, False), "fsdp": run_launch(train_fp8, True)}


def accelerates_kinds() -> list[str]:
    """Which layers Accelerate's own torchao path converts, on one process."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import AORecipeKwargs as AcceleratesRecipe

    accelerator = accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[AcceleratesRecipe()])
    return layer_kinds(accelerator.prepare(build_model()))


@pytest.mark.parametrize("stack", ["ddp", "fsdp"])
def test_the_layers_accelerate_converts_are_converted_and_it_trains(trained, stack):
    expected = accelerates_kinds()
    assert expected.count("Float8Linear") == 2  # the first, last and 10-wide layers stay
    for rank in trained[stack]:
        assert rank["kinds"] == expected
        assert rank["losses"][-1] < 0.5 * rank["losses"][0]
        assert any("fp8' on the CPU: torchao emulates" in w for w in rank["warnings"])
    assert trained["fsdp"][0]["type"] == "DistributedType.FSDP"


def test_other_fp8_recipes_are_refused_by_name():
    TERecipeKwargs = type("TERecipeKwargs", (), {})  # Accelerate's cannot be made without TransformerEngine

    with pytest.raises(NotImplementedError, match=r"TERecipeKwargs \(TransformerEngine fp8\) .* AORecipeKwargs"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()])
    with pytest.raises(ValueError, match="AORecipeKwargs is fp8's recipe"):
        Accelerator(kwargs_handlers=[AORecipeKwargs()])


def test_an_optimizer_made_before_prepare_trains_the_layers_a_torchao_config_gives_new_parameters():
    """Accelerate's default torchao config (fp8 all-gathers on) wraps each converted weight in a
    new Parameter; an optimizer made before ``prepare`` is pointed at them, so the fp8 layers
    train (under Accelerate's AO path, without FSDP, they stay as they were)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, pad_inner_dim=True)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=config)])
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model[2].weight.detach().clone()
    model, optimizer = accelerator.prepare(model, optimizer)
    assert type(model[2]).__name__ == "Float8Linear"
    assert any(p is model[2].weight for group in optimizer.param_groups for p in group["params"])
    torch.nn.functional.mse_loss(model(torch.randn(8, 32)), torch.zeros(8, 4)).backward()
    optimizer.step()
    assert not torch.equal(model[2].weight.detach().float(), before)


def test_with_the_same_recipe_fp8_trains_as_accelerates_and_accelerates_default_leaves_its_fp8_layers_untrained():
    """docs/accelerator.md's claims, on one CPU process from the same start: with a recipe that
    keeps the Parameters (fp8 all-gathers off) our losses are Accelerate's; with Accelerate's own
    default recipe its converted layers keep their first weights (its optimizer, made before
    ``prepare``, steps the replaced Parameters), ours train."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import AORecipeKwargs as Theirs
    from torchao.float8 import Float8LinearConfig

    def train(accelerator) -> tuple[list[float], bool]:
        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = model[2].weight.detach().clone()
        model, optimizer = accelerator.prepare(model, optimizer)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 32, generator=generator)
        y = (x[:, :4] > 0).float()
        losses = []
        for _ in range(10):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, not torch.equal(model[2].weight.detach().float(), before)

    kept = Float8LinearConfig(enable_fsdp_float8_all_gather=False)
    theirs, their_layer_trained = train(accelerate.Accelerator(mixed_precision="fp8",
                                                               kwargs_handlers=[Theirs(config=kept)]))
    accelerate.state.AcceleratorState._reset_state(True)
    ours, our_layer_trained = train(Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=kept)]))
    assert ours == pytest.approx(theirs, abs=1e-5) and their_layer_trained and our_layer_trained
    _, their_default_trained = train(accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[Theirs()]))
    accelerate.state.AcceleratorState._reset_state(True)
    default = Float8LinearConfig(enable_fsdp_float8_all_gather=True, pad_inner_dim=True)  # Accelerate's default
    _, our_default_trained = train(Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=default)]))
    assert our_default_trained and not their_default_trained
