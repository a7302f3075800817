"""Importing, ahead of the ranks, what they will import: one package at a time, each judged.

Used where ranks come from: a generation of the launch server before it forks ranks
(``server/generation``), and a probe forked from the kernel before the kernel imports for its
forked ranks (``launch/ahead/kernel_preload``). What a package's import did decides
whether the process may still fork ranks after it:

- ``ok``: loaded.
- ``raised ...``: not loaded; the ranks import it themselves, and fail or not as they would.
- ``initialises CUDA``: a process that started CUDA cannot fork a rank whose CUDA works.
- ``reads RANK at import`` (or another of a rank's own variables): where it is loaded ahead
  they are not set yet, and the library would keep the wrong value.
- ``starts threads``: a Python thread was started: a fork copies one thread of several, and
  locks the others held stay held in the child for ever. (Threads of C libraries, OpenBLAS's
  pool, are left alone: they re-make themselves in a fork, as every forked DataLoader worker
  relies on. An OpenMP pool is a hazard only for the thread that ran a parallel region, and a
  generation imports with one intra-op thread: see ``server/generation``.)

Example::

    for package, names in packages_in_order(["sklearn", "sklearn.base", "scipy.linalg"]):
        verdict, environ = load_package(names, watch_threads=True)    # "ok", what it read and set
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable

from nblaunch.contract import variables
from nblaunch.facts.cuda import cuda_initialized
from nblaunch.facts.installed import top_level
from nblaunch.preimport import EnvironWatch, watched_environ

OK = "ok"
CUDA = "initialises CUDA"
THREADS = "starts threads"
READS_RANK = "reads {} at import"
# A rank's own variables, set only when it starts: a library loaded ahead must not read them.
RANK_VARIABLES = frozenset({variables.RANK, variables.LOCAL_RANK, variables.WORLD_SIZE, variables.LOCAL_WORLD_SIZE,
                            variables.NODE_RANK, variables.GROUP_RANK, variables.MASTER_ADDR, variables.MASTER_PORT,
                            variables.TORCHELASTIC_RUN_ID})
_SAID_AT_MOST = 200  # characters of an exception kept in a verdict


def packages_in_order(names: Iterable[str]) -> list[tuple[str, list[str]]]:
    """``names`` grouped by top-level package, packages in the order they first appear and names
    in their own order within each."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(top_level(name), []).append(name)
    return list(groups.items())


def load_package(names: list[str], *, watch_threads: bool) -> tuple[str, EnvironWatch]:
    """Import ``names`` (one package's modules, its top-level one among them or implied) and
    judge what that did to this process; the verdict, and what the import read from and wrote
    into ``os.environ`` (put back: ``preimport.watched_environ``). A submodule that does not
    import by its own name (some are made by their package at run time) is skipped; the package
    itself raising is the verdict."""
    threads_before = _thread_count() if watch_threads else 0
    with watched_environ() as environ:
        try:
            importlib.import_module(top_level(names[0]))
        except Exception as error:  # noqa: BLE001  whatever it raised, the ranks meet it themselves
            return f"raised {type(error).__name__}: {error}"[:_SAID_AT_MOST], environ
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  see the docstring
                continue
    if cuda_initialized():
        return CUDA, environ
    if watch_threads and _thread_count() > threads_before:
        return THREADS, environ
    return OK, environ


def reads_rank_variables(environ: EnvironWatch) -> str | None:
    """``reads RANK at import`` if an import read one of a rank's own variables, else None."""
    read = sorted(environ.read & RANK_VARIABLES)
    return READS_RANK.format(read[0]) if read else None


def _thread_count() -> int:
    return threading.active_count()
