"""How a launch shows itself. Every display consumes the same events (see nblaunch.events)."""

from __future__ import annotations

from nblaunch.events import Display, Event

DISPLAY_CHOICES = ("auto", "widget", "text", "none")


class NoDisplay:
    """Shows nothing (the logs still go to disk)."""

    def on_event(self, event: Event) -> None:
        pass

    def close(self) -> None:
        pass


def make_display(choice: str | Display) -> Display:
    """The display for ``notebook_launcher(display=...)``: a name, or any object with
    ``on_event`` and ``close`` (useful to record events in tests)."""
    if not isinstance(choice, str):
        return choice
    if choice == "none":
        return NoDisplay()
    from nblaunch.display.text import TextDisplay

    return TextDisplay()


class Fanout:
    """Hands each event to several sinks (the display and the log files)."""

    def __init__(self, *sinks: Display):
        self.sinks = sinks

    def on_event(self, event: Event) -> None:
        for sink in self.sinks:
            sink.on_event(event)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
