"""Run a function on a module the moment it is imported, or at once if it already is.

For the few places nblaunch must adjust torch without importing it (importing nblaunch never
imports torch): the note of the line that initialised CUDA, a rank's rendezvous. A one-shot
finder at the front of ``sys.meta_path`` wraps the module's loader and leaves once it has run.

Example::

    when_imported("torch.cuda", lambda module: print(module.is_initialized()))
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Callable


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` once module ``name`` has loaded (now, if it has). ``then`` must not raise."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    else:
        sys.meta_path.insert(0, _OnLoad(name, then))


class _OnLoad(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._then = then

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001  importlib's signature
        if fullname != self._name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once, and before the search below finds this finder again
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, then = loader.exec_module, self._then

        def exec_module(module: ModuleType) -> None:
            run(module)
            then(module)

        loader.exec_module = exec_module
        return spec
