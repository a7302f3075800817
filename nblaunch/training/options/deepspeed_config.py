"""A DeepSpeed config as Accelerate and ``transformers`` handle it (``HfDeepSpeedConfig``): the
dict, read from a dict, a JSON file, a JSON string or base64, with dotted-key access and the
"auto" values filled from the training's own settings.

Example::

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": "auto"})
    config.is_zero3()                               # True
    config.get_value("zero_optimization.stage")     # 3
    config.fill_auto(train_batch_size=32)           # "auto" values only; a set one is kept
"""

from __future__ import annotations

import base64
import copy
import json
import os
from typing import Any

__all__ = ["HfDeepSpeedConfig", "read_config"]


def read_config(config: Any) -> dict:
    """The config as a new dict, from a dict, an ``HfDeepSpeedConfig`` (ours or Accelerate's),
    a JSON file's path, a JSON string or its base64."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    inner = getattr(config, "config", None)
    if isinstance(inner, dict):
        return copy.deepcopy(inner)
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if os.path.exists(text):
            with open(text, encoding="utf-8") as f:
                return json.load(f)
        try:
            return json.loads(text)
        except ValueError:
            pass
        try:
            return json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            pass
        raise ValueError(f"DeepSpeed config {text[:80]!r} is no file, JSON or base64 JSON: give a dict or a JSON file's path")
    raise TypeError(f"a DeepSpeed config is a dict or a JSON file's path, not {type(config).__name__}")


class HfDeepSpeedConfig:
    """Accelerate's (and ``transformers``') view of a DeepSpeed config dict."""

    def __init__(self, config_file_or_dict: Any) -> None:
        self.config = read_config(config_file_or_dict)
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        self._stage = self.get_value("zero_optimization.stage", -1)
        self._offload = self._stage in (2, 3) and any(
            self.get_value(f"zero_optimization.{part}.device") in ("cpu", "nvme")
            for part in ("offload_optimizer", "offload_param"))

    def find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        """The dict holding the dotted key's last part, and that part (None: a level is missing)."""
        node: Any = self.config
        *levels, key = ds_key_long.split(".")
        for level in levels:
            node = node.get(level) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"{ds_key_long} is not in the DeepSpeed config")
            return
        del node[key]

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_auto(self, ds_key_long: str) -> bool:
        return self.get_value(ds_key_long) == "auto"

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload

    def set(self, ds_key_long: str, value: Any) -> None:
        """Set a dotted key, making the levels it needs."""
        node = self.config
        *levels, key = ds_key_long.split(".")
        for level in levels:
            node = node.setdefault(level, {})
        node[key] = value
        self.set_stage_and_offload()

    def fill_auto(self, **values: Any) -> None:
        """Replace each "auto" at a dotted key (``zero_optimization.stage`` as
        ``**{"zero_optimization.stage": 2}``) by its value; a value the config sets is kept."""
        for key, value in values.items():
            if self.is_auto(key):
                self.set(key, value)

    def autos(self) -> list[str]:
        """The dotted keys still "auto"."""
        found: list[str] = []

        def visit(node: dict, prefix: str) -> None:
            for key, value in node.items():
                if isinstance(value, dict):
                    visit(value, f"{prefix}{key}.")
                elif value == "auto":
                    found.append(prefix + key)

        visit(self.config, "")
        return found
