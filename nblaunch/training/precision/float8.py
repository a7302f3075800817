"""fp8 training through torchao (``mixed_precision="fp8"``): the model's Linear layers become
``Float8Linear`` (matmuls in float8 with dynamic scales; weights and optimizer stay fp32), the
same ones Accelerate's torchao path converts, and the rest of the forward runs under bf16
autocast as there. Fast only on GPUs with fp8 units (compute capability 8.9 and later);
torchao emulates it elsewhere (the CPU), which trains and is no faster. Eager, torchao's casts
and scales run as kernels of their own and fp8 is slower than bf16; compiled, they fuse: so on a
GPU with fp8 units ``prepare`` compiles an fp8 model unless told ``dynamo_backend="no"``
(``wants_compile``).

A torchao config may give converted layers new Parameters (``enable_fsdp_float8_all_gather``
wraps each weight); ``prepare`` points an optimizer made before it at them, so the fp8 layers
train (Accelerate's AO path leaves such an optimizer on the old ones: without FSDP its fp8 layers
do not train).

Example::

    model = convert_to_fp8(model, AORecipeKwargs(), sharded=False, device=torch.device("cuda"))
    [type(m).__name__ for m in model.modules()]   # Linear, Float8Linear, ..., Linear
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from nblaunch.contract.precision import FP8_EMULATED_ON_CPU, FP8_HARDWARE
from nblaunch.training.options.kwargs import AORecipeKwargs
from nblaunch.training.precision.precision_interface import Precision

__all__ = ["Float8", "require_torchao", "check_fp8_device", "convert_to_fp8", "accelerates_filter",
           "has_fp8_layers", "rescale_after_step", "gathers_in_fp8", "optimizer_trains"]

INSTALL = 'pip install "nblaunch[fp8]"'


class Float8(Precision):
    """``"fp8"``: torchao's Float8Linear layers (converted by :meth:`convert`), the rest of the
    forward under bf16 autocast as under Accelerate; compiled by default where the GPU has fp8 units."""

    mode = "fp8"
    autocast_dtype = torch.bfloat16

    def __init__(self, device: torch.device, recipe: AORecipeKwargs | None,
                 autocast_kwargs: dict[str, Any] | None = None) -> None:
        require_torchao()
        check_fp8_device(device)
        super().__init__(device, autocast_kwargs)
        self.recipe = recipe or AORecipeKwargs()  # torchao's, as Accelerate picks it first
        self.wants_compile = device.type == "cuda"  # check_fp8_device refused a GPU without fp8 units

    def convert(self, model: torch.nn.Module, sharded: bool) -> torch.nn.Module:
        return convert_to_fp8(model, self.recipe, sharded=sharded, device=self.device)

    def optimizer_prepared(self, optimizer: torch.optim.Optimizer, sharded_models: list[torch.nn.Module]) -> None:
        for model in sharded_models:
            if gathers_in_fp8(model) and optimizer_trains(optimizer, model):
                rescale_after_step(optimizer, model)


def require_torchao() -> None:
    """Refuse, naming the extra to install, where torchao cannot be imported."""
    try:
        import torchao.float8  # noqa: F401  (deferred: the optional fp8 extra)
    except ImportError as error:
        raise ImportError(f"mixed_precision='fp8' trains through torchao, which is not installed: {INSTALL} "
                          f"({error})") from None


def check_fp8_device(device: torch.device) -> None:
    """Where fp8 cannot run, an error naming the device; where torchao only emulates it, a warning."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_HARDWARE:
            raise ValueError(f"mixed_precision='fp8' needs a GPU with fp8 units (compute capability 8.9 and later); "
                             f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use 'bf16' "
                             "(or 'fp16' where bf16 is emulated)")
        return
    if device.type != "cpu":
        raise ValueError(f"mixed_precision='fp8' runs on CUDA GPUs (and, emulated, the CPU), not on {device.type}")
    warnings.warn(FP8_EMULATED_ON_CPU, stacklevel=5)  # the user's Accelerator(...) line


def accelerates_filter(model: torch.nn.Module) -> Callable[[torch.nn.Module, str], bool]:
    """Every Linear but the model's first and last, both sizes divisible by 16 (Accelerate's default)."""
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    kept = {linears[0], linears[-1]} if linears else set()

    def convert(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or name in kept:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return convert


def has_fp8_layers(model: torch.nn.Module) -> bool:
    """Whether torchao converted any of the model's layers already."""
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())


def convert_to_fp8(model: torch.nn.Module, recipe: AORecipeKwargs, sharded: bool,
                   device: torch.device) -> torch.nn.Module:
    """The model with its Linear layers converted in place (once); ``sharded``: FSDP2 will shard
    it, so on a GPU ``device`` the weights are all-gathered in fp8 (torchao's recipe for FSDP)."""
    if has_fp8_layers(model):
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # deferred: the optional extra
    config = recipe.config
    if config is None:
        gather = recipe.enable_fsdp_float8_all_gather
        config = Float8LinearConfig(
            enable_fsdp_float8_all_gather=sharded and device.type == "cuda" if gather is None else gather,
            pad_inner_dim=bool(recipe.pad_inner_dim))
    module_filter: Any = recipe.module_filter_func or accelerates_filter(model)
    return convert_to_float8_training(model, module_filter_fn=module_filter, config=config)


def gathers_in_fp8(model: torch.nn.Module) -> bool:
    """Whether FSDP2 all-gathers this model's fp8 weights in fp8 (their scales then follow each step)."""
    return any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
               for m in model.modules() if type(m).__name__ == "Float8Linear")


def optimizer_trains(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> bool:
    """Whether ``optimizer`` steps any of ``model``'s parameters."""
    mine = {id(p) for p in model.parameters()}
    return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])


def rescale_after_step(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """With fp8 all-gathers under FSDP2 the weights' scales are computed once per step, after it."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # deferred: the optional extra
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
