"""A detached launch's events on disk, as they happen: what a kernel that attaches later replays
into its dashboard, then follows live. Any number of readers may follow one writer.

The journal is a folder of segments (``0000.events``, ``0001.events``, ...), each a run of frames
(4-byte length, then the event pickled with cloudpickle). It is bounded: a segment is closed at
:data:`SEGMENT_BYTES` and only the first segment (the launch's start) and the last
:data:`KEPT_SEGMENTS` are kept, so a chatty run keeps its start and its recent past; every rank's
whole output is in its log file regardless.

Example::

    journal = JournalWriter(folder)          # a Display: Launch(..., display=journal)
    reader = JournalReader(folder)
    for event in reader.read_available():    # what has been written so far
        display.on_event(event)
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

import cloudpickle

from nblaunch.events import Event

__all__ = ["JournalWriter", "JournalReader", "SEGMENT_BYTES", "KEPT_SEGMENTS"]

SEGMENT_BYTES = 8 * 1024 * 1024
KEPT_SEGMENTS = 4  # besides the first: 40 MiB at most
_HEADER = struct.Struct("<I")


def _segment_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"{index:04d}.events")


def _segments(folder: str) -> list[int]:
    return sorted(int(name.split(".")[0]) for name in os.listdir(folder) if name.endswith(".events"))


class JournalWriter:
    """A Display that appends every event to the journal in ``folder`` (one write per event, so
    a reader sees it at once and a crash loses at most the event being written)."""

    keeps_logs = True  # a failure to write is reported as the log files' would be

    def __init__(self, folder: str, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = folder
        self.segment_bytes = segment_bytes
        self.index = 0
        self.written = 0
        self.fd = os.open(_segment_path(folder, 0), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def on_event(self, event: Event) -> None:
        try:  # plain pickle for nblaunch's own events (most of them: output lines), several times faster
            body = pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            try:  # results or errors of classes defined in a notebook: by value
                body = cloudpickle.dumps(event)
            except Exception as error:  # a result that cannot be pickled must not end the journal
                body = cloudpickle.dumps(_unpicklable(event, error))
        frame = _HEADER.pack(len(body)) + body
        if self.written and self.written + len(frame) > self.segment_bytes:
            self._next_segment()
        os.write(self.fd, frame)
        self.written += len(frame)

    def _next_segment(self) -> None:
        os.close(self.fd)
        self.index += 1
        self.written = 0
        self.fd = os.open(_segment_path(self.folder, self.index), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        for old in _segments(self.folder):
            if 0 < old <= self.index - KEPT_SEGMENTS - 1:
                os.unlink(_segment_path(self.folder, old))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _unpicklable(event: Any, error: Exception) -> Any:
    """The event with what could not be pickled replaced by a note (results stay in outcome.pkl)."""
    import dataclasses

    replaced = {field.name: None for field in dataclasses.fields(event)
                if field.name in ("results", "error")}
    summary = getattr(event, "summary", "")
    if "summary" in {field.name for field in dataclasses.fields(event)}:
        replaced["summary"] = f"{summary} (not shown here: {error})"
    return dataclasses.replace(event, **replaced)


class JournalReader:
    """Reads a journal from its start; :meth:`read_available` returns the events written since
    the last call. Segments rotated away before they were read are skipped."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.index = 0
        self.offset = 0

    def read_available(self) -> list[Event]:
        events: list[Event] = []
        while True:
            events.extend(self._read_segment())
            later = [index for index in _segments(self.folder) if index > self.index]
            if not later:
                return events
            # The writer moved on, so this segment is whole now: its last frame may have been
            # half-written when it was read above.
            events.extend(self._read_segment())
            self.index, self.offset = later[0], 0

    def _read_segment(self) -> list[Event]:
        try:
            with open(_segment_path(self.folder, self.index), "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:  # rotated away
            return []
        events, position = [], 0
        while position + _HEADER.size <= len(data):
            (length,) = _HEADER.unpack_from(data, position)
            end = position + _HEADER.size + length
            if end > len(data):
                break  # being written: the rest comes with the next read
            try:
                events.append(cloudpickle.loads(data[position + _HEADER.size:end]))
            except Exception:  # a result or error of a class this process cannot import: outcome.pkl says
                pass
            position = end
        self.offset += position
        return events
