"""What a launch's ranks should find loaded: learned from what earlier ranks imported, kept for
the life of this process (one per process: ``ledger()``).

Every rank says, at its end, which installed libraries it imported (``nblaunch.facts.installed``);
the ledger keeps them in order. Forked ranks find them imported in this process
(``kernel_preload``), the launch server's ranks in a generation (``launch_server``), with
``TRUSTED`` (what a first training step imports) and, for the server, this process's own
libraries. A package that could not be loaded ahead (it raised, started CUDA, hung) is refused
for good, said once at the next launch, and its ranks import it themselves as they always did.
``NBLAUNCH_PRELOAD=0`` turns learning off (the trusted modules are still loaded).

Example::

    ledger().learn(["sklearn", "sklearn.base", "sklearn.datasets"])   # what a launch's ranks said
    ledger().for_kernel()      # ['sklearn', 'sklearn.base', 'sklearn.datasets'] if not loaded here
    ledger().refuse("bnb", "it raised OSError: ...", seconds=1.2)
    ledger().notices(["bnb"])  # ['could not load bnb ahead of the ranks: it raised OSError: ...'], once
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Iterable

from nblaunch.contract.variables import PRELOAD
from nblaunch.facts.installed import installed_modules, top_level
from nblaunch.per_process import per_process
from nblaunch.server.loading import CUDA

TRUSTED = ("torch._dynamo", "nblaunch.training")  # torch imports the first when an optimizer is built
# The notebook's own machinery, in the kernel but no rank's business: never loaded for the ranks
# (nor learned from them: a rank forked from a kernel may import some of it as it writes output).
_KERNEL_MACHINERY = frozenset({
    "IPython", "ipykernel", "ipykernel_launcher", "jupyter_client", "jupyter_core", "zmq", "tornado", "traitlets",
    "comm", "debugpy", "pydevd", "_pydevd_bundle", "_pydev_bundle", "_pydevd_frame_eval", "pydev_ipython",
    "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "prompt_toolkit", "jedi", "parso", "pexpect",
    "ptyprocess", "matplotlib_inline", "nest_asyncio", "stack_data", "executing", "asttokens", "pure_eval",
    "wcwidth", "pickleshare", "backcall", "colab_kernel_launcher", "nbformat", "nbclient", "ipyparallel",
    "pytest", "_pytest", "pluggy", "py",
})
_KERNEL_MACHINERY_PREFIXES = ("google.colab",)

Stamp = tuple[str, int, int]  # a package's file, its inode and modification time


def enabled() -> bool:
    return os.environ.get(PRELOAD, "1").strip() != "0"


class Ledger:
    """See the module. Thread-safe: launches end on their own threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._learned: dict[str, None] = {}  # an ordered set
        self._refused: dict[str, str] = {}
        self._cuda_only: set[str] = set()  # start CUDA at import: loaded ahead only where CUDA is allowed
        self._notices: dict[str, str] = {}  # package -> its line, said under a launch whose ranks import it

    def learn(self, names: Iterable[str]) -> None:
        """Add what a launch's ranks imported (``wire.IMPORTED``), in order."""
        if not enabled():
            return
        with self._lock:
            for name in names:
                if top_level(name) not in self._refused and not _machinery(name):
                    self._learned.setdefault(name, None)

    def refuse(self, package: str, why: str, seconds: float | None = None) -> None:
        """Never load ``package`` ahead again in this process; a package that starts CUDA is still
        loaded by ranks waiting on a GPU (``for_cuda``), which have CUDA already. ``seconds``: what
        its import took where it was tried (what each rank pays for it)."""
        with self._lock:
            if package in self._refused or package in {top_level(t) for t in TRUSTED}:
                return
            self._refused[package] = why
            if why == CUDA:
                self._cuda_only.add(package)
            else:
                self._learned = {n: None for n in self._learned if top_level(n) != package}
            cost = f" ({seconds:.1f} s here)" if seconds is not None else ""
            self._notices[package] = (
                f"could not load {package} ahead of the ranks: {why}. Each launch's ranks import it "
                f"themselves{cost}. " + _WHAT_TO_DO.get(why, _WHAT_TO_DO[None]))

    def refused(self) -> dict[str, str]:
        with self._lock:
            return dict(self._refused)

    def notices(self, imported: Iterable[str]) -> list[str]:
        """The lines for the refused packages among ``imported`` (what a launch's ranks imported:
        the launch they slowed), each said once per process."""
        packages = {top_level(n) for n in imported}
        with self._lock:
            said = [p for p in self._notices if p in packages]
            return [self._notices.pop(p) for p in said]

    def learned(self) -> list[str]:
        with self._lock:
            return list(self._learned)

    def for_kernel(self) -> list[str]:
        """What forked ranks should inherit that this process has not imported (nothing that
        starts CUDA: this process forks its ranks only while CUDA is not started here)."""
        with self._lock:
            return [n for n in self._learned if n not in sys.modules and top_level(n) not in self._cuda_only]

    def for_cuda(self) -> list[str]:
        """What ranks waiting on a GPU import while they wait: everything learned, what starts
        CUDA at import included (they have CUDA already)."""
        return self.learned()

    def for_server(self) -> list[str]:
        """What a generation of the launch server imports: the trusted modules, this process's
        libraries (not the notebook's machinery), what ranks imported; none refused."""
        refused = self.refused()
        names = dict.fromkeys(TRUSTED)
        if enabled():
            names.update(dict.fromkeys(n for n in installed_modules(list(sys.modules)) if not _machinery(n)))
            names.update(dict.fromkeys(self.learned()))
        return [n for n in names if top_level(n) not in refused]


# What a user can do about a package that is not loaded ahead, by why.
_WHAT_TO_DO = {
    CUDA: "Ranks waiting on a GPU load it (NBLAUNCH_STANDBY); to have it in this process instead, import "
          "it in a cell (the launches then start from the launch server).",
    None: "If its import can be made to succeed here, import it in a cell before launching; "
          "nblaunch.warm_start() shows what is loaded ahead where.",
}


def _machinery(name: str) -> bool:
    return top_level(name) in _KERNEL_MACHINERY or name.startswith(_KERNEL_MACHINERY_PREFIXES)


def stamps(packages: Iterable[str]) -> dict[str, Stamp | None]:
    """Each package's file as it is on disk now (None where it cannot be found): a package
    installed again (``pip install -U``) has a new file, and what was loaded ahead is stale."""
    found: dict[str, Stamp | None] = {}
    for package in packages:
        module = sys.modules.get(package)
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if not isinstance(origin, str):
            try:
                spec = importlib.util.find_spec(package)
            except (ImportError, ValueError):
                spec = None
            origin = getattr(spec, "origin", None)
        found[package] = _stamp(origin) if isinstance(origin, str) else None
    return found


def changed(before: dict[str, Stamp | None]) -> list[str]:
    """The packages of ``before`` whose file is not what it was then."""
    return [p for p, stamp in before.items() if stamp is not None and _stamp(stamp[0]) != stamp]


def _stamp(path: str) -> Stamp | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return path, status.st_ino, status.st_mtime_ns


ledger = per_process(Ledger)  # a rank's own launches learn for themselves
