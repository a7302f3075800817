"""Importing what a launch's ranks will import (``rank_imports``) in the process they are forked
from, before the fork: each library is imported once there instead of once in every rank, and
every later launch finds it loaded.

This process does it for the ranks it forks (:class:`Preload`), on the caller's behalf while the
caller waits in the launch (its thread is inside ``notebook_launcher``: no cell of the user's
runs meanwhile, so nothing of theirs meets a library half imported). It imports on a thread of
its own and waits for each library at most ``WAIT_FOR_A_PACKAGE_S``; one that takes longer is
left to the ranks (a rank forked meanwhile forgets what was half imported and imports it itself:
``worker.starting.inherited.forget_half_imported``). What an import writes into ``os.environ`` is put
back and handed to the ranks; what it prints lands in the launching cell, whose launch asked for
it. The launch server does the same in its own process (``server_process``), where a library
that starts CUDA or a thread, or reads a rank's variables at import, would break the ranks
forked after it (``judge``).

A library imported here for the ranks cannot be taken back. Where it was installed anew since
(``pip install -U``), or its import read a variable that has changed since, forked ranks drop it
and import it afresh (``Preloaded.forget``). A process that imported libraries for its ranks
exits lightly (``_exit_lightly``): its teardown would otherwise walk every object of theirs.

Example::

    done = preload_here().preload(rank_imports.wanted(train, args))
    done.environ, done.forget   # for the ranks
    done.said                   # "sklearn, torch._dynamo imported here first (2.8 s)", for the launch's line
"""

from __future__ import annotations

import atexit
import contextvars
import dataclasses
import gc
import importlib
import os
import sys
import threading
import time
from collections.abc import Iterable

from nblaunch.contract import variables
from nblaunch.environ_watch import EnvironWatch, watched_environ
from nblaunch.launch.starting.rank_imports import Wanted
from nblaunch.machine.cuda import cuda_initialized
from nblaunch.machine.installed import top_level
from nblaunch.per_process import per_process

WAIT_FOR_A_PACKAGE_S = 10.0  # a launch waits this long for one library's import here, then forks
SAID_FROM_S = 0.1  # imports for the ranks that took this long are said in the launch's line
OK = "ok"
CUDA = "initialises CUDA"
THREADS = "starts threads"
# A rank's own variables, set only when it starts: a library imported before must not read them.
RANK_VARIABLES = frozenset({variables.RANK, variables.LOCAL_RANK, variables.WORLD_SIZE, variables.LOCAL_WORLD_SIZE,
                            variables.NODE_RANK, variables.GROUP_RANK, variables.MASTER_ADDR, variables.MASTER_PORT,
                            variables.TORCHELASTIC_RUN_ID})
_SAID_AT_MOST = 200  # characters of an exception kept in a verdict
Stamp = tuple[str, int, int]  # a package's file, its inode and modification time


def preloading() -> bool:
    """``NBLAUNCH_PRELOAD=0`` turns preloading off: the ranks import everything themselves."""
    return os.environ.get(variables.PRELOAD, "1").strip() != "0"


def by_package(wanted: Iterable[Wanted]) -> list[tuple[str, list[Wanted]]]:
    """``wanted`` grouped by top-level package, in the order each first appears."""
    groups: dict[str, list[Wanted]] = {}
    for name, names in wanted:
        groups.setdefault(top_level(name), []).append((name, names))
    return list(groups.items())


def first_new(package: str, modules: list[Wanted]) -> str:
    """How one package's imports are named for the user: the package, or where it is loaded
    already, its first module that is not (``torch._dynamo``)."""
    if package not in sys.modules:
        return package
    return next((name for name, _ in modules if name not in sys.modules), package)


@dataclasses.dataclass
class Judged:
    """What importing one package did: its verdict, what it read and wrote in ``os.environ``
    (written is put back), and the modules that would not import by their name."""

    verdict: str
    environ: EnvironWatch
    failed: list[str]


