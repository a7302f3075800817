"""Where ranks keep what ``torch.compile`` compiled, so the next launch finds it, and how many
compile workers each rank starts.

Every launch starts fresh processes: a compiled model would compile again at every re-run of
its cell. Inductor keeps its compiled graphs, kernels and autotuning results on disk
(``TORCHINDUCTOR_CACHE_DIR``; Triton's kernels go under it) and looks there first; torch's own
default is ``/tmp/torchinductor_<user>``, lost with ``/tmp``. Each launch gives its ranks one
folder per torch version instead::

    $NBLAUNCH_COMPILE_CACHE/torch-<version>/      default ~/.cache/nblaunch/compile ($XDG_CACHE_HOME)

shared by a launch's ranks and kept across launches and kernel restarts. A new torch gets a new
folder; changed code makes a different graph, whose key is not found (Inductor's keys hash the
graph, its inputs and the config). A ``TORCHINDUCTOR_CACHE_DIR`` the user set is kept.

Inductor compiles in a pool of worker processes, as many as the process may use cores: every rank
of a launch compiles at once, so each gets its share (``TORCHINDUCTOR_COMPILE_THREADS``, unless
the user set it), as each gets its share of intra-op threads.

Example::

    compile_cache_environ({"HOME": "/home/ada"})
    # {"TORCHINDUCTOR_CACHE_DIR": "/home/ada/.cache/nblaunch/compile/torch-2.13.0"}
"""

from __future__ import annotations

import functools
import getpass
import os
import sys
from importlib import metadata
from typing import Mapping

from nblaunch.contract import variables as v
from nblaunch.launch.planning.threads import usable_cores

__all__ = ["compile_environ", "compile_cache_environ", "compile_cache_dir"]


def compile_environ(num_processes: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a launch's ``num_processes`` ranks on a machine are given for compiling: the cache
    folder and each one's share of compile workers."""
    environ = os.environ if environ is None else environ
    given = compile_cache_environ(environ)
    if v.TORCHINDUCTOR_COMPILE_THREADS not in environ:
        given[v.TORCHINDUCTOR_COMPILE_THREADS] = str(max(1, usable_cores() // num_processes))
    return given


def compile_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The folder this torch's compiled code is kept in (see the module)."""
    environ = os.environ if environ is None else environ
    root = environ.get(v.COMPILE_CACHE)
    if not root:
        cache_home = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"),
                                                                   ".cache")
        root = os.path.join(cache_home, "nblaunch", "compile")
    return os.path.join(root, f"torch-{_torch_version()}")


def compile_cache_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``TORCHINDUCTOR_CACHE_DIR`` for the ranks, unless the user chose one (or the folder
    cannot be made: torch's default then)."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(v.TORCHINDUCTOR_CACHE_DIR)
    # torch writes its default into os.environ when imported: that is no one's choice
    if chosen and os.path.basename(chosen.rstrip(os.sep)) != _torch_default_name():
        return {}
    folder = compile_cache_dir(environ)
    return {v.TORCHINDUCTOR_CACHE_DIR: folder} if _usable(folder) else {}


@functools.lru_cache(maxsize=None)
def _usable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:  # a read-only home: torch's default in /tmp still works
        return False
    return os.access(folder, os.W_OK)


def _torch_default_name() -> str:
    """The name of torch's default folder (in the temporary folder of the moment it was imported)."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001  no user name: torch's own fallback is this too
        user = "unknown"
    return "torchinductor_" + user.replace(os.sep, "_")


@functools.lru_cache(maxsize=None)
def _torch_version() -> str:
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None) or metadata.version("torch")
    return str(version).replace(os.sep, "_")
