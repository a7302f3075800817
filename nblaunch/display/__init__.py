"""How a launch shows itself. Every display consumes the same events (see nblaunch.events)."""

from __future__ import annotations

import sys
import traceback

from nblaunch.display.text import TextDisplay
from nblaunch.events import Display, Event

DISPLAY_CHOICES = ("auto", "widget", "text", "none")


class NoDisplay:
    """Shows nothing (the logs still go to disk)."""

    def on_event(self, event: Event) -> None:
        pass

    def close(self) -> None:
        pass


def make_display(choice: str | Display, num_processes: int, build_after_s: float | None = None) -> Display:
    """The display for ``notebook_launcher(display=...)``: a name, or any object with
    ``on_event`` and ``close`` (useful to record events in tests).

    "auto" is the widget dashboard in a kernel whose frontend can show widgets, text elsewhere.
    Call it on the launching cell's thread: a widget shows itself where it is made.
    ``build_after_s``: the dashboard of a call on warm ranks, made only if the call runs that long.
    """
    if not isinstance(choice, str):
        return choice
    if choice == "none":
        return NoDisplay()
    if choice in ("auto", "widget"):
        # Deferred: ipywidgets and IPython load only for a display that may use them.
        from nblaunch.display.widget import WidgetDisplay, widgets_available

        if choice == "widget" or widgets_available():
            return WidgetDisplay(num_processes=num_processes, build_after_s=build_after_s)
    return TextDisplay()


class Fanout:
    """Hands each event to several sinks (the log files and the display).

    A sink that raises is reported once and dropped: a bug in a display must not stop the
    training it shows. The log files keep everything regardless.
    """

    def __init__(self, *sinks: Display):
        self.sinks = list(sinks)

    def on_event(self, event: Event) -> None:
        for sink in list(self.sinks):
            self._call(sink, sink.on_event, event)

    def close(self) -> None:
        for sink in list(self.sinks):
            self._call(sink, sink.close)

    def _call(self, sink: Display, method, *args) -> None:
        try:
            method(*args)
        except Exception:
            self.sinks.remove(sink)
            if getattr(sink, "keeps_logs", False):
                what, logs = "writing the logs to disk", "the log files stop here"
            else:
                what = f"the display {type(sink).__name__}"
                logs = "the logs are still written" if any(getattr(s, "keeps_logs", False) for s in self.sinks) else ""
            print(
                f"nblaunch: {what} failed and was turned off; the launch goes on"
                f"{'; ' + logs if logs else ''}:\n{traceback.format_exc()}",
                file=sys.stderr,
            )
