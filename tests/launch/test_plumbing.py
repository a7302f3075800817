"""The byte-level pieces: framing and line cutting, fed the awkward chunkings pipes produce."""

from __future__ import annotations

import os
import threading

from nblaunch import wire
from nblaunch.launch.supervising.watched_rank import LineSplitter


def test_frames_survive_any_chunking():
    stream = wire.encode(wire.RESULT, b"x" * 70000) + wire.encode(wire.METRICS, b"") + wire.encode(wire.STACKS, b"abc")
    for size in (1, 7, 9, 4096, len(stream)):
        reader = wire.FrameReader()
        frames = []
        for i in range(0, len(stream), size):
            frames += reader.feed(stream[i : i + size])
        assert frames == [(wire.RESULT, b"x" * 70000), (wire.METRICS, b""), (wire.STACKS, b"abc")]
        assert not reader.mid_frame


def test_a_frame_bigger_than_the_pipe_is_written_whole_while_read():
    read_end, write_end = os.pipe()
    body = os.urandom(3 * 1024 * 1024)
    writer = threading.Thread(target=wire.write_frame, args=(write_end, wire.RESULT, body))
    writer.start()
    reader, frames = wire.FrameReader(), []
    while not frames:
        frames = reader.feed(os.read(read_end, 1 << 16))
    writer.join()
    os.close(read_end)
    os.close(write_end)
    assert frames == [(wire.RESULT, body)]


def test_lines_split_on_every_kind_of_line_end_across_chunks():
    splitter = LineSplitter()
    assert splitter.feed(b"one\ntw") == (["one"], None)
    assert splitter.feed(b"o\r") == ([], None)  # "\r" could still become "\r\n"
    assert splitter.feed(b"\nthree\r\n") == (["two", "three"], None)
    assert splitter.feed(b"\r10%\r20%") == ([], "10%")
    assert splitter.feed(b"\rdone\nrest") == (["done"], None)  # the redraw was superseded
    assert splitter.flush() == ["rest"]
    assert splitter.flush() == []


def test_undecodable_bytes_are_replaced_not_dropped():
    splitter = LineSplitter()
    assert splitter.feed(b"caf\xc3\xa9 \xff\n") == (["café \ufffd"], None)
