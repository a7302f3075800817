"""A live dashboard for a launch, as ipywidgets in the launching cell.

Creating a :class:`WidgetDisplay` shows it in the current cell's output; the launcher then
feeds it events. Layout, top to bottom: a header (what runs, where, for how long, how it is
going), a row per rank (state, progress bars, last line, elapsed), metric charts with the
latest values, and the log tails in tabs (all ranks merged, then one per rank). When the launch
ends, a static HTML summary takes the widget's place in the cell: one view, and a saved notebook
shows what happened where widgets do not render (GitHub, nbviewer, a kernel-less reopen).

Why it stays cheap and correct:

* ``on_event`` only folds the event into a :class:`~nblaunch.display.view_state.LaunchView` under a
  lock (microseconds), so 100k lines of output do not slow the launch.
* A timer thread redraws the parts that changed at most ``1 / refresh_s`` times a second by
  setting the ``value`` of a few HTML widgets. Each update is one comm message with the current
  tail (never a growing output), and comm messages go out on the kernel's IOPub thread, so they
  reach the frontend while the kernel's main thread is busy in a blocking launch, and after the
  cell has finished in a non-blocking one.
* Nothing is printed or ``display``-ed from a background thread: the widget is shown from the
  constructor, on the cell's thread, with a display id; the end-of-launch summary replaces it
  by that id, which lands in the right cell whichever thread sends it.

Example (what ``notebook_launcher(..., display="widget")`` does)::

    display = WidgetDisplay()
    for event in events:
        display.on_event(event)
    display.close()
"""

from __future__ import annotations

import contextvars
import importlib.util
import logging
import os
import sys
import threading
import time
from typing import Any

from nblaunch.display import render
from nblaunch.display.view_state import HEADER, MERGED_LOG, METRICS, RANKS, STACKS, LaunchView, rank_log
from nblaunch.display.summary import summary_html
from nblaunch.events import Event, LaunchFinished, LaunchStarted, RankStarted

log = logging.getLogger(__name__)
_STARTING = '<div class="nblaunch-starting" style="font-family: sans-serif; color: #6b7280">nblaunch: running…</div>'


def widgets_available() -> bool:
    """True inside a Jupyter kernel whose frontends can show ipywidgets.

    False in plain Python, terminal IPython, and Qt console / Spyder (kernels without a widget
    manager). A kernel cannot know every frontend attached to it; jupyter console attached to
    an ipykernel still reads as True.
    """
    if "ipykernel" not in sys.modules or importlib.util.find_spec("ipywidgets") is None:
        return False
    from IPython import get_ipython
    from ipykernel.zmqshell import ZMQInteractiveShell

    shell = get_ipython()
    if not isinstance(shell, ZMQInteractiveShell):  # Colab's shell is a subclass
        return False
    if any(name == "QT_API" or name.startswith("SPYDER") for name in os.environ):
        return False  # qtconsole / Spyder: kernels without a widget manager
    return True


