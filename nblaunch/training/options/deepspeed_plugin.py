"""``DeepSpeedPlugin``: Accelerate's DeepSpeed settings under Accelerate's names (ZeRO stage,
offload, accumulation, clipping, or a DeepSpeed config dict or file), and the placeholders
``DummyOptim``/``DummyScheduler`` for an optimizer and scheduler the config describes.

Plain data: DeepSpeed itself is imported only by the strategy that trains with it. Unset
fields are read from Accelerate's variables (``ACCELERATE_DEEPSPEED_*``, which ``nblaunch launch``
and ``accelerate launch`` set from a config file's ``deepspeed_config``), as Accelerate does.

Example::

    plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0)
    plugin.deepspeed_config["zero_optimization"]      # {"stage": 3, "offload_optimizer": {...}, ...}
    accelerator = Accelerator(deepspeed_plugin=plugin)
"""

from __future__ import annotations

import os
from dataclasses import InitVar, dataclass
from typing import Any, Mapping

from nblaunch.contract.variables import ACCELERATE_USE_DEEPSPEED, DEEPSPEED_VARIABLES
from nblaunch.training.options.deepspeed_config import HfDeepSpeedConfig

__all__ = ["DeepSpeedPlugin", "DummyOptim", "DummyScheduler", "deepspeed_plugin_from_environment", "adopt_deepspeed_plugin"]

