"""Packaging the user's function and arguments, and naming the culprit when that fails.

Spawned workers need ``(function, args)`` pickled; forked workers do not, but we check both
the same way so a notebook that works with fork also works with spawn, and so the error comes
before any process starts. The check skips the bytes of tensors and arrays (always picklable,
and copying a 1.5 GB data set just to check it would cost seconds and memory).
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
import types
from typing import Any, Callable, Iterator

import cloudpickle

from nblaunch.launch.errors import LaunchConfigError


class _NullSink(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        return len(data)


def _bulk_array_types() -> tuple[type, ...]:
    found = []
    for module, name in (("torch", "Tensor"), ("numpy", "ndarray")):
        mod = sys.modules.get(module)  # only types the program already uses can appear
        if mod is not None:
            found.append(getattr(mod, name))
    return tuple(found)


class _CheckingPickler(cloudpickle.Pickler):
    """Pickles into nothing, standing in a token for every tensor or array."""

    def __init__(self, skip: tuple[type, ...]):
        super().__init__(_NullSink(), protocol=pickle.HIGHEST_PROTOCOL)
        self._skip = skip

    def persistent_id(self, obj: Any):
        if self._skip and isinstance(obj, self._skip):
            return id(obj)
        return None


def _check(obj: Any) -> None:
    _CheckingPickler(_bulk_array_types()).dump(obj)


def _children(obj: Any, where: str) -> Iterator[tuple[str, Any]]:
    """The parts of ``obj`` that pickling it would pickle, each with a phrase saying where."""
    if isinstance(obj, types.FunctionType):
        name = obj.__name__
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f"closure variable `{var}` of `{name}`", cell.cell_contents
            except ValueError:  # empty cell
                continue
        for var in sorted(_global_names(obj.__code__)):
            if var in obj.__globals__:
                yield f"global `{var}` used by `{name}`", obj.__globals__[var]
        for i, default in enumerate(obj.__defaults__ or ()):
            yield f"default argument {i} of `{name}`", default
        for key, default in (obj.__kwdefaults__ or {}).items():
            yield f"default of `{key}` in `{name}`", default
    elif isinstance(obj, types.MethodType):
        yield f"the object `{obj.__func__.__name__}` is bound to", obj.__self__
        yield where, obj.__func__
    elif isinstance(obj, functools.partial):
        yield f"{where} (the partial's function)", obj.func
        for i, arg in enumerate(obj.args):
            yield f"partial argument {i} of {where}", arg
        for key, arg in obj.keywords.items():
            yield f"partial argument `{key}` of {where}", arg
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, item in enumerate(obj):
            yield f"item {i} of {where}", item
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield f"key {key!r} of {where}", item
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for attr, item in vars(obj).items():
            yield f"attribute `{attr}` of {where}", item


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _find_culprit(obj: Any, where: str, depth: int = 0, seen: set[int] | None = None):
    """Return (where, obj, error) for the innermost part that cannot be pickled, or None."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return None
    seen.add(id(obj))
    try:
        _check(obj)
        return None
    except Exception as error:  # pickling raises many types: TypeError, PicklingError, ...
        if depth < 8:
            for child_where, child in _children(obj, where):
                found = _find_culprit(child, child_where, depth + 1, seen)
                if found is not None:
                    return found
        return where, obj, error


def check_picklable(function: Callable, args: tuple) -> None:
    """Raise LaunchConfigError naming the object that cannot be sent to the workers."""
    try:
        _check((function, args))
        return
    except Exception:
        pass
    name = getattr(function, "__name__", repr(function))
    parts = [(f"the function `{name}`", function)] + [
        (f"argument {i} of the launch (args[{i}])", arg) for i, arg in enumerate(args)
    ]
    for where, part in parts:
        found = _find_culprit(part, where)
        if found is not None:
            culprit_where, culprit, error = found
            raise LaunchConfigError(
                f"cannot send `{name}` to the workers: {culprit_where} holds a "
                f"{type(culprit).__module__}.{type(culprit).__qualname__}, which cannot be "
                f"pickled ({error}). Create it inside the function instead of outside, or pass "
                "what is needed to create it."
            ) from error
    raise LaunchConfigError(f"cannot pickle `{name}` and its arguments for the workers")
