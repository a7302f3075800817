"""This process's launch server (``nblaunch.server``): where ranks come from when they cannot be
forked here, and how they begin warm (docs/architecture.md, "A warm start"). The kernel's side of
three kinds of process: the **base** (``server/base_process``: torch, never CUDA; started early
where a GPU is, by ``early_start``), a **trusted generation** forked by it for this process's
environment as it is (``ledger.TRUSTED``), and a **full generation** forked by that one, which
imports this process's libraries and what ranks imported (``ledger.for_server``), one package at
a time; a package that raises, starts CUDA or threads, or hangs (60 s) is refused and a
generation without it is asked for. A launch's ranks come from the full generation if it is
ready and fits (this process's environment as it is now, its packages unchanged on disk), else
the trusted one, else the base; ranks waiting on standby for its shape are claimed first
(``standby``). After each launch a warm-up runs on a thread of its own: the generations, then
ranks on standby; a launch that blocks its caller returns once it is done (``lacks``).

Example::

    server = launch_server()                      # started if none runs
    waiting = server.claim_standby(shape)         # {local rank: WorkerProcess}, maybe {}
    link = server.source_for(dict(os.environ))    # where the other ranks are forked
    ...
    server.after_launch(shape)                    # the warm-up for the next one
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

from nblaunch import wire
from nblaunch.facts.installed import top_level
from nblaunch.launch.ahead import standby
from nblaunch.launch.ahead.ledger import TRUSTED, Stamp, changed, enabled, ledger, stamps
from nblaunch.launch.ahead.server_link import ServerLink
from nblaunch.launch.ahead.stepping_aside import launches
from nblaunch.launch.processes import fdtable
from nblaunch.launch.processes.forking_thread import run_on_forking_thread
from nblaunch.launch.processes.processes import PACKAGE_ROOT, WorkerProcess
from nblaunch.per_process import per_process
from nblaunch.server.loading import OK

READY_BACKSTOP_S = 300.0  # importing torch takes seconds; a base that never gets there is broken
TRUSTED_WAIT_S = 120.0  # a warm-up waits this long for the trusted generation (torch._dynamo)
PACKAGE_HANGS_S = 60.0  # a package a generation has been importing this long is refused
_TRIES = 3  # generations asked for in one warm-up, each without what poisoned the one before


@dataclasses.dataclass
class Generation:
    link: ServerLink
    parent: ServerLink  # it dies with its parent: a parent is let go only after its children
    environ: dict[str, str] = dataclasses.field(repr=False)
    names: frozenset[str]
    stamps: dict[str, Stamp | None]

    def fits(self, environ: dict[str, str]) -> bool:
        return self.link.alive and self.environ == environ and not changed(self.stamps)


class LaunchServer:
    """See the module. Thread-safe: launches on several threads share it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._warmed = threading.Condition(self._lock)  # notified when a warm-up ends
        self._born: dict[int, concurrent.futures.Future] = {}  # generation id -> (pid, fd), from the base
        self._ids = itertools.count(1)
        self._trusted: Generation | None = None
        self._full: Generation | None = None
        self._retiring: list[Generation] = []
        self._standby: standby.StandbyGroup | None = None
        self._standby_shape: standby.Shape | None = None  # what the last launch asked for
        self.standby_off: str | None = None  # why ranks no longer wait on standby in this process
        self.last_release: str | None = None  # why the last ranks on standby were let go
        self._warming = self._warm_again = False
        self._watching_cuda_here = False
        self._base = self._start_base()

    # ------------------------------------------------------------------ the base
    def _start_base(self) -> ServerLink:
        # Registered before anything can fork (a launch on another thread, a DataLoader): a copy
        # of the base's end in any child would hide the base's death from the reader for good.
        mine, theirs = fdtable.new_socketpair()
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, environ.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "nblaunch.server.base_process", str(theirs), str(os.getpid())]

        def start() -> subprocess.Popen:  # on the forking thread: the base's death signal is tied to it
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(theirs,), env=environ,
                                    start_new_session=True)  # not in the kernel's group: interrupts are the kernel's

        try:
            process = run_on_forking_thread(start, undo=_stop)
        except BaseException:
            fdtable.close([mine])
            raise
        finally:
            fdtable.close([theirs])
        return ServerLink(mine, process.pid, "base", stop=lambda: _stop(process), exit_status=process.poll,
                          on_frame=self._on_frame)

    @property
    def alive(self) -> bool:
        return self._base.running

    @property
    def base(self) -> ServerLink:
        return self._base

    def _on_frame(self, link: ServerLink, kind: bytes, news: object) -> None:
        if kind == wire.SERVER_GENERATION_STARTED:
            generation_id, pid, fd = news
            born = self._born.pop(generation_id, None)
            if born is None or not born.set_running_or_notify_cancel():  # its asker gave up
                fdtable.close([fd])  # the generation sees EOF and goes
                return
            born.set_result((pid, fd))
        elif kind == wire.SERVER_LOADED and link is not self._base:
            package, verdict, seconds = news
            if verdict != OK:
                ledger().refuse(package, verdict, seconds)

    # ------------------------------------------------------------------ a launch
    def source_for(self, environ: dict[str, str]) -> ServerLink:
        """The process this launch's ranks are forked from (see the module)."""
        if not self._base.wait_ready(READY_BACKSTOP_S):
            why = self._base.why_dead() if not self._base.alive else f"it was not ready within {READY_BACKSTOP_S:g} s"
            self._base.kill(why)
            raise RuntimeError(f"nblaunch's launch server failed: {why}")
        with self._lock:
            full, trusted = self._full, self._trusted
        for generation in (full, trusted):
            if (generation is not None and generation.link.ready and not generation.link.paused
                    and generation.fits(environ) and self.runs(generation.link)):
                return generation.link
        return self._base

    def runs(self, link: ServerLink) -> bool:
        """Whether ``link``'s process and every one it descends from run now, none of them dying
        (each dies with its parent): a launch right after one was killed forks from what is left."""
        while link.running:
            with self._lock:
                link = next((g.parent for g in (self._trusted, self._full, *self._retiring)
                             if g is not None and g.link is link), None)
            if link is None:
                return True  # the base's own
        return False

    def claim_standby(self, shape: standby.Shape) -> dict[int, WorkerProcess]:
        """The ranks waiting for a launch of ``shape``, now the launch's ({} if none); ranks
        waiting for another shape are let go first, and waited for."""
        with self._lock:
            group, self._standby = self._standby, None
        if group is None:
            return {}
        why = group.shape.differs(shape) or (
            f"{', '.join(changed(group.stamps))} was installed anew" if changed(group.stamps) else None)
        if why is None:
            return group.claim()
        self.last_release = why
        group.release()
        return {}

    def after_launch(self, shape: standby.Shape) -> None:
        """A launch from this server ended: warm up for the next one (in the background)."""
        with self._lock:
            self._standby_shape = shape if standby.wanted(shape.device_kind) else None
        self.warm_up_soon()

    def release_standby(self, why: str, for_good: bool = False) -> int:
        """Let every rank on standby go, and wait until they are gone; how many there were.
        ``for_good``: none waits again in this process."""
        with self._lock:
            group, self._standby = self._standby, None
            if for_good:
                self.standby_off, self._standby_shape = why, None
        if group is None:
            return 0
        count = len(group.ranks)
        self.last_release = why
        group.release()
        return count

    def waiting(self) -> list[standby.StandbyRank]:
        """The ranks on standby now (one that left by itself says why in ``last_release``)."""
        with self._lock:
            if self._standby is None:
                return []
            live = self._standby.live()
            if self._standby.left:
                self.last_release = self._standby.left[-1]
            return live

    def lacks(self, names: list[str]) -> bool:
        """Whether the next launch's ranks would not find ``names`` loaded where they come from
        (no full generation ready with them, for this process's environment as it is now)."""
        with self._lock:
            full = self._full
        return not (full is not None and full.link.ready and full.fits(dict(os.environ)) and set(names) <= full.names)

    def generations(self) -> tuple[Generation | None, Generation | None]:
        with self._lock:
            return self._trusted, self._full

    # ------------------------------------------------------------------ warming up
    def warm_up_soon(self) -> None:
        """Run the warm-up on a thread of its own (again after the current one, if one runs)."""
        with self._lock:
            self._warm_again = True
            if self._warming:
                return
            self._warming = True
        threading.Thread(target=self._warm_up, name="nblaunch-warm-up", daemon=True).start()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until no warm-up runs; False if ``timeout`` passed first."""
        with self._lock:
            return self._warmed.wait_for(lambda: not self._warming, timeout)

    def _warm_up(self) -> None:
        while True:
            with self._lock:
                if not self._warm_again or not self.alive:
                    self._warming = False
                    self._warmed.notify_all()
                    return
                self._warm_again = False
            try:
                self._warm_once(dict(os.environ))
            except Exception:  # noqa: BLE001  an optimisation only: the next launch goes on without it
                pass

    def _warm_once(self, environ: dict[str, str]) -> None:
        if not self._base.wait_ready(READY_BACKSTOP_S):
            return
        with self._lock:
            trusted = self._trusted if self._trusted is not None and self._trusted.fits(environ) else None
        launches().wait_turn()  # a generation made now would be stopped at once
        if trusted is None:
            trusted = self._ask(self._base, environ, list(TRUSTED))
            with self._lock:
                self._replace("_trusted", trusted)
                self._replace("_full", None)  # forked from the trusted generation it replaces
        if trusted is None:
            return
        with launches().pausing(trusted.link):  # stopped while a launch runs alone (stepping_aside)
            if not trusted.link.wait_ready(TRUSTED_WAIT_S):
                return
        # Ranks on standby first (they ready their GPU, then import what ranks imported while
        # they wait): the next launch may come in seconds. Then the full generation, for ranks
        # started afresh.
        with self._lock:
            full = self._full if self._full is not None and self._full.link.ready and self._full.fits(environ) else None
        self._standby_for(environ, full or trusted)
        if enabled():
            self._full_generation(trusted, environ)
        self._retire_idle()

    def _full_generation(self, trusted: Generation, environ: dict[str, str]) -> Generation | None:
        for _ in range(_TRIES):
            names = ledger().for_server()
            with self._lock:
                current = self._full
            if current is not None and current.fits(environ) and set(names) <= current.names:
                return current
            made = self._ask(trusted.link, environ, names)
            if made is None:
                return None
            if self._until_ready(made):
                with self._lock:
                    self._replace("_full", made)
                return made
        return None

    def _until_ready(self, generation: Generation) -> bool:
        """Wait until ``generation`` is ready; False if it died (a package poisoned it: refused
        by ``_on_frame``) or hung on a package (refused here, and the generation stopped)."""
        link = generation.link
        with launches().pausing(link):  # stopped while a launch runs alone (stepping_aside)
            return self._wait_ready(link)

    def _wait_ready(self, link: ServerLink) -> bool:
        while not link.wait_ready(1.0):
            if not link.alive:
                return False
            loading = link.loading
            if loading is not None and not link.paused and time.monotonic() - loading[1] > PACKAGE_HANGS_S:
                ledger().refuse(loading[0], f"its import did not finish within {PACKAGE_HANGS_S:g} s")
                link.kill("a package's import hung")
                return False
        return True

    def _ask(self, parent: ServerLink, environ: dict[str, str], names: list[str]) -> Generation | None:
        """A new generation forked by ``parent``, importing ``names`` under ``environ``."""
        generation_id = next(self._ids)
        born: concurrent.futures.Future = concurrent.futures.Future()
        self._born[generation_id] = born
        try:
            parent.ask_generation(generation_id, environ, names)
            pid, fd = born.result(timeout=30)
        except Exception:  # noqa: BLE001  no generation: launches come from where they did
            self._born.pop(generation_id, None)
            if not born.cancel() and born.done() and born.exception() is None:  # it came just now
                fdtable.close([born.result()[1]])
            return None
        link = ServerLink(fd, pid, f"generation {generation_id}", stop=lambda: _kill(pid), on_frame=self._on_frame)
        packages = {top_level(n) for n in names}
        return Generation(link, parent, environ, frozenset(names), stamps(packages))

    def _replace(self, slot: str, generation: Generation | None) -> None:
        old = getattr(self, slot)
        setattr(self, slot, generation)
        if old is not None and old is not generation:
            self._retiring.append(old)

    def _retire_idle(self) -> None:
        """Let go of replaced generations once no rank of theirs runs (nor waits on standby)."""
        with self._lock:
            waiting_on = None if self._standby is None else self._standby.source
            kept = [g for g in (self._trusted, self._full, *self._retiring) if g is not None]
            for old in list(self._retiring):
                parent_of = [g for g in kept if g.parent is old.link and g.link.alive]
                if old.link.live_ranks == 0 and old.link is not waiting_on and not parent_of:
                    old.link.close()
                    self._retiring.remove(old)
                    kept.remove(old)

    def _standby_for(self, environ: dict[str, str], source: Generation) -> None:
        with self._lock:
            shape, current = self._standby_shape, self._standby
            if (shape is None or self.standby_off is not None or dict(shape.environ) != environ
                    or launches().under_way):  # its GPUs are the running launch's: the next warm-up
                return
            if current is not None and current.shape == shape and current.source is source.link and current.live():
                return
            self._standby = None
        if current is not None:
            current.release()
        if shape.device_kind == "cuda" and not self._watching_cuda_here:
            self._watching_cuda_here = standby.watch_cuda_here(self.release_standby, os.getpid())
        ahead = [n for n in ledger().for_cuda() if n not in source.names] if enabled() else []
        found = dict(source.stamps, **stamps({top_level(n) for n in ahead}))
        made = standby.StandbyGroup.start(shape, source.link, ahead, found)
        with self._lock:  # published at once: a launch may claim it while it readies
            published = self._standby is None and self._standby_shape == shape and not launches().under_way
            if published:
                self._standby = made
        if not published:
            made.release()  # a launch or a release came meanwhile
            return
        made.wait_ready(standby.CLAIM_WAIT_S)  # "waiting" means ready (warm_start(wait=...) says so)


def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Slot:
    # A rank forked from here has no server: the socket is closed in it (fdtable), and a launch
    # made inside the rank starts a server of its own.
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.server: LaunchServer | None = None


_slot = per_process(_Slot)


def launch_server() -> LaunchServer:
    """This process's launch server: the running one, or a new one."""
    slot = _slot()
    with slot.lock:
        if slot.server is None or not slot.server.alive:
            slot.server = LaunchServer()
        return slot.server


def running_server() -> LaunchServer | None:
    """This process's launch server if one runs; never starts one."""
    slot = _slot()
    with slot.lock:
        return slot.server if slot.server is not None and slot.server.alive else None
