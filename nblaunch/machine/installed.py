"""Which loaded modules are installed libraries: what a rank may find imported ahead of it.

A module counts when its top-level package sits right in one of this interpreter's
site-packages folders (pip's, or Debian's dist-packages). Code of the user's own (the notebook's
folder, a path added to ``sys.path``, an editable install) never does: it may change between two
launches, and each launch must import it afresh. Nor does the standard library: it costs a rank
little, and some of it changes the process that imports it (``readline`` takes over signals).

Example::

    before = len(sys.modules)
    import sklearn.datasets
    installed_modules(loaded_since(before))   # ['sklearn', 'sklearn.base', ..., 'sklearn.datasets']
"""

from __future__ import annotations

import functools
import itertools
import os
import site
import sys
import sysconfig
from collections.abc import Iterable

# Not libraries a rank loads for itself: the process's entry point, multiprocessing's alias of it.
_NEVER = frozenset({"__main__", "__mp_main__"})


_SITE_FOLDER_NAMES = ("site-packages", "dist-packages")  # pip's, and Debian's (Colab's Python is Debian's)


@functools.lru_cache(maxsize=1)
def library_folders() -> tuple[str, ...]:
    """Every site-packages folder of this interpreter (its own, and any on ``sys.path``: a venv
    that sees the system's packages, a ``.pth`` that adds some), each ending in a separator."""
    folders = {sysconfig.get_path(key) for key in ("purelib", "platlib")}
    try:
        folders.update(site.getsitepackages())
        folders.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module: sysconfig's paths are enough
        pass
    folders.update(p for p in sys.path if os.path.basename(os.path.normpath(p or ".")) in _SITE_FOLDER_NAMES)
    return tuple(sorted(os.path.realpath(f) + os.sep for f in folders if f))


def top_level(name: str) -> str:
    """``"sklearn"`` for ``"sklearn.datasets._base"``."""
    return name.partition(".")[0]


def is_installed_package(name: str) -> bool:
    """Whether the loaded top-level package ``name`` is an installed library (see the module):
    it sits right in one of ``library_folders()``, as ``name/`` or ``name.py`` (``name.*.so``),
    so it imports by its name from any process of this interpreter (a library's vendored copy of
    another, added to ``sys.path`` at run time, does not)."""
    if name in sys.stdlib_module_names:
        return False
    namespace = _namespace(sys.modules.get(name))
    spec = namespace.get("__spec__")
    origin = getattr(spec, "origin", None) or namespace.get("__file__")
    if isinstance(origin, str):
        place = os.path.dirname(os.path.realpath(origin))
        if getattr(spec, "submodule_search_locations", None) is not None:  # a package: name/__init__.py
            place = os.path.dirname(place)
    else:  # built in, frozen, or a namespace package: its folders
        folder = next(iter(getattr(spec, "submodule_search_locations", None) or []), None)
        if not isinstance(folder, str):
            return False
        place = os.path.dirname(os.path.realpath(folder))
    return place + os.sep in library_folders()


def loaded_since(count: int) -> list[str]:
    """The names of the modules loaded since ``sys.modules`` held ``count`` of them, in order.
    Only those are read: a forked rank that went through every module would write to (and so
    copy) the pages of every module object of its parent, milliseconds of its exit."""
    new = len(sys.modules) - count
    return list(itertools.islice(reversed(sys.modules), max(new, 0)))[::-1]


def installed_modules(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that are loaded installed modules, each importable by its name, in order."""
    verdicts: dict[str, bool] = {}
    found = []
    for name in names:
        module = sys.modules.get(name)
        if name in _NEVER or module is None:
            continue
        spec = _namespace(module).get("__spec__")
        if getattr(spec, "name", None) != name:  # an alias (six.moves, ...): not importable as such
            continue
        top = top_level(name)
        if top not in verdicts:
            verdicts[top] = top != "nblaunch" and is_installed_package(top)
        if verdicts[top]:
            found.append(name)
    return found


def _namespace(module: object) -> dict:
    """A module's own attributes, read without its ``__getattr__`` (a lazy module imports there)."""
    namespace = getattr(module, "__dict__", None)
    return namespace if isinstance(namespace, dict) else {}
