"""``TorchDynamoPlugin``: how ``prepare`` compiles a model (``torch.compile``), with Accelerate's
fields and the ``ACCELERATE_DYNAMO_*`` variables it reads (``nblaunch launch --dynamo_backend``,
a config file's ``dynamo_config``, ``accelerate launch --dynamo_backend``).

Example::

    Accelerator(dynamo_backend="inductor")
    Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode="max-autotune", fullgraph=True))
    TorchDynamoPlugin().backend     # "no" unless ACCELERATE_DYNAMO_BACKEND says otherwise
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Mapping

from nblaunch.training.options.fsdp_environment import flag_value

__all__ = ["TorchDynamoPlugin", "DynamoBackend", "adopt_dynamo_plugin", "DYNAMO_VARIABLES"]


class DynamoBackend(str, enum.Enum):
    """Accelerate's names of ``torch.compile`` backends (any backend torch lists is taken as a string too)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    CUDAGRAPHS = "CUDAGRAPHS"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    OPENXLA = "OPENXLA"
    TVM = "TVM"

_PREFIX = "ACCELERATE_DYNAMO_"
DYNAMO_VARIABLES = tuple(_PREFIX + name for name in
                         ("BACKEND", "MODE", "USE_FULLGRAPH", "USE_DYNAMIC", "USE_REGIONAL_COMPILATION"))


@dataclass
class TorchDynamoPlugin:
    """Compile prepared models with ``torch.compile``, as the last step of ``prepare`` (after DDP
    or FSDP2 and mixed precision), as Accelerate does.

    Args:
        backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ``"eager"``...) or
            ``"no"``; None reads ``ACCELERATE_DYNAMO_BACKEND`` (default ``"no"``). Accelerate's
            ``DynamoBackend`` members are taken too.
        mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``; None reads ``ACCELERATE_DYNAMO_MODE``.
        fullgraph: refuse graph breaks (the whole forward in one graph); None reads ``ACCELERATE_DYNAMO_USE_FULLGRAPH``.
        dynamic: trace with dynamic shapes (None: torch decides); None reads ``ACCELERATE_DYNAMO_USE_DYNAMIC``.
        options: a dict of backend options (``torch.compile``'s ``options``).
        disable: ``torch.compile`` turned into a no-op.
        use_regional_compilation: compile each repeated block (the modules of a ``ModuleList``)
            on its own instead of the whole model: the blocks share one compiled graph, so a deep
            model compiles in the time of one block; None reads ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION``.
    """

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        self.fill_from(os.environ)

    def fill_from(self, environ: Mapping[str, str]) -> None:
        """Fields left None take the ``ACCELERATE_DYNAMO_*`` values of ``environ``."""
        if self.backend is None:
            self.backend = environ.get(_PREFIX + "BACKEND", "no")
        self.backend = str(getattr(self.backend, "value", self.backend)).lower()  # DynamoBackend.INDUCTOR
        if self.mode is None:
            self.mode = environ.get(_PREFIX + "MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = flag_value(_PREFIX + "USE_FULLGRAPH", environ.get(_PREFIX + "USE_FULLGRAPH", "false"))
        if self.dynamic is None and environ.get(_PREFIX + "USE_DYNAMIC") is not None:
            self.dynamic = flag_value(_PREFIX + "USE_DYNAMIC", environ[_PREFIX + "USE_DYNAMIC"])
        if self.use_regional_compilation is None:
            name = _PREFIX + "USE_REGIONAL_COMPILATION"
            self.use_regional_compilation = flag_value(name, environ.get(name, "false"))

    @property
    def enabled(self) -> bool:
        """Whether ``prepare`` compiles at all."""
        return self.backend != "no" and not self.disable

    def to_kwargs(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments."""
        kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": bool(self.fullgraph), "dynamic": self.dynamic}
        if self.options:  # torch refuses mode and options together: options win, as in torch.compile
            kwargs["options"] = self.options
        elif self.mode not in (None, "default"):
            kwargs["mode"] = self.mode
        return kwargs


def adopt_dynamo_plugin(plugin: Any) -> TorchDynamoPlugin:
    """Our plugin for ``plugin``: itself, or Accelerate's ``TorchDynamoPlugin`` read field by field."""
    if isinstance(plugin, TorchDynamoPlugin):
        return plugin
    if type(plugin).__name__ != "TorchDynamoPlugin":
        raise TypeError(f"dynamo_plugin must be a TorchDynamoPlugin, got {type(plugin).__qualname__}")
    return TorchDynamoPlugin(**{name: getattr(plugin, name, None) for name in
                                ("backend", "mode", "fullgraph", "dynamic", "options", "use_regional_compilation")},
                             disable=bool(getattr(plugin, "disable", False)))
