"""Forked ranks inherit what earlier ranks imported: this process imports it between launches.

After a fork launch, the libraries its ranks imported that this process has not imported are
imported here, on a thread of their own (``nblaunch-preload``), one package at a time, so the
next launch's ranks are forked with them loaded. Where an NVIDIA GPU is, a probe goes first: a
fork of this process imports the same packages and says what each did (``server/loading``); a
package that starts CUDA is never imported here (every later launch of the kernel would have to
go through the launch server). Everything else was proven by the ranks themselves: they are
forks of this process, and they imported it to the end.

A launch forks between two packages (``before_fork``): it waits for the package being imported,
which the ranks imported to the end before (seconds), but at most 10 s; past that it forks
anyway (a rank forked while a package was half imported forgets it and imports it itself:
``worker.inherited.forget_half_imported``) and the package is refused. What the imports set in
``os.environ`` is put back at once and handed to the ranks. A package installed anew since it was imported here
(``pip install -U``) is dropped from ``sys.modules`` before the next fork: the ranks import the
new one.

Example::

    kernel_preload().after_launch()          # a fork launch ended: import what its ranks did
    with kernel_preload().before_fork() as (environ, forget):
        ...fork the next launch's ranks...   # environ: for the ranks; forget: modules they re-import
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
from typing import Iterator

from nblaunch import wire
from nblaunch.facts.cuda import cuda_initialized
from nblaunch.facts.installed import top_level
from nblaunch.launch.planning.devices import cuda_device_count
from nblaunch.launch.starting import fdtable
from nblaunch.launch.starting.forking_thread import run_on_forking_thread
from nblaunch.launch.warm_start.ledger import Stamp, changed, enabled, ledger, stamps
from nblaunch.launch.warm_start.stepping_aside import Launches
from nblaunch.preimport import environ_put_back, environ_reads
from nblaunch.server.loading import OK, load_package, packages_in_order
from nblaunch.worker import lifeline
from nblaunch.worker.inherited import forget_half_imported

WAIT_FOR_A_PACKAGE_S = 10.0  # a launch waits this long for one package's import, then forks
PROBE_PACKAGE_S = 60.0  # a package the probe has not imported by then hangs


class KernelPreload:
    """This process's imports for its forked ranks (see the module). Thread-safe."""

    def __init__(self) -> None:
        self._importing = threading.Lock()  # held while a package imports; a launch's forks take it too
        self._current: str | None = None  # the package being imported
        self._thread: threading.Thread | None = None
        self._environ: dict[str, str] = {}  # what the imports set, for the ranks
        # package -> (the variables its import read, "*" for all; os.environ then)
        self._loaded: dict[str, tuple[frozenset[str], dict[str, str]]] = {}
        self._stamps: dict[str, Stamp | None] = {}
        self.launches = Launches()  # the imports wait for a launch that runs alone (stepping_aside)

    def after_launch(self) -> None:
        """Import, in the background, what the ranks imported that this process has not."""
        if not enabled() or cuda_initialized() or (self._thread is not None and self._thread.is_alive()):
            return  # with CUDA started here, the launches go through the launch server instead
        names = ledger().for_kernel()
        if names:
            self._thread = threading.Thread(target=self._load, args=(names,), name="nblaunch-preload", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def before_fork(self) -> Iterator[tuple[dict[str, str], tuple[str, ...]]]:
        """Around the forks of a launch's ranks: no import here meanwhile (see the module).
        Yields the variables the imports set, for the ranks, and the modules they must forget."""
        held = self._importing.acquire(timeout=WAIT_FOR_A_PACKAGE_S)
        if not held and self._current is not None:
            ledger().refuse(self._current, f"its import here had not finished after {WAIT_FOR_A_PACKAGE_S:g} s")
        try:
            yield dict(self._environ), self._stale_modules()
        finally:
            if held:
                self._importing.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the imports under way are done; False if ``timeout`` passed first."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def loaded(self) -> list[str]:
        """The packages imported here for the ranks, in order."""
        return list(self._loaded)

    def _stale_modules(self) -> tuple[str, ...]:
        """Every module of the packages imported here that a fresh import would not give now."""
        environ = dict(os.environ)
        stale = set(changed({p: self._stamps[p] for p in self._loaded if p in self._stamps}))
        for package, (read, then) in self._loaded.items():
            if any(environ.get(name) != then.get(name) for name in (then.keys() | environ.keys() if "*" in read else read)):
                stale.add(package)
        return tuple(name for name in list(sys.modules) if top_level(name) in stale) if stale else ()

    def _load(self, names: list[str]) -> None:
        packages = packages_in_order(names)
        if cuda_device_count():  # CUDA could be started by an import here: let a probe try first
            verdicts = probe(packages)
            for package, verdict in verdicts.items():
                if verdict != OK:
                    ledger().refuse(package, verdict)
            packages = [(p, modules) for p, modules in packages if verdicts.get(p) == OK]
        for package, modules in packages:
            self.launches.wait_turn()
            if cuda_initialized():
                return  # the user started CUDA meanwhile: forks are over in this process
            with self._importing:
                self._current, before = package, dict(os.environ)
                with environ_put_back() as environ, environ_reads() as read:
                    verdict = load_package(modules, watch_threads=False)
                self._current = None
            if verdict != OK:
                ledger().refuse(package, verdict)
                continue
            self._environ.update(environ)
            self._loaded[package] = (frozenset(read), before)
            self._stamps.update(stamps([package]))


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
        while len(verdicts) < len(packages):
            ready, _, _ = select.select([read_end], [], [], PROBE_PACKAGE_S)
            chunk = os.read(read_end, 1 << 16) if ready else b""
            if not chunk:
                if not ready:  # the package it was on never finished
                    verdicts[packages[len(verdicts)][0]] = f"its import did not finish within {PROBE_PACKAGE_S:g} s"
                break
            for _, body in reader.feed(chunk):
                package, verdict = pickle.loads(body)
                verdicts[package] = verdict
    finally:
        fdtable.close([read_end])
        _kill(pid)
    return verdicts


def _probe_child(write_end: int, packages: list[tuple[str, list[str]]]) -> None:
    os.setpgid(0, 0)  # the kernel's interrupts are not for it
    gc.freeze()  # the kernel's garbage is the kernel's to collect
    forget_half_imported()
    lifeline.die_with_parent(os.getppid())
    devnull = open(os.devnull, "w")  # the kernel's streams write through threads a fork does not have
    sys.stdout = sys.stderr = devnull
    for package, modules in packages:
        verdict = load_package(modules, watch_threads=False)
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


_preload = KernelPreload()


def kernel_preload() -> KernelPreload:
    """This process's."""
    return _preload


def _forget_in_child() -> None:
    global _preload
    _preload = KernelPreload()


os.register_at_fork(after_in_child=_forget_in_child)
