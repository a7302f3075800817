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
    ledger().refuse("bnb", "initialises CUDA")
    ledger().notices()         # ['could not load bnb ahead of the ranks (initialises CUDA): ...']
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Iterable

from nblaunch.contract.variables import PRELOAD
from nblaunch.facts.installed import installed_modules, top_level

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
        self._notices: list[str] = []

    def learn(self, names: Iterable[str]) -> None:
        """Add what a launch's ranks imported (``wire.IMPORTED``), in order."""
        if not enabled():
            return
        with self._lock:
            for name in names:
                if top_level(name) not in self._refused and not _machinery(name):
                    self._learned.setdefault(name, None)

    def refuse(self, package: str, why: str) -> None:
        """Never load ``package`` ahead again in this process; if ranks imported it (not only this
        process), say so at the next launch."""
        with self._lock:
            if package in self._refused or package in {top_level(t) for t in TRUSTED}:
                return
            self._refused[package] = why
            learned = {n: None for n in self._learned if top_level(n) != package}
            if len(learned) < len(self._learned):
                self._notices.append(f"could not load {package} ahead of the ranks ({why}): they import it themselves")
            self._learned = learned

    def refused(self) -> dict[str, str]:
        with self._lock:
            return dict(self._refused)

    def notices(self) -> list[str]:
        """The lines not said yet, each said once."""
        with self._lock:
            found, self._notices = self._notices, []
            return found

    def learned(self) -> list[str]:
        with self._lock:
            return list(self._learned)

    def for_kernel(self) -> list[str]:
        """What forked ranks should inherit that this process has not imported."""
        return [n for n in self.learned() if n not in sys.modules]

    def for_server(self) -> list[str]:
        """What a generation of the launch server imports: the trusted modules, this process's
        libraries (not the notebook's machinery), what ranks imported; none refused."""
        refused = self.refused()
        names = dict.fromkeys(TRUSTED)
        if enabled():
            names.update(dict.fromkeys(n for n in installed_modules(list(sys.modules)) if not _machinery(n)))
            names.update(dict.fromkeys(self.learned()))
        return [n for n in names if top_level(n) not in refused]


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


_ledger = Ledger()


def ledger() -> Ledger:
    """This process's ledger."""
    return _ledger


def _forget_in_child() -> None:
    global _ledger
    _ledger = Ledger()  # a rank's own launches learn for themselves


os.register_at_fork(after_in_child=_forget_in_child)