_TRUE = ("1", "true", "yes", "y", "t", "on")
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed's settings for ``Accelerator(deepspeed_plugin=...)``.

    Args:
        hf_ds_config: a DeepSpeed config (dict, JSON file, ``HfDeepSpeedConfig``); its "auto"
            values are filled from the fields below and from the training (batch size,
            accumulation, clipping 1.0). Without it a config is built from the fields.
        gradient_accumulation_steps: micro-steps per step ("auto": the Accelerator's).
        gradient_clipping: the norm DeepSpeed clips to inside its step ("auto": 1.0, as Accelerate).
        zero_stage: 0 (off), 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters).
        offload_optimizer_device, offload_param_device: ``"none"``, ``"cpu"``, ``"nvme"``.
        offload_optimizer_nvme_path, offload_param_nvme_path: the NVMe folder.
        zero3_init_flag: build ``transformers`` models sharded at creation (ZeRO-3).
        zero3_save_16bit_model: ``get_state_dict``/``save_model`` gather 16-bit weights as DeepSpeed does
            (nblaunch gathers full-precision weights without it).
        transformer_moe_cls_names: ZeRO-3's MoE leaf modules: not supported (refused).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Any = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Any = None
    offload_param_device: Any = None
    offload_optimizer_nvme_path: Any = None
    offload_param_nvme_path: Any = None
    zero3_init_flag: Any = None
    zero3_save_16bit_model: Any = None
    transformer_moe_cls_names: Any = None
    enable_msamp: Any = None
    msamp_opt_level: Any = None
    environ: InitVar[Mapping[str, str] | None] = None  # where unset fields are read (os.environ)

    def __post_init__(self, environ: Mapping[str, str] | None) -> None:
        self._fill_from_environment(os.environ if environ is None else environ)
        if self.transformer_moe_cls_names:
            raise NotImplementedError("DeepSpeedPlugin(transformer_moe_cls_names=...): ZeRO-3's MoE leaf modules are "
                                      "not supported by nblaunch yet; leave it out")
        if self.enable_msamp:
            raise NotImplementedError("DeepSpeedPlugin(enable_msamp=True): MS-AMP is not supported by nblaunch; "
                                      "for fp8 give Accelerator(mixed_precision='fp8') with torchao (pip install \"nblaunch[fp8]\")")
        for name in ("offload_optimizer_device", "offload_param_device"):
            if getattr(self, name) not in _OFFLOAD_DEVICES:
                raise ValueError(f"DeepSpeedPlugin({name}={getattr(self, name)!r}): give one of {_OFFLOAD_DEVICES}")
        if self.hf_ds_config is not None:
            self._adopt_config()
        else:
            self._build_config()
        if self.zero3_init_flag and self.zero_stage != 3:
            self.zero3_init_flag = False  # only ZeRO-3 shards at creation (Accelerate warns and does the same)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeed zero_stage={self.zero_stage!r}: give 0, 1, 2 or 3")

    def _fill_from_environment(self, environ: Mapping[str, str]) -> None:
        def read(field: str, default: str) -> str:
            return environ.get(DEEPSPEED_VARIABLES[field], default)

        if self.gradient_accumulation_steps is None:
            text = read("gradient_accumulation_steps", "auto")
            self.gradient_accumulation_steps = int(text) if text.isdigit() else text
        if self.gradient_clipping is None:
            text = read("gradient_clipping", "auto")
            self.gradient_clipping = text if text in ("auto", "none") else float(text)
            if self.gradient_clipping == "none":
                self.gradient_clipping = None
        if self.zero_stage is None:
            self.zero_stage = int(read("zero_stage", "2"))
        for field in ("offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                      "offload_param_nvme_path"):
            if getattr(self, field) is None:
                setattr(self, field, read(field, "none"))
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = read("zero3_save_16bit_model", "false").lower() in _TRUE
        if self.zero3_init_flag is None:
            self.zero3_init_flag = read("zero3_init_flag", str(self.zero_stage == 3)).lower() in _TRUE
        if self.hf_ds_config is None:
            path = read("deepspeed_config_file", "none")
            self.hf_ds_config = None if path == "none" else path

    def _build_config(self) -> None:
        def offload(device: str, path: str) -> dict:
            return {"device": device, "nvme_path": path if device == "nvme" else None}

        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": offload(self.offload_optimizer_device, self.offload_optimizer_nvme_path),
                "offload_param": offload(self.offload_param_device, self.offload_param_nvme_path),
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        self.hf_ds_config = HfDeepSpeedConfig(config)
        self._finish()

    def _adopt_config(self) -> None:
        if not isinstance(self.hf_ds_config, HfDeepSpeedConfig):
            self.hf_ds_config = HfDeepSpeedConfig(self.hf_ds_config)
        config = self.hf_ds_config
        if "zero_optimization" not in config.config:
            raise ValueError("the DeepSpeed config has no zero_optimization section: add "
                             '"zero_optimization": {"stage": 2} (0 to 3) to it')
        fields = {"zero_optimization.stage": "zero_stage",
                  "zero_optimization.offload_optimizer.device": "offload_optimizer_device",
                  "zero_optimization.offload_param.device": "offload_param_device",
                  "zero_optimization.stage3_gather_16bit_weights_on_model_save": "zero3_save_16bit_model",
                  "gradient_accumulation_steps": "gradient_accumulation_steps",
                  "gradient_clipping": "gradient_clipping"}
        config.fill_auto(**{key: getattr(self, field) for key, field in fields.items()
                            if getattr(self, field) not in (None, "auto")})
        for key, field in fields.items():  # what the config sets wins, as under Accelerate
            value = config.get_value(key)
            if value is not None and value != "auto":
                setattr(self, field, value)
        self._finish()

    def _finish(self) -> None:
        self.hf_ds_config.config["steps_per_print"] = self.hf_ds_config.config.get("steps_per_print", float("inf"))
        self.hf_ds_config.set_stage_and_offload()

    @property
    def deepspeed_config(self) -> dict:
        """The config dict itself (filled further when the model is prepared)."""
        return self.hf_ds_config.config

    def is_auto(self, ds_key_long: str) -> bool:
        return self.hf_ds_config.is_auto(ds_key_long)

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return self.hf_ds_config.get_value(ds_key_long, default)

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Turn on the config's ``fp16``/``bf16`` section for the Accelerator's precision; a
        config that enables the other one is refused with both."""
        config = self.deepspeed_config
        wanted = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}.get(mixed_precision)
        other = {"fp16": "bf16", "bf16": "fp16"}.get(wanted or "")
        if other is not None and config.get(other, {}).get("enabled") is True:
            raise ValueError(f"mixed_precision={mixed_precision!r} but the DeepSpeed config enables {other}: "
                             f"give Accelerator(mixed_precision={other!r}), or set {other}.enabled to false")
        if wanted is not None:
            if wanted not in config:  # made here: fp16 casts the inputs too, as Accelerate's section does
                config[wanted] = {"enabled": True, "auto_cast": True} if wanted == "fp16" else {"enabled": True}
            section = config[wanted]
            if section.get("enabled") == "auto":
                section["enabled"] = True
        for name in ("fp16", "bf16"):
            section = config.setdefault(name, {"enabled": False})
            if section.get("enabled") == "auto":
                section["enabled"] = False

    def config_precision(self) -> str:
        """The precision the config trains in: ``"fp16"``, ``"bf16"`` or ``"no"``."""
        for name in ("fp16", "bf16"):
            if self.hf_ds_config.is_true(f"{name}.enabled"):
                return name
        return "no"


class DummyOptim:
    """An optimizer the DeepSpeed config's ``optimizer`` section describes (Accelerate's name):
    ``DummyOptim(model.parameters(), lr=1e-3)``; the prepared one is DeepSpeed's."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """A scheduler the DeepSpeed config's ``scheduler`` section describes, or one made by
    ``lr_scheduler_callable(optimizer)`` once DeepSpeed made the optimizer (Accelerate's name)."""

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Any = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def adopt_deepspeed_plugin(plugin: Any) -> DeepSpeedPlugin:
    """Ours as it is; Accelerate's ``DeepSpeedPlugin`` by its config (already filled from its fields)."""
    if isinstance(plugin, DeepSpeedPlugin):
        return plugin
    config = getattr(plugin, "deepspeed_config", None)
    if not isinstance(config, dict):
        raise TypeError(f"deepspeed_plugin must be a DeepSpeedPlugin, not {type(plugin).__name__}")
    return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=getattr(plugin, "zero3_init_flag", None))


def deepspeed_plugin_from_environment(environ: Mapping[str, str] | None = None) -> DeepSpeedPlugin | None:
    """The plugin ``ACCELERATE_USE_DEEPSPEED=true`` asks for (``nblaunch launch`` and ``accelerate
    launch`` with a config file's ``deepspeed_config``), else None."""
    environ = os.environ if environ is None else environ
    if environ.get(ACCELERATE_USE_DEEPSPEED, "false").lower() not in _TRUE:
        return None
    return DeepSpeedPlugin(environ=environ)
