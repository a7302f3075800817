"""Progress bars inside a worker, drawn by the launching cell instead of by the worker.

Two ways in:

* :func:`progress` wraps an iterable, like ``tqdm`` without the dependency::

      from nblaunch.worker.progress import progress
      for batch in progress(loader, desc="epoch 1"):
          ...

  Inside a launch it reports to the launcher (at most ~10 times a second, and once at the
  end); outside one it falls back to ``tqdm.auto`` when tqdm is installed, else plain iteration.

* :func:`install_progress_hooks`, which the bootstrap calls in every worker, makes every tqdm bar
  (``tqdm``, ``tqdm.auto``, ``tqdm.notebook``, and libraries built on them, such as Lightning's
  ``TQDMProgressBar``) report the same way and draw nothing: no widgets owned by a child
  process, no carriage-return spam in the log. Rich's ``Progress`` (Lightning's
  ``RichProgressBar``, ``rich.progress.track``) reports its visible tasks the same way, and a
  rich ``Console`` in a rank writes to the rank's stdout, never into the kernel's cell. Each
  library is patched when it is first imported, so a worker that never uses it pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import math
import os
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
        self.n: float = 0
        self._last = -float("inf")

    def update(self, n: float, desc: str | None = None) -> None:
        """Report position ``n`` unless a report went out less than REPORT_INTERVAL_S ago."""
        if desc is not None:
            self.desc = desc
        self.n = n
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


# --- the hooks ------------------------------------------------------------------------------

_hook_lock = threading.Lock()
_patched: set[str] = set()  # the modules patched in this process, each once
_HOOKED = ("tqdm.std", "tqdm.notebook", "rich.console", "rich.progress")


def install_progress_hooks() -> None:
    """Make tqdm's and rich's bars in this process report to the launcher instead of drawing.

    Patches each module now if it is already imported (a forked worker inherits the kernel's
    modules), else when it is first imported. Safe to call more than once.
    """
    with _hook_lock:
        for name in _HOOKED:
            if name in sys.modules:
                _patch_module(name, sys.modules[name])
        if not any(isinstance(finder, _BarsFinder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _BarsFinder())


def _patch_module(name: str, module: Any) -> None:
    if name in _patched:
        return
    _patched.add(name)
    if name == "tqdm.std":
        _patch_std(module.tqdm)
    elif name == "tqdm.notebook":
        # Widgets built in a child would be orphans (spawn) or talk on the kernel's sockets (fork).
        for attribute in _NOTEBOOK_OVERRIDES:
            if attribute in vars(module.tqdm_notebook):
                delattr(module.tqdm_notebook, attribute)
    elif name == "rich.console":
        _patch_rich_console(module)
    elif name == "rich.progress":
        _patch_rich_progress(module)


# --- tqdm -----------------------------------------------------------------------------------


# What tqdm.notebook's bar class overrides to draw ipywidgets. Removing these overrides makes
# it (and subclasses already made from it, such as tqdm.auto's class in a worker forked from a
# kernel) behave like the patched console class.
_NOTEBOOK_OVERRIDES = (
    "__init__", "__iter__", "update", "close", "clear", "reset", "display", "status_printer", "colour",
)


def _patch_std(cls: type) -> None:
    """Patch tqdm's base class in place, so every subclass (tqdm.auto, asyncio, contrib) reports."""
    original_init, original_close, original_reset = cls.__init__, cls.close, cls.reset

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

    def reset(self, total: float | None = None) -> None:
        # A bar reset for a new loop (Lightning's, every epoch) is a new bar for the launcher:
        # its rate counts from this loop's start, not the first one's.
        bar = getattr(self, "_nblaunch_bar", None)
        if bar is not None and self.n:  # a bar reset before it moved goes on as the same bar
            bar.close(self.n)
            self._nblaunch_bar = BarReporter(self.total if total is None else total, _describe(self))
        original_reset(self, total)

    cls.__init__, cls.display, cls.close, cls.reset = __init__, display, close, reset


def _describe(bar: Any) -> str:
    desc = bar.desc[:-2] if bar.desc.endswith(": ") else bar.desc  # set_description's separator
    postfix = getattr(bar, "postfix", None)
    return f"{desc} {postfix}".strip() if postfix else desc


