"""Every line a rank writes reaches the launcher, tagged with its rank, Python- or C-level."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

import pytest

from nblaunch import notebook_launcher
from nblaunch.events import LaunchStarted, Output, RankFinished, RankState
from nblaunch.launch.errors import RankFailedError


def chatty():
    rank = os.environ["RANK"]
    print(f"python print from {rank}")
    print(f"python stderr from {rank}", file=sys.stderr)
    os.write(1, f"raw fd write from {rank}\n".encode())
    libc = ctypes.CDLL(None)
    libc.printf(f"C printf from {rank}\n".encode())
    libc.fflush(None)
    logging.getLogger("user").warning("logged from %s", rank)
    for pct in (10, 50, 90):
        sys.stdout.write(f"\rprogress {pct}%")
        sys.stdout.flush()
    sys.stdout.write("\rprogress done\n")
    sys.stdout.write(f"last words of {rank}, no newline")
    return rank


def test_python_and_c_output_of_both_ranks_arrives_whole_and_tagged(recorder):
    # A handler made in the parent, bound to the parent's stderr: in a kernel that stream object
    # would swallow a forked child's writes, so the worker rebinds it to its own stderr.
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("user").addHandler(handler)
    try:
        assert notebook_launcher(chatty, num_processes=2, display=recorder) == ["0", "1"]
    finally:
        logging.getLogger("user").removeHandler(handler)
    for rank in (0, 1):
        out = recorder.lines(rank, "stdout")
        err = recorder.lines(rank, "stderr")
        assert f"python print from {rank}" in out
        assert f"raw fd write from {rank}" in out
        assert f"C printf from {rank}" in out
        assert "progress done" in out and not any("progress 10%" in line for line in out)
        assert out[-1] == f"last words of {rank}, no newline"
        assert f"python stderr from {rank}" in err
        assert f"logged from {rank}" in err
        # Redraws superseded within one read are never shown; those shown are only redraws.
        transient = [e.lines[0] for e in recorder.of(Output) if e.rank == rank and e.transient]
        assert set(transient) <= {"progress 10%", "progress 50%", "progress 90%"}


def test_the_text_display_tags_lines_and_keeps_stderr_apart(capsys):
    notebook_launcher(chatty, num_processes=2, display="text")
    out, err = capsys.readouterr()
    assert "[rank 0] python print from 0" in out and "[rank 1] python print from 1" in out
    assert "[rank 1] python stderr from 1" in err
    assert "nblaunch: all 2 ranks done" in out


def many_lines(count):
    for i in range(count):
        print(f"line {i}")


def test_whole_logs_are_written_to_disk_without_losing_a_line(recorder):
    notebook_launcher(many_lines, args=(20000,), num_processes=2, display=recorder)
    log_dir = Path(recorder.of(LaunchStarted)[0].log_dir)
    for rank in (0, 1):
        lines = (log_dir / f"rank{rank}.log").read_text().splitlines()
        assert lines == [f"line {i}" for i in range(20000)]
        assert recorder.lines(rank) == lines


class BrokenDisplay:
    def on_event(self, event):
        raise RuntimeError("display bug")

    def close(self):
        pass


def test_a_broken_display_is_turned_off_and_the_launch_goes_on(capfd):
    assert notebook_launcher(chatty, num_processes=2, display=BrokenDisplay()) == ["0", "1"]
    err = capfd.readouterr().err
    assert err.count("the display BrokenDisplay failed and was turned off") == 1
    assert "display bug" in err


def forks_after_printing():
    print("before the forks")  # still in the rank's buffer when it forks
    pid = os.fork()
    if pid == 0:
        print("from a forked child")  # os._exit flushes nothing: the child's stdout is line-buffered
        os._exit(0)
    os.waitpid(pid, 0)
    child = multiprocessing.get_context("fork").Process(target=print, args=("from a multiprocessing child",))
    child.start()
    child.join()
    return child.exitcode


def test_a_rank_that_forks_prints_each_line_once_and_its_children_are_heard(recorder):
    assert notebook_launcher(forks_after_printing, num_processes=2, display=recorder) == [0, 0]
    for rank in (0, 1):
        out = recorder.lines(rank)
        for line in ("before the forks", "from a forked child", "from a multiprocessing child"):
            assert out.count(line) == 1, (line, out)


def prints_then_fails():
    print("the last words")
    raise ValueError("broken")


def test_what_a_failing_rank_printed_comes_before_its_failure(recorder):
    with pytest.raises(RankFailedError):
        notebook_launcher(prints_then_fails, num_processes=2, display=recorder)
    events = recorder.of((Output, RankFinished))
    failed_ranks = [e.rank for e in events if isinstance(e, RankFinished) and e.state == RankState.FAILED]
    assert failed_ranks  # the other rank may have been stopped before it printed
    for rank in failed_ranks:
        said = next(i for i, e in enumerate(events) if isinstance(e, Output) and e.rank == rank and "the last words" in e.lines)
        failed = next(i for i, e in enumerate(events) if isinstance(e, RankFinished) and e.rank == rank)
        assert said < failed


def prints_then_dies():
    import signal

    print(f"the last words of rank {os.environ['RANK']}")  # no flush: what people print to find a crash
    os.kill(os.getpid(), signal.SIGKILL)  # as a segfault or the OOM killer ends it, no Python cleanup


def test_a_line_printed_just_before_a_rank_is_killed_is_not_lost(recorder):
    with pytest.raises(RankFailedError, match="SIGKILL"):
        notebook_launcher(prints_then_dies, num_processes=2, display=recorder)
    killed = [e.rank for e in recorder.of(RankFinished) if e.state == RankState.FAILED]
    assert killed
    for rank in killed:
        assert f"the last words of rank {rank}" in recorder.lines(rank)


def chatty_then_quiet():
    for i in range(20000):  # chatty: the rank's stdout is buffered...
        print(f"line {i}")
    time.sleep(0.5)  # ...until it is quiet for a while: then a line at a time again
    print("the last words")
    os.kill(os.getpid(), 9)


def test_after_a_chatty_stretch_a_quiet_rank_writes_each_line_at_once_again(recorder):
    with pytest.raises(RankFailedError):
        notebook_launcher(chatty_then_quiet, num_processes=1, display=recorder)
    lines = recorder.lines(0)
    assert lines == [f"line {i}" for i in range(20000)] + ["the last words"]


def printing_threads(threads: int, lines: int) -> None:
    import threading

    def prints(t: int) -> None:
        for i in range(lines):
            print(f"t{t} line {i}")  # two writes: the text, then the newline

    started = [threading.Thread(target=prints, args=(t,)) for t in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()


def test_threads_that_print_at_once_lose_nothing(recorder):
    # CPython's TextIOWrapper dropped text when threads wrote while it handed text to its buffer
    # (gh-119506): 4 threads x 2000 lines kept 7481 of 8000, some cut short. print's text and
    # newline are two writes, which another thread's may separate (as in any Python process):
    # every line's text must arrive once and whole, and every newline.
    notebook_launcher(printing_threads, args=(4, 2000), num_processes=2, display=recorder)
    log_dir = Path(recorder.of(LaunchStarted)[0].log_dir)
    expected = sorted(f"t{t} line {i}" for t in range(4) for i in range(2000))
    for rank in (0, 1):
        for lines in (recorder.lines(rank), (log_dir / f"rank{rank}.log").read_text().splitlines()):
            assert len(lines) == 8000
            assert sorted(re.findall(r"t\d line \d+", "\n".join(lines))) == expected
