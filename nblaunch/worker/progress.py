"""Progress bars inside a worker, drawn by the launching cell instead of by the worker.

Two ways in:

* :func:`progress` wraps an iterable, like ``tqdm`` without the dependency::

      from nblaunch.worker.progress import progress
      for batch in progress(loader, desc="epoch 1"):
          ...

  Inside a launch it reports to the launcher (at most ~10 times a second, and once at the
  end); outside one it falls back to ``tqdm.auto`` when tqdm is installed, else plain iteration.

* :func:`install_tqdm_hook`, which the bootstrap calls in every worker, makes every tqdm bar
  (``tqdm``, ``tqdm.auto``, ``tqdm.notebook``, and libraries built on them) report the same way
  and draw nothing: no widgets owned by a child process, no carriage-return spam in the log.
  tqdm is patched when it is first imported, so a worker that never uses it pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from nblaunch.worker import channel

T = TypeVar("T")

REPORT_INTERVAL_S = 0.1  # the display refreshes about 10 times a second; more would be wasted
_bar_ids = itertools.count()  # bar ids are per process; the launcher keys bars by (rank, bar_id)


class BarReporter:
    """Sends the state of one bar to the launcher, throttled, with the final state always sent.

    Example::

        bar = BarReporter(total=100, desc="train")
        for i in range(100):
            bar.update(i + 1)
        bar.close(100)
    """

    def __init__(self, total: float | None, desc: str = "", auto: bool = False) -> None:
        self.bar_id = next(_bar_ids)
        self.total = total
        self.desc = desc
        self.auto = auto  # drawn by nblaunch (a prepared DataLoader), not asked for by the user
        self._last = -float("inf")

    def update(self, n: float, desc: str | None = None) -> None:
        """Report position ``n`` unless a report went out less than REPORT_INTERVAL_S ago."""
        if desc is not None:
            self.desc = desc
        now = time.monotonic()
        if now - self._last >= REPORT_INTERVAL_S or n == self.total:
            self._last = now
            channel.report_progress(self.bar_id, n, self.total, self.desc, auto=self.auto)

    def close(self, n: float) -> None:
        channel.report_progress(self.bar_id, n, self.total, self.desc, closed=True, auto=self.auto)


def progress(iterable: Iterable[T], total: float | None = None, desc: str = "") -> Iterator[T]:
    """Iterate over ``iterable`` while the launching cell shows a progress bar for this rank.

    ``total`` defaults to ``len(iterable)`` when it has one. Outside a launch this is
    ``tqdm.auto.tqdm(iterable, total=total, desc=desc)`` if tqdm is installed, else the
    iterable's own iterator.

    Example::

        for step, batch in enumerate(progress(loader, desc="train")):
            loss = train_step(batch)
    """
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if channel.in_launch():
        return _reporting(iterable, BarReporter(total, desc))
    if importlib.util.find_spec("tqdm") is not None:
        from tqdm.auto import tqdm

        return iter(tqdm(iterable, total=total, desc=desc or None))
    return iter(iterable)


def _reporting(iterable: Iterable[T], bar: BarReporter) -> Iterator[T]:
    n = 0
    bar.update(n)
    try:
        for item in iterable:
            yield item
            n += 1
            bar.update(n)
    finally:  # also when the loop breaks early or raises: the bar is closed where it stopped
        bar.close(n)


# --- tqdm -----------------------------------------------------------------------------------

_hook_lock = threading.Lock()
_patched_std = False


def install_tqdm_hook() -> None:
    """Make tqdm bars in this process report to the launcher instead of drawing themselves.

    Patches tqdm now if it is already imported (a forked worker inherits the kernel's modules),
    else when it is first imported. Safe to call more than once.
    """
    with _hook_lock:
        if "tqdm.std" in sys.modules:
            _patch_module("tqdm.std", sys.modules["tqdm.std"])
        if "tqdm.notebook" in sys.modules:
            _patch_module("tqdm.notebook", sys.modules["tqdm.notebook"])
        if not any(isinstance(finder, _TqdmFinder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _TqdmFinder())


# What tqdm.notebook's bar class overrides to draw ipywidgets. Removing these overrides makes
# it (and subclasses already made from it, such as tqdm.auto's class in a worker forked from a
# kernel) behave like the patched console class.
_NOTEBOOK_OVERRIDES = (
    "__init__", "__iter__", "update", "close", "clear", "reset", "display", "status_printer", "colour",
)


def _patch_module(name: str, module: Any) -> None:
    if name == "tqdm.std":
        _patch_std(module.tqdm)
    elif name == "tqdm.notebook":
        # Widgets built in a child would be orphans (spawn) or talk on the kernel's sockets (fork).
        for attribute in _NOTEBOOK_OVERRIDES:
            if attribute in vars(module.tqdm_notebook):
                delattr(module.tqdm_notebook, attribute)


def _patch_std(cls: type) -> None:
    """Patch tqdm's base class in place, so every subclass (tqdm.auto, asyncio, contrib) reports."""
    global _patched_std
    if _patched_std:
        return
    _patched_std = True
    original_init, original_close = cls.__init__, cls.close

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Draw into a sink that claims to be a terminal, so ``disable=None`` keeps the bar on.
        if len(args) < 5:  # ``file`` is the fifth positional parameter
            kwargs["file"] = _NULL
        kwargs.pop("display", None)  # tqdm.notebook's own option, meaningless once patched
        self._nblaunch_bar = None
        original_init(self, *args, **kwargs)
        if not self.disable:
            self.fp = _NULL
            self._nblaunch_bar = BarReporter(self.total, _describe(self))
            self._nblaunch_bar.update(self.n)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        bar = getattr(self, "_nblaunch_bar", None)
        if bar is not None:
            bar.total = self.total  # tqdm lets code change ``total`` after creation
            bar.update(self.n, _describe(self))
        return True

    def close(self) -> None:
        bar = getattr(self, "_nblaunch_bar", None)
        was_open = not getattr(self, "disable", True)
        original_close(self)
        if bar is not None and was_open:
            bar.total = self.total
            bar.desc = _describe(self)
            bar.close(self.n)

    cls.__init__, cls.display, cls.close = __init__, display, close


def _describe(bar: Any) -> str:
    postfix = getattr(bar, "postfix", None)
    return f"{bar.desc} {postfix}".strip() if postfix else bar.desc


class _NullFile:
    """Where patched bars 'draw': accepts everything, keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


_NULL = _NullFile()


class _TqdmFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of tqdm.std / tqdm.notebook to patch them."""

    targets = frozenset({"tqdm.std", "tqdm.notebook"})

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.targets:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        with _hook_lock:
            _patch_module(module.__name__, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)