def judge(modules: list[Wanted], *, strict: bool) -> Judged:
    """Import one package's ``modules`` (and the names a ``from`` import takes, which may be
    submodules or a lazy module's attributes). ``strict`` (a process that must stay fit to fork
    ranks for GPUs): starting CUDA or a Python thread, or reading a rank's variables, is a verdict
    of its own. A module that does not import by its name is skipped (some are made by their
    package at run time); the package raising is the verdict: its ranks meet the same themselves."""
    threads, failed = threading.active_count(), []
    with watched_environ() as environ:
        try:
            importlib.import_module(top_level(modules[0][0]))
        except BaseException as error:  # noqa: BLE001  a sys.exit() at import too: the ranks meet it themselves
            return Judged(f"raised {type(error).__name__}: {error}"[:_SAID_AT_MOST], environ, [])
        for name, names in modules:
            try:
                module = importlib.import_module(name)
                for attribute in names:
                    _take(module, attribute)
            except BaseException:  # noqa: BLE001  see the docstring
                failed.append(name)
    verdict = OK
    read = sorted(environ.read & RANK_VARIABLES)
    if strict and cuda_initialized():
        verdict = CUDA
    elif strict and threading.active_count() > threads:
        verdict = THREADS
    elif strict and read:
        verdict = f"reads {read[0]} at import"
    return Judged(verdict, environ, failed)


def _take(module: object, attribute: str) -> None:
    """What ``from module import attribute`` does: the attribute, else the submodule."""
    try:
        getattr(module, attribute)
    except AttributeError:
        importlib.import_module(f"{module.__name__}.{attribute}")


def stamps(packages: Iterable[str]) -> dict[str, Stamp | None]:
    """Each loaded package's file as it is on disk now (None where there is none): a package
    installed anew (``pip install -U``) has a new file."""
    return {package: _stamp(getattr(sys.modules.get(package), "__file__", None)) for package in packages}


def changed(before: dict[str, Stamp | None]) -> list[str]:
    """The packages of ``before`` whose file is not what it was then."""
    return [p for p, stamp in before.items() if stamp is not None and _stamp(stamp[0]) != stamp]


def _stamp(path: object) -> Stamp | None:
    if not isinstance(path, str):
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return path, status.st_ino, status.st_mtime_ns


@dataclasses.dataclass(frozen=True)
class Preloaded:
    """What a preload leaves the next fork: the variables the imports set (for the ranks), the
    modules forked ranks must import afresh, and what was imported now (for the cell)."""

    environ: dict[str, str]
    forget: tuple[str, ...] = ()
    said: str = ""


@dataclasses.dataclass
class _Brought:
    stamp: dict[str, Stamp | None]
    read: dict[str, str | None]  # what its import read from os.environ, and the values then


def _exit_lightly() -> None:
    """At this process's exit, once it imported libraries for its ranks: the garbage there is now
    is collected (its finalizers run), then what is left is frozen, so the interpreter's teardown
    does not walk every object of those libraries again and again (torch._dynamo and scikit-learn
    added 0.6 s to a script's exit)."""
    gc.collect()
    gc.freeze()


