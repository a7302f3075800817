"""Worker-side progress: nblaunch's own wrapper and tqdm's bars, reported over a real channel."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from nblaunch import wire
from nblaunch.worker import channel
from nblaunch.worker.progress import progress

pytest.importorskip("tqdm")


def read_progress(fd: int) -> list[tuple]:
    """Every PROGRESS frame readable from ``fd`` until EOF, as (bar_id, n, total, desc, closed)."""
    reader, frames = wire.FrameReader(), []
    while chunk := os.read(fd, 1 << 16):
        frames += [pickle.loads(body) for kind, body in reader.feed(chunk) if kind == wire.PROGRESS]
    return frames


@pytest.fixture
def pipe_channel():
    read_fd, write_fd = os.pipe()
    channel.open_channel(write_fd)
    yield read_fd, write_fd
    channel.close_channel()
    for fd in (read_fd, write_fd):
        try:
            os.close(fd)
        except OSError:
            pass


def drain(pipe_channel) -> list[tuple]:
    read_fd, write_fd = pipe_channel
    channel.close_channel()
    os.close(write_fd)
    return read_progress(read_fd)


def test_progress_reports_throttled_and_always_the_end(pipe_channel):
    assert sum(progress(range(100_000), desc="train")) == sum(range(100_000))
    frames = drain(pipe_channel)
    assert frames[0][1:5] == (0, 100_000, "train", False)
    assert frames[-1][1:5] == (100_000, 100_000, "train", True)
    assert len(frames) < 30  # ~10 per second at most, not one per item
    assert len({f[0] for f in frames}) == 1


def test_a_loop_left_early_closes_its_bar_where_it_stopped(pipe_channel):
    for i in progress(iter(range(10)), desc="search"):  # no len(): unknown total
        if i == 3:
            break
    frames = drain(pipe_channel)
    assert frames[-1][1:5] == (3, None, "search", True)


def test_outside_a_launch_progress_is_just_iteration():
    assert not channel.in_launch()
    assert list(progress([1, 2, 3])) == [1, 2, 3]


def run_tqdm_worker(scenario: str) -> tuple[list[tuple], str]:
    read_fd, write_fd = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("tqdm_worker.py")), str(write_fd), scenario],
            pass_fds=(write_fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        os.close(write_fd)
        frames = read_progress(read_fd)
        out, err = child.communicate(timeout=60)
    finally:
        os.close(read_fd)
    assert child.returncode == 0, err
    return frames, out + err


def by_desc(frames: list[tuple]) -> dict[str, list[tuple]]:
    bars: dict[int, list[tuple]] = {}
    for frame in frames:
        bars.setdefault(frame[0], []).append(frame)
    return {updates[0][3]: updates for updates in bars.values()}


def test_tqdm_bars_are_reported_not_drawn():
    frames, output = run_tqdm_worker("lazy")
    bars = by_desc(frames)

    std = bars["std"]
    assert std[-1][1:5] == (500, 500, "std", True)
    assert len(std) < 30  # throttled even with mininterval=0
    assert bars["auto"][-1][1:5] == (300, 300, "auto", True)  # disable=None did not turn it off
    notebook = [f for f in frames if f[3].startswith("notebook")]
    assert notebook[-1][1:5] == (40, 40, "notebook loss=0.25", True)
    assert bars["nested outer"][-1][1:3] == (5, 5)
    assert sum(1 for f in frames if f[3] == "nested inner" and f[4]) == 5  # five inner bars, each closed
    # Nothing drawn: the only output is what the code printed itself.
    assert output.strip() == "a line written with tqdm.write"


def test_tqdm_imported_in_a_kernel_before_the_hook_still_reports_without_widgets():
    frames, output = run_tqdm_worker("imported_before")
    assert frames[-1][1:5] == (100, 100, "auto from a kernel", True)
    assert "%|" not in output and "\r" not in output


def test_rich_bars_are_reported_not_drawn_and_rich_prints_to_the_rank_not_the_kernel():
    pytest.importorskip("rich")
    frames, output = run_tqdm_worker("rich")
    closed = [f[1:4] for f in frames if f[4]]
    assert (50, 50, "tracked") in closed  # markup stripped
    assert (2, 5, "dropped") in closed  # removed where it stood
    assert (10, 10, "kept") in closed and (4, 4, "again") in closed  # a reset task is a new bar
    assert len({f[0] for f in frames}) == 4
    # Nothing drawn, no cursor codes; rich's own print lands in the rank's output, not in IPython.
    assert output.strip() == "a line printed with rich", repr(output)
