"""Accelerate's small helpers on plain Python values and the environment, under its names:
environment variables read and patched, dicts merged, attributes followed, sizes written out.

Example::

    with patch_environment(omp_num_threads=1):
        os.environ["OMP_NUM_THREADS"]          # "1", removed again at the end
    parse_flag_from_env("ACCELERATE_DEBUG_MODE")   # False unless set to yes/true/1/on
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import warnings
from typing import Any, Iterator

__all__ = ["str_to_bool", "get_int_from_env", "parse_flag_from_env", "parse_choice_from_env", "patch_environment",
           "clear_environment", "purge_accelerate_environment", "convert_dict_to_env_variables", "is_port_in_use",
           "merge_dicts", "recursive_getattr", "get_pretty_name", "convert_bytes"]


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """1 (True with ``to_bool``) for y/yes/t/true/on/1, 0 (False) for n/no/f/false/off/0."""
    value = value.lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if value in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use yes/no, true/false, on/off or 1/0")


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first of ``env_keys`` set to a number >= 0, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    return os.environ.get(key, str(default))


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set ``KEY=str(value)`` for each keyword (upper-cased) and put back what was there after."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``, then put the whole environment back."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorate a function (or each test method of a class) so that ``ACCELERATE_*`` variables it
    sets are removed when it returns."""
    if isinstance(func_or_cls, type):
        for name, member in list(vars(func_or_cls).items()):
            if name.startswith("test") and callable(member):
                setattr(func_or_cls, name, purge_accelerate_environment(member))
        return func_or_cls

    @functools.wraps(func_or_cls)
    def purged(*args: Any, **kwargs: Any) -> Any:
        before = {key for key in os.environ if key.startswith("ACCELERATE_")}
        try:
            return func_or_cls(*args, **kwargs)
        finally:
            for key in [key for key in os.environ if key.startswith("ACCELERATE_") and key not in before]:
                del os.environ[key]

    return purged


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """``KEY=value\\n`` lines for the entries whose key is a valid name and value has no shell
    specials; the others are skipped (with a warning, as they would be unsafe in a file)."""
    lines = []
    for key, value in current_env.items():
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)) and not re.search(r"[<>|;&$`\n]", str(value)):
            lines.append(f"{key}={value}\n")
        else:
            warnings.warn(f"skipping environment variable {key}={value!r}: unsafe in an env file", stacklevel=2)
    return lines


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``port`` (default 29500) of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", port or 29500)) == 0


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge ``source`` into ``destination`` recursively (nested dicts merged, other values
    replaced) and return ``destination``."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attribute: str) -> Any:
    """``obj.a.b.c`` for ``attribute="a.b.c"``."""
    return functools.reduce(getattr, attribute.split("."), obj)


def get_pretty_name(obj: Any) -> str:
    """A readable name for a function, class or instance."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", getattr(obj, "__name__", obj)))


def convert_bytes(size: float) -> str:
    """A byte count written for people: ``convert_bytes(3_500_000)`` is ``"3.34 MB"``."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"