class Preload:
    """This process's imports for the ranks it forks (see the module). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one preload at a time: launches on several threads
        self._environ: dict[str, str] = {}  # what the imports set, for the ranks
        self._brought: dict[str, _Brought] = {}  # packages first imported here by a preload
        self.refused: dict[str, str] = {}  # never imported here for the ranks again, and why
        self._failed: set[str] = set()  # modules that would not import by their name: not tried again
        self._said: set[str] = set()  # packages a notice was given for
        self._exits_lightly = False

    def preload(self, wanted: list[Wanted], only: frozenset[str] | None = None) -> Preloaded:
        """Import ``wanted`` here (only the modules ``only`` names, where given), each package
        at most ``WAIT_FOR_A_PACKAGE_S``; see the module."""
        with self._lock:
            stale = self._stale()
            skipped = set(stale) | set(self.refused) | self._failed
            todo = []
            for package, modules in by_package(wanted):
                modules = [(m, names) for m, names in modules if (only is None or m in only)
                           and (names or m not in sys.modules) and m not in skipped]
                if modules and package not in skipped:
                    todo.append((package, modules))
            began = time.monotonic()
            if todo and not self._exits_lightly:
                self._exits_lightly = True
                atexit.register(_exit_lightly)  # registered late: it runs before the earlier ones
            imported = _Importing(todo, self).run() if todo else []
            forget = tuple(name for name in list(sys.modules) if top_level(name) in stale)
            said, took = "", time.monotonic() - began
            if imported and took >= SAID_FROM_S:
                said = f"{', '.join(imported)} imported here first ({took:.1f} s)"
            return Preloaded(dict(self._environ), forget, said)

    def notices(self) -> list[str]:
        """Lines for the cell, each said once: packages that could not be imported here for the
        ranks, and those installed anew (or whose variables changed) since they were."""
        lines = []
        for package, why in list(self.refused.items()):
            if package not in self._said:
                self._said.add(package)
                lines.append(f"could not import {package} here for the ranks: {why}. Each launch's ranks import it "
                             "themselves.")
        for package, why in self._stale().items():
            if package not in self._said:
                self._said.add(package)
                lines.append(f"{package} {why} since this process imported it for the ranks: each launch's ranks "
                             "import it afresh (restart the kernel to have it imported here once again).")
        return lines

    def brought(self) -> list[str]:
        """The packages imported here for the ranks, in order."""
        with self._lock:
            return list(self._brought)

    def _stale(self) -> dict[str, str]:
        stale: dict[str, str] = {}
        for package, brought in list(self._brought.items()):
            if changed(brought.stamp):
                stale[package] = "was installed anew"
                continue
            moved = sorted(name for name, value in brought.read.items() if os.environ.get(name) != value)
            if moved:
                stale[package] = f"read {moved[0]} at import, which has changed"
        return stale

    def _record(self, package: str, shown: str, new: bool, judged: Judged) -> None:
        self._environ.update(judged.environ.written)
        self._failed.update(judged.failed)
        if judged.verdict != OK:
            self.refused[shown] = judged.verdict
        elif new:  # a package of the user's own (or torch's) is theirs, as if they had imported it
            read = {name: os.environ.get(name) for name in judged.environ.read if name != "*"}
            self._brought[package] = _Brought(stamps([package]), read)


class _Importing:
    """The imports of one preload, on a thread of their own (in the caller's context: what they
    print lands in the launching cell); the caller waits for each at most WAIT_FOR_A_PACKAGE_S."""

    def __init__(self, todo: list[tuple[str, list[Wanted]]], preload: Preload) -> None:
        self._todo, self._preload = todo, preload
        self._changed = threading.Condition()
        self._current: tuple[str, float] | None = None
        self._done: list[str] = []
        self._finished = self._abandoned = False

    def run(self) -> list[str]:
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(self._import_all,), name="nblaunch-preload", daemon=True).start()
        try:
            with self._changed:
                while not self._finished:
                    current = self._current
                    left = None if current is None else current[1] + WAIT_FOR_A_PACKAGE_S - time.monotonic()
                    if left is not None and left <= 0:
                        self._preload.refused[current[0]] = (f"its import here had not finished after "
                                                             f"{WAIT_FOR_A_PACKAGE_S:g} s")
                        break
                    self._changed.wait(left)
        finally:
            with self._changed:
                self._abandoned = True  # whatever is under way ends, and nothing after it starts
        return list(self._done)

    def _import_all(self) -> None:
        try:
            for package, modules in self._todo:
                with self._changed:
                    if self._abandoned:
                        return
                    self._current = (package, time.monotonic())
                    self._changed.notify_all()
                shown = first_new(package, modules)
                new, fresh = package not in sys.modules, shown not in sys.modules
                judged = judge(modules, strict=False)
                self._preload._record(package, shown, new, judged)
                with self._changed:
                    if judged.verdict == OK and fresh and shown in sys.modules:
                        self._done.append(shown)
                    self._current = None
        finally:
            with self._changed:
                self._finished = True
                self._changed.notify_all()


preload_here = per_process(Preload)  # a rank's own launches preload for their own ranks