class _NullFile:
    """Where patched bars 'draw': accepts everything, keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


_NULL = _NullFile()


# --- rich -----------------------------------------------------------------------------------


def _patch_rich_console(module: Any) -> None:
    """Rich consoles in a rank write to a pipe the launcher reads, as a script's written to a file
    do; each default is set through the Console's own parameters, so code asking for more gets it.

    * ``force_jupyter=False``: a forked rank still finds the kernel's shell, and a console that
      believes it is in Jupyter sends its output (a bar's widget, Lightning's model summary)
      through IPython into the cell, behind the launcher's back.
    * ``force_terminal=False`` (unless rich's ``TTY_COMPATIBLE`` is set): the kernel sets
      ``FORCE_COLOR=1``, which rich reads as a terminal; a ``Live`` display would then redraw
      itself into the rank's log at every refresh, with cursor codes. The launcher draws bars.
    """
    cls = module.Console
    original_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("force_jupyter") is None:
            kwargs["force_jupyter"] = False
        if kwargs.get("force_terminal") is None and "TTY_COMPATIBLE" not in os.environ:
            kwargs["force_terminal"] = False
        original_init(self, *args, **kwargs)

    cls.__init__ = __init__
    rich = sys.modules.get("rich")
    inherited = getattr(rich, "_console", None)  # the global console, made in the kernel before the fork
    if inherited is not None and (inherited.is_jupyter or inherited.is_terminal):
        rich.reconfigure()  # made again, with the defaults above


def _patch_rich_progress(module: Any) -> None:
    """Report a ``Progress``'s visible tasks whenever rich draws it (``get_renderable``: every
    refresh, by its thread or by ``refresh()``), and close them when they are hidden, reset or
    removed, or it stops. A rank's console is not a terminal: rich draws nothing until ``stop()``,
    and then, made transient, nothing either."""
    cls = module.Progress
    original_get_renderable, original_stop, original_reset = cls.get_renderable, cls.stop, cls.reset

    def get_renderable(self: Any) -> Any:
        _report_tasks(self, module, stopping=False)
        return original_get_renderable(self)

    def stop(self: Any) -> None:
        self.live.transient = True  # its last frame was the launcher's to draw, not the log's
        original_stop(self)
        _report_tasks(self, module, stopping=True)

    def reset(self: Any, task_id: Any, *args: Any, **kwargs: Any) -> None:
        # A task reset for a new loop (Lightning's, every epoch) is a new bar for the launcher,
        # its rate from 0; the old one ends where the loop did, which the last refresh may not show.
        _report_tasks(self, module, stopping=False, ending=task_id)
        original_reset(self, task_id, *args, **kwargs)

    cls.get_renderable, cls.stop, cls.reset = get_renderable, stop, reset


def _report_tasks(progress: Any, module: Any, stopping: bool, ending: Any = None) -> None:
    if getattr(progress, "disable", False):  # Lightning's bar on ranks other than 0
        return
    # Under the Progress's own (re-entrant) lock: its refresh thread draws while the main thread
    # resets, and rich takes this lock before drawing a nested Progress, so ours comes after it.
    with progress.__dict__.setdefault("_lock", threading.RLock()):
        _report_tasks_locked(progress, module, stopping, ending)


def _report_tasks_locked(progress: Any, module: Any, stopping: bool, ending: Any) -> None:
    bars: dict[Any, BarReporter] = progress.__dict__.setdefault("_nblaunch_bars", {})
    tasks = {task.id: task for task in progress.tasks}
    for task_id, task in tasks.items():
        total = task.total if task.total is not None and math.isfinite(task.total) else None
        desc = _plain(module, task.description)
        bar = bars.get(task_id)
        if task.visible and not stopping and task_id != ending:
            if bar is None:
                bar = bars[task_id] = BarReporter(total, desc)
            bar.total = total
            bar.update(task.completed, desc)
        elif bar is not None:  # hidden (Lightning hides a finished validation), reset or stopped
            bar.total, bar.desc = total, desc
            bar.close(task.completed)
            del bars[task_id]
    for task_id in set(bars) - set(tasks):  # removed with remove_task()
        gone = bars.pop(task_id)
        gone.close(gone.n)


def _plain(module: Any, description: str) -> str:
    """A task's description without rich's markup ("[green]train" is "train")."""
    try:
        return module.Text.from_markup(description).plain.strip()
    except Exception:  # not valid markup: shown as written
        return description.strip()


class _BarsFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of the modules in ``_HOOKED`` to patch them."""

    targets = frozenset(_HOOKED)

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