class WidgetDisplay:
    """The launch dashboard; implements the :class:`nblaunch.events.Display` protocol.

    Args:
        num_processes: the number of ranks, when known before the launch: every widget is then
            made in the constructor, on the cell's thread, so even a client that only listens
            while a cell runs (nbclient, papermill) sees them all. Otherwise the log tabs are
            made when ``LaunchStarted`` arrives.
        max_lines: lines of log kept per rank and for the merged view (the page never holds
            more; full logs are on disk).
        max_points: points kept per metric and rank (thinned evenly beyond that).
        refresh_s: shortest time between two redraws.
        show: display the widget now, in the current cell (False for tests that only inspect).
        build_after_s: a call on warm ranks: the cell shows one line at first, and the widgets
            are made only if the call is still running after this long (a quick cell's
            dashboard would be replaced by its summary within milliseconds; making it cost
            such a cell half its time). None: made at once.

    Example::

        display = WidgetDisplay(max_lines=200)
        display.widget  # the ipywidgets.VBox shown in the cell
    """

    def __init__(
        self,
        *,
        num_processes: int | None = None,
        max_lines: int = 300,
        max_points: int = 1000,
        refresh_s: float = 0.1,
        show: bool = True,
        build_after_s: float | None = None,
    ) -> None:
        self._view = LaunchView(max_lines=max_lines, max_points=max_points)
        self._lock = threading.Lock()  # the launch thread writes the view, the timer reads it
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._closed = False
        self._num_processes = num_processes
        self._on_stop: Any = None
        self._on_stacks: Any = None
        self.widget: Any = None  # the ipywidgets.VBox, once made
        self.summary_html = ""  # the static summary, once the launch is over
        self._summary_handle: Any = None
        self._build_at = None if build_after_s is None else time.monotonic() + build_after_s
        self._context = contextvars.copy_context()  # the cell's: widgets made later are routed to it
        if self._build_at is None:
            self._build()
        if show:
            from IPython.display import HTML, display

            # With a display id, on the cell's thread: at the end the summary replaces the
            # widget in place (from any thread), so the cell keeps one view and a saved notebook
            # holds no widget it cannot draw once the kernel is gone.
            shown = _view_bundle(self.widget) if self.widget is not None else HTML(_STARTING)
            self._summary_handle = display(shown, raw=self.widget is not None, display_id=True)

    def _build(self) -> None:
        """Make the widgets and draw them (on the cell's thread, or later in its context)."""
        import ipywidgets as w

        self._widgets = w
        self.header = w.HTML(layout=w.Layout(flex="1 1 auto"))
        # Shown only for non-blocking launches: while a cell blocks, the kernel cannot hear a click
        # (a blocking launch shows the stacks by itself when every rank goes quiet).
        button = dict(display="none", width="auto", flex="0 0 auto", overflow="visible")
        self.stacks_button = w.Button(
            description="Stacks", icon="list", tooltip="show where every rank is now; the launch goes on",
            layout=w.Layout(**button),
        )
        self.stop_button = w.Button(
            description="Stop", icon="stop", button_style="danger", tooltip="show every rank's stack, then stop all ranks",
            layout=w.Layout(**button),
        )
        self.stop_button.on_click(self._stop_clicked)
        self.stacks_button.on_click(self._stacks_clicked)
        self.ranks = w.HTML()
        hidden = dict(display="none")  # no blank gap until there is something to show
        self.metrics = w.HTML(layout=w.Layout(**hidden))
        self.stacks = w.HTML(layout=w.Layout(**hidden))
        self.logs = w.Tab()
        self.log_panes: dict[str, Any] = {}  # "all" / rank -> HTML widget with that log tail
        self.widget = w.VBox(
            [w.HBox([self.header, self.stacks_button, self.stop_button], layout=w.Layout(align_items="flex-start")),
             self.ranks, self.stacks, self.metrics, self.logs],
            layout=w.Layout(width="100%", padding="4px 0"),
        )
        self.widget.add_class("nblaunch-dashboard")
        with self._lock:
            ranks = list(self._view.ranks) if self._view.plan is not None else None
        if ranks is not None or self._num_processes is not None:
            self._build_log_tabs(ranks if ranks is not None else list(range(self._num_processes)))
        self._show_buttons()
        every = {HEADER, RANKS, METRICS, STACKS, MERGED_LOG} | {rank_log(r) for r in ranks or []}
        self._redraw(every if ranks is not None else set(), time.monotonic())

    def _build_late(self) -> None:
        """The call still runs: make the dashboard now, and show it in the line's place."""
        self._build_at = None
        self._context.run(self._build)
        if self._summary_handle is not None:
            self._summary_handle.update(_view_bundle(self.widget), raw=True)

    def set_stop_handler(self, stop: Any, stacks: Any = None) -> None:
        """Show the Stop button, and the Stacks button when ``stacks`` is given; clicking them
        calls ``stop()`` (a non-blocking launch's cancel) or ``stacks()`` (ask, do not stop)."""
        self._on_stop, self._on_stacks = stop, stacks
        self._show_buttons()

    def _show_buttons(self) -> None:
        if self.widget is None or self._on_stop is None:
            return
        self.stop_button.layout.display = None
        if self._on_stacks is not None:
            self.stacks_button.layout.display = None

    def _stop_clicked(self, _button: Any) -> None:
        self.stop_button.disabled = self.stacks_button.disabled = True
        self.stop_button.description = "Stopping…"
        if self._on_stop is not None:
            self._on_stop()

    def _stacks_clicked(self, _button: Any) -> None:
        if self._on_stacks is not None:
            self._on_stacks()

    # -- the Display protocol ----------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        """Fold one event in; drawing happens on the timer thread (or now, for the last event)."""
        now = time.monotonic()
        with self._lock:
            self._view.apply(event, now)
        if isinstance(event, LaunchStarted) and self.widget is not None:
            with self._lock:
                ranks = list(self._view.ranks)
            self._build_log_tabs(ranks)
            self._redraw(None, now)
        elif isinstance(event, RankStarted):
            # Started only once workers exist: forking while this thread renders would be needless risk.
            self._start_timer()
        elif isinstance(event, LaunchFinished):
            self._finish()

    def close(self) -> None:
        """Stop redrawing and leave the final picture (and summary) in place. Idempotent."""
        self._finish()

    # -- drawing -----------------------------------------------------------------------------

    def _build_log_tabs(self, ranks: list[int]) -> None:
        with self._lock:
            self._view.dirty |= {MERGED_LOG} | {rank_log(r) for r in ranks}  # draw the empty panes
        if list(self.log_panes) == ["all"] + [str(r) for r in ranks]:
            return  # made in the constructor already
        w = self._widgets
        self.log_panes = {"all": w.HTML()} | {str(r): w.HTML() for r in ranks}
        self.logs.children = list(self.log_panes.values())
        titles = ["all ranks"] + [f"rank {r}" for r in ranks]
        if self.logs.has_trait("titles"):  # ipywidgets 8: one message
            self.logs.titles = titles
        else:  # ipywidgets 7 (Colab)
            for index, title in enumerate(titles):
                self.logs.set_title(index, title)

    def _start_timer(self) -> None:
        if self._timer is None and not self._closed:
            self._timer = threading.Thread(target=self._tick, name="nblaunch-display", daemon=True)
            self._timer.start()

    def _tick(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                if self._build_at is not None:
                    if time.monotonic() >= self._build_at:
                        self._build_late()
                    continue
                self._redraw(None, time.monotonic())
            except Exception:  # a drawing bug must not take the launch down with it
                log.exception("nblaunch: the launch dashboard stopped updating")
                return

    def _redraw(self, parts: set[str] | None, now: float) -> None:
        """Redraw ``parts`` (None: whatever changed since the last redraw) and the clocks.

        HTML is rendered under the lock, widgets are updated outside it; a widget whose value
        did not change sends nothing.
        """
        if self.widget is None:
            return  # not made (yet): the view keeps everything for when it is, or for the summary
        with self._lock:
            view = self._view
            if parts is None:
                parts = set(view.dirty)
            view.dirty -= parts
            values: list[tuple[Any, str]] = [
                (self.header, render.header_html(view, now)),
                (self.ranks, render.ranks_html(view, now)),  # elapsed times tick without events
            ]
            if METRICS in parts and view.metrics:
                values.append((self.metrics, render.metrics_html(view)))
            if STACKS in parts:
                values.append((self.stacks, render.stacks_html(view)))
            for key, pane in self.log_panes.items():
                rank = None if key == "all" else int(key)
                if (MERGED_LOG if rank is None else rank_log(rank)) in parts:
                    values.append((pane, render.log_html(view, rank)))
        for widget, value in values:
            widget.value = value
        for shown_when_filled in (self.metrics, self.stacks):
            if shown_when_filled.value and shown_when_filled.layout.display == "none":
                shown_when_filled.layout.display = None

    def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        if self.widget is not None:
            self.stop_button.layout.display = self.stacks_button.layout.display = "none"
        now = time.monotonic()
        self._redraw({HEADER, RANKS, METRICS, MERGED_LOG} | {rank_log(r) for r in self._view.ranks}, now)
        with self._lock:
            if self._view.plan is None:  # closed before anything was launched: nothing to record
                return
            self.summary_html = summary_html(self._view, now)
        if self._summary_handle is not None:
            from IPython.display import HTML

            self._summary_handle.update(HTML(self.summary_html))
            # The view is gone from the cell: its models need not outlive it in the kernel.
            for widget in ([] if self.widget is None else [self.widget, *self.widget.children, self.header,
                                                           self.stop_button, self.stacks_button,
                                                           *self.log_panes.values()]):
                widget.close()


def _view_bundle(widget: Any) -> dict:
    """The widget's view as a display bundle. ipywidgets 7 (Colab) shows a widget through
    ``_ipython_display_``, which drops a display id: the bundle is made here for it."""
    bundle = widget._repr_mimebundle_() if hasattr(widget, "_repr_mimebundle_") else None
    if not bundle:
        bundle = {"text/plain": repr(widget),
                  "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                               "model_id": widget.model_id}}
    return bundle
