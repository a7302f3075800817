"""Forked ranks inherit what earlier ranks imported: this process imports it at a launch's end.

After a fork launch, the libraries its ranks imported that this process has not are imported
here, on a thread of its own (``nblaunch-preload``), one package at a time and only while the
caller is parked (``caller``: it would get a library it imports meanwhile half initialised, and
waits for the package under way when it goes on). A launch that blocks its caller (a cell, a loop
inside one, a script) returns once they are loaded (``wait_loaded``), so the next launch's ranks
are forked with them. Where an NVIDIA GPU is, a probe goes first: a fork of this process imports
the same packages and says what each did (``server/loading``); a package that starts CUDA is
never imported here (every later launch would have to go through the launch server). Everything
else was proven by the ranks themselves, forks of this process. What is imported here is imported
as if the user had (a library that starts a thread, or reads ``RANK`` at import, does here what it
would do in a cell), except that what it writes is kept for ``nblaunch.warm_start()``
(``kept_output``).

A launch forks between two packages (``before_fork``): it waits for the package being imported,
but at most 10 s; past that it forks anyway (a rank forked while a package was half imported
forgets it and imports it itself: ``worker.inherited.forget_half_imported``) and the package is
refused. What the imports set in ``os.environ`` is put back at once and handed to the ranks.

What was imported here is never taken back (the user may use it), and a module cannot be imported
twice in one process. So where a package brought in here is stale (installed anew since, or its
import read a variable that has changed since), the next launch is not forked
(``stale_packages``: ``starting/choice`` starts it from the launch server instead, saying why).

Example::

    kernel_preload().learned()               # ranks imported something: import it here too
    with kernel_preload().before_fork() as environ:
        ...fork the next launch's ranks...   # environ: what the imports set, for the ranks
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import select
import signal
import sys
import threading
import time
from typing import Iterator

from nblaunch import wire
from nblaunch.facts.cuda import cuda_initialized
from nblaunch.launch.ahead.caller import caller
from nblaunch.launch.ahead.kept_output import kept_output
from nblaunch.launch.ahead.ledger import Stamp, changed, enabled, ledger, stamps
from nblaunch.launch.ahead.stepping_aside import Paused, launches
from nblaunch.launch.planning.devices import cuda_device_count
from nblaunch.launch.processes import fdtable
from nblaunch.launch.processes.forking_thread import run_on_forking_thread
from nblaunch.per_process import per_process
from nblaunch.server.loading import OK, load_package, packages_in_order
from nblaunch.worker import lifeline
from nblaunch.worker.inherited import forget_half_imported

WAIT_FOR_A_PACKAGE_S = 10.0  # a launch waits this long for one package's import, then forks
PROBE_PACKAGE_S = 60.0  # a package the probe has not imported by then hangs


class KernelPreload:
    """This process's imports for its forked ranks (see the module). Thread-safe."""

    def __init__(self) -> None:
        self._importing = threading.Lock()  # held while a package imports; a launch's forks take it too
        self._records = threading.Lock()  # what was imported: never held across an import (it may hang)
        self._current: str | None = None  # the package being imported
        self._since = 0.0  # when its import began (time.monotonic)
        self._thread: threading.Thread | None = None  # importing, until nothing learned is left
        self._again = False  # something was learned since the thread last looked
        self._environ: dict[str, str] = {}  # what the imports set, for the ranks
        # The packages brought in here: what their import read ("*": all), and os.environ then.
        self._brought: dict[str, tuple[frozenset[str], dict[str, str]]] = {}
        self._loaded: list[str] = []  # every package imported here for the ranks, in order
        self._stamps: dict[str, Stamp | None] = {}
        self._said: dict[str, str] = {}  # what a package's import here wrote (kept_output)

    def learned(self) -> None:
        """Ranks imported something (``ledger``): import it here too, in the background and only
        while the caller is parked (``caller``), with whatever else they import meanwhile."""
        if not enabled() or cuda_initialized():
            return  # with CUDA started here, the launches go through the launch server instead
        caller().on_resume(self._wait_for_the_package_under_way)
        with self._records:
            self._again = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._load_learned, name="nblaunch-preload", daemon=True)
                self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """On the caller's thread, parked (``caller().parked()``): wait until the imports under
        way are done; False if ``timeout`` passed first. A package still importing after
        ``WAIT_FOR_A_PACKAGE_S`` is refused and not waited for (it ends in the background, or never)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (thread := self._thread) is not None:
            current, since = self._current, self._since
            if current is not None and time.monotonic() - since > WAIT_FOR_A_PACKAGE_S:
                ledger().refuse(current, f"its import here had not finished after {WAIT_FOR_A_PACKAGE_S:g} s")
                return False
            if deadline is not None and time.monotonic() >= deadline:
                return False
            thread.join(min(1.0, WAIT_FOR_A_PACKAGE_S))
        return True

    def _wait_for_the_package_under_way(self) -> None:
        if self._acquire():
            self._importing.release()

    def _acquire(self) -> bool:
        """Take ``_importing`` (no import here while it is held), waiting for the package under
        way at most ``WAIT_FOR_A_PACKAGE_S``; past that, refuse it and go on without."""
        if self._importing.acquire(timeout=WAIT_FOR_A_PACKAGE_S):
            return True
        if self._current is not None:
            ledger().refuse(self._current, f"its import here had not finished after {WAIT_FOR_A_PACKAGE_S:g} s")
        return False

    @contextlib.contextmanager
    def before_fork(self) -> Iterator[dict[str, str]]:
        """Around the forks of a launch's ranks: no import here meanwhile (see the module).
        Yields the variables the imports set, for the ranks."""
        held = self._acquire()
        try:
            with self._records:
                environ = dict(self._environ)
            yield environ
        finally:
            if held:
                self._importing.release()

    def loaded(self) -> list[str]:
        """The packages imported here for the ranks, in order."""
        with self._records:
            return list(self._loaded)

    def said(self) -> dict[str, str]:
        """What each package imported here wrote as it was imported (kept from the cells)."""
        with self._records:
            return dict(self._said)

    def stale_packages(self) -> dict[str, str]:
        """Packages brought in here that a fresh import would not give now, and why."""
        environ = dict(os.environ)
        with self._records:
            stale = {p: "was installed anew" for p in changed({p: self._stamps[p] for p in self._brought
                                                               if p in self._stamps})}
            for package, (read, then) in self._brought.items():
                names = then.keys() | environ.keys() if "*" in read else read
                moved = sorted(n for n in names if environ.get(n) != then.get(n))
                if moved and package not in stale:
                    stale[package] = f"read {moved[0]} at import, which has changed"
        return stale

    def _load_learned(self) -> None:
        tried: set[str] = set()  # a module that would not import by its name stays not loaded
        while True:
            with self._records:
                names = [n for n in ledger().for_kernel() if n not in tried]
                if not names and not self._again:
                    self._thread = None
                    return
                self._again = False
            tried.update(names)
            if names:
                self._load(names)

    def _load(self, names: list[str]) -> None:
        packages = packages_in_order(names)
        if cuda_device_count():  # CUDA could be started by an import here: let a probe try first
            verdicts = probe(packages)
            for package, verdict in verdicts.items():
                if verdict != OK:
                    ledger().refuse(package, verdict)
            packages = [(p, modules) for p, modules in packages if verdicts.get(p) == OK]
        for package, modules in packages:
            while True:
                caller().wait_parked()
                launches().wait_turn()
                self._importing.acquire()
                if caller().is_parked and not launches().alone:  # checked holding it: a caller
                    break                                        # going on now waits for this package
                self._importing.release()
            try:
                if cuda_initialized():
                    return  # the user started CUDA meanwhile: forks are over in this process
                self._current, new, then = package, package not in sys.modules, dict(os.environ)
                self._since = time.monotonic()
                with kept_output() as said:  # not the last cell's output (kept_output)
                    verdict, environ = load_package(modules, watch_threads=False)
                self._current = None
                if said.getvalue().strip():
                    with self._records:
                        self._said[package] = said.getvalue()
                if verdict != OK:
                    ledger().refuse(package, verdict, time.monotonic() - self._since)
                    continue
                found = stamps([package]) if new else {}
                with self._records:  # before the next fork: it takes _importing
                    self._environ.update(environ.written)
                    self._loaded.append(package)
                    if new:  # a package of the user's (or torch's) own is theirs: as if they imported it
                        self._brought[package] = (frozenset(environ.read), then)
                        self._stamps.update(found)
            finally:
                self._importing.release()


def probe(packages: list[tuple[str, list[str]]]) -> dict[str, str]:
    """What importing each package does, tried in a fork of this process that is then killed:
    ``{package: verdict}`` for those it got to (``server/loading``'s verdicts, or that it hung)."""
    read_end, write_end = fdtable.new_pipe()

    def fork() -> int:  # on the forking thread, as every fork of ours
        with fdtable.forking([write_end]):
            pid = os.fork()
            if pid == 0:
                try:
                    _probe_child(write_end, packages)
                finally:
                    os._exit(0)
        return pid

    try:
        pid = run_on_forking_thread(fork, undo=_kill)
    finally:
        fdtable.close([write_end])
    verdicts: dict[str, str] = {}
    reader = wire.FrameReader()
    try:
        # Not stopped before it has said it is alive: stopped before its lifeline is set, it would
        # outlive the kernel.
        if _read_probe(read_end, reader, verdicts, packages, until_alive=True):
            with launches().pausing(Paused(pid)):  # stopped while a launch runs alone (stepping_aside)
                _read_probe(read_end, reader, verdicts, packages, until_alive=False)
    finally:
        fdtable.close([read_end])
        _kill(pid)
    return verdicts


def _read_probe(read_end: int, reader: wire.FrameReader, verdicts: dict[str, str],
                packages: list[tuple[str, list[str]]], until_alive: bool) -> bool:
    """Read the probe's verdicts into ``verdicts`` until it has said it is alive (``until_alive``)
    or has judged every package; False if it ended, or hung, first."""
    while len(verdicts) < len(packages):
        ready, _, _ = select.select([read_end], [], [], PROBE_PACKAGE_S)
        chunk = os.read(read_end, 1 << 16) if ready else b""
        if not chunk:
            if not ready and not until_alive and not launches().alone:  # the package it was on never finished
                verdicts[packages[len(verdicts)][0]] = f"its import did not finish within {PROBE_PACKAGE_S:g} s"
            return False
        frames = reader.feed(chunk)
        for kind, body in frames:
            if kind == wire.SERVER_LOADED:
                package, verdict = pickle.loads(body)
                verdicts[package] = verdict
        if until_alive and frames:
            return True
    return True


def _probe_child(write_end: int, packages: list[tuple[str, list[str]]]) -> None:
    os.setpgid(0, 0)  # the kernel's interrupts are not for it
    gc.freeze()  # the kernel's garbage is the kernel's to collect
    forget_half_imported()
    lifeline.die_with_parent(os.getppid())
    wire.write_frame(write_end, wire.SERVER_READY)  # alive: it may be stopped now (probe)
    devnull = open(os.devnull, "w")  # the kernel's streams write through threads a fork does not have
    sys.stdout = sys.stderr = devnull
    for package, modules in packages:
        verdict, _ = load_package(modules, watch_threads=False)
        wire.write_frame(write_end, wire.SERVER_LOADED, pickle.dumps((package, verdict)))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


kernel_preload = per_process(KernelPreload)
