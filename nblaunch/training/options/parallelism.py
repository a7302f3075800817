"""``ParallelismConfig``: Accelerate's N-D parallelism sizes (``dp_replicate_size``,
``dp_shard_size``, ``tp_size``) over one ``DeviceMesh``, and the tensor-parallel plan a model is
split by. Unset sizes are read from Accelerate's ``PARALLELISM_CONFIG_*`` variables, else 1.

Beyond Accelerate, whose ``prepare`` needs a model already split: ``tp_plan`` (or the model's own,
for a ``transformers`` model) is applied by ``prepare``, on NCCL and gloo alike.

Example::

    config = ParallelismConfig(tp_size=2, tp_plan={"*.q": "colwise", "*.o": "rowwise"})
    config.total_size                       # 2
    mesh = config.build_device_mesh("cpu")  # mesh["tp"]: the ranks that split each matmul
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from nblaunch.contract.variables import ACCELERATE_USE_PARALLELISM_CONFIG, PARALLELISM_VARIABLES

__all__ = ["ParallelismConfig", "adopt_parallelism_config", "parallelism_config_from_environment"]

_ORDER = ("dp_replicate", "dp_shard", "tp")  # tp innermost: a TP group's ranks are neighbours


@dataclass
class ParallelismConfig:
    """How the ranks are laid out: ``dp_replicate_size`` x ``dp_shard_size`` x ``tp_size`` must be
    the number of processes.

    Args:
        dp_replicate_size: groups that hold whole copies (DDP between them).
        dp_shard_size: ranks that shard parameters with FSDP2 (needs an ``fsdp_plugin``).
        tp_size: ranks that split each planned layer (tensor parallelism).
        cp_size, sp_size: context and sequence parallelism: not supported (refused above 1).
        tp_plan: module-name patterns (``fnmatch``, ``*`` any part) to a style: ``"colwise"``,
            ``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``, ``"replicate"``, or
            a torch ``ParallelStyle``. None: the model's own (``transformers``' ``tp_plan``).
        tp_handler, cp_handler, sp_handler, cp_backend, sp_backend: Accelerate's; accepted.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    sp_size: int | None = None
    tp_plan: Mapping[str, Any] | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    cp_backend: Any = None
    sp_backend: Any = None

    def __post_init__(self) -> None:
        for field_name, variable in PARALLELISM_VARIABLES.items():
            if getattr(self, field_name) is None:
                setattr(self, field_name, int(os.environ.get(variable, "1")))
        if self.sp_size is None:
            self.sp_size = 1
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig({name}={value!r}): give a whole number of at least 1")
        for name in ("cp_size", "sp_size"):
            if getattr(self, name) > 1:
                raise NotImplementedError(f"ParallelismConfig({name}={getattr(self, name)}): context and sequence "
                                          "parallelism are not supported by nblaunch; use tp_size and dp_shard_size")
        if self.tp_enabled and self.dp_replicate_size > 1:
            raise ValueError(f"ParallelismConfig(tp_size={self.tp_size}, dp_replicate_size={self.dp_replicate_size}): "
                             "tensor parallelism with whole copies is not supported (as in Accelerate): shard "
                             "between the copies instead (dp_shard_size with an fsdp_plugin)")

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    def check_world(self, num_processes: int) -> None:
        """Refuse sizes that do not multiply to the number of processes, saying what would."""
        if self.total_size != num_processes:
            raise ValueError(f"ParallelismConfig: dp_replicate_size {self.dp_replicate_size} x dp_shard_size "
                             f"{self.dp_shard_size} x tp_size {self.tp_size} = {self.total_size}, but there are "
                             f"{num_processes} processes: make the sizes multiply to {num_processes} (tp_size must "
                             f"divide it)")

    def build_device_mesh(self, device_type: str) -> Any:
        """The mesh of the enabled dimensions (``"dp_replicate"``, ``"dp_shard"``, ``"tp"``; one
        dimension ``"tp"`` of size 1 when none is)."""
        from torch.distributed.device_mesh import init_device_mesh  # deferred: only a launch with a config needs it

        names = [name for name in _ORDER if getattr(self, f"{name}_size") > 1] or ["tp"]
        shape = tuple(getattr(self, f"{name}_size") for name in names)
        return init_device_mesh(device_type, shape, mesh_dim_names=tuple(names))


def adopt_parallelism_config(config: Any) -> ParallelismConfig:
    """Ours as it is; Accelerate's by its sizes (its tp handler is accepted, its model must be
    split by us or already split)."""
    if isinstance(config, ParallelismConfig):
        return config
    names = {f.name for f in fields(ParallelismConfig)}
    values = {name: getattr(config, name) for name in names if hasattr(config, name)}
    if not values:
        raise TypeError(f"parallelism_config must be a ParallelismConfig, not {type(config).__name__}")
    if values.get("tp_plan") is None:
        values.pop("tp_plan", None)
    return ParallelismConfig(**values)


def parallelism_config_from_environment() -> ParallelismConfig | None:
    """The config ``ACCELERATE_USE_PARALLELISM_CONFIG=true`` asks for (``accelerate launch`` sets it
    with the sizes), else None."""
    if os.environ.get(ACCELERATE_USE_PARALLELISM_CONFIG, "false").lower() not in ("1", "true", "yes"):
        return None
    return ParallelismConfig()
