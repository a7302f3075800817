"""What hostile testing broke: odd exceptions, odd output, early exits, and the launcher's own
end. Each case runs real ranks."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from nblaunch import RankFailedError, notebook_launcher


class UnprintableError(Exception):
    def __str__(self):
        raise ValueError("no text for you")


def raises_unprintable():
    raise UnprintableError()


def test_an_exception_whose_str_raises_is_reported_with_its_traceback():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(raises_unprintable, num_processes=2, display="none")
    root = info.value.root_cause
    assert root.reason == "UnprintableError: <its message could not be shown: str() raised ValueError>"
    assert "raise UnprintableError()" in root.traceback


class CarriesATensor(Exception):
    def __init__(self, tensor):
        super().__init__("carries a big tensor")
        self.tensor = tensor


def raises_with_400_mb():
    raise CarriesATensor(torch.zeros(100 * 2**20))  # 400 MB


def raises_with_200_mb_of_bytes():
    raise CarriesATensor(b"x" * (200 * 2**20))


@pytest.mark.parametrize("raises", [raises_with_400_mb, raises_with_200_mb_of_bytes])
def test_an_exception_carrying_hundreds_of_mb_still_sends_its_traceback(raises):
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(raises, num_processes=2, display="none")
    root = info.value.root_cause
    assert root.reason == "CarriesATensor: carries a big tensor"  # not "stopped before it could send..."
    assert f"in {raises.__name__}" in root.traceback
    assert not isinstance(root.exception, CarriesATensor)  # too big to ship: its type and text stand in


def raises_with_a_surrogate():
    print("before the failure", flush=True)
    raise ValueError("bad byte: \udcff")


def test_a_surrogate_in_an_exception_keeps_the_log_files_working(capfd):
    launch = notebook_launcher(raises_with_a_surrogate, num_processes=2, display="none", block=False)
    with pytest.raises(RankFailedError):
        launch.result(timeout=120)
    log = launch.logs(0) + launch.logs(1)
    assert "before the failure" in log and "bad byte: \\udcff" in log
    assert "turned off" not in capfd.readouterr().err


def prints_from_c():
    libc = ctypes.CDLL(None)
    libc.printf(b"printed by C's printf, no newline flush")
    libc.printf(b" and still there\n")  # a pipe: fully buffered in C until exit
    return 1


def test_output_buffered_in_c_stdio_is_flushed_before_the_rank_exits(recorder):
    assert notebook_launcher(prints_from_c, num_processes=2, display=recorder) == [1, 1]
    for rank in (0, 1):
        assert "printed by C's printf, no newline flush and still there" in recorder.lines(rank)


def prints_then_waits(flag_path):
    print(f"rank {os.environ['RANK']} line one", flush=True)
    while not os.path.exists(flag_path):  # the test lets it finish once it has read the log
        time.sleep(0.01)
    return "done"


def test_log_files_have_each_line_while_the_launch_runs(tmp_path):
    flag = tmp_path / "finish"
    launch = notebook_launcher(prints_then_waits, args=(str(flag),), num_processes=2, display="none", block=False)
    try:
        deadline = time.monotonic() + 60
        for rank in (0, 1):
            path = os.path.join(launch.log_dir, f"rank{rank}.log")
            while f"rank {rank} line one" not in open(path).read():  # read the file, not launch.logs()
                assert time.monotonic() < deadline, "the line never reached the log file"
                time.sleep(0.02)
    finally:
        flag.touch()
    assert launch.result(timeout=60) == ["done", "done"]


KILLED_LAUNCHER = textwrap.dedent("""
    import time
    from nblaunch import notebook_launcher
    def chatty():
        for i in range(40):
            print(f"line {i}")  # no flush: the rank's stdout is buffered, flushed on a timer
        i = 0
        while True:  # still printing when the launcher dies
            print(f"more {i}")
            i += 1
            time.sleep(0.001)
    notebook_launcher(chatty, num_processes=2, display="text")
""")


def test_a_launcher_killed_mid_stream_leaves_every_line_it_had_in_the_logs():
    launcher = subprocess.Popen([sys.executable, "-c", KILLED_LAUNCHER], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    backstop = threading.Timer(120, launcher.kill)  # never wait on its output for ever
    backstop.start()
    log_dir, seen = None, 0
    for line in launcher.stdout:
        if "logs in " in line:
            log_dir = line.rsplit("logs in ", 1)[1].strip()
        seen += line.startswith("[rank ") and " line " in line
        if seen == 80:
            break
    launcher.kill()  # as the OOM killer kills a kernel
    launcher.wait()
    backstop.cancel()
    assert seen == 80, "the launcher did not print every rank's lines"
    for rank in (0, 1):
        lines = open(os.path.join(log_dir, f"rank{rank}.log")).read().splitlines()
        assert [f"line {i}" for i in range(40)] == lines[:40]
        assert lines[40:] == [f"more {i}" for i in range(len(lines) - 40)], "a hole or a torn line"


def rank_one_leaves_early():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        return "left"
    for _ in range(5):
        dist.all_reduce(torch.ones(4))
    return "unreachable"


def test_a_rank_that_finishes_early_is_named_as_what_happened():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(rank_one_leaves_early, num_processes=2, display="none")
    root = info.value.root_cause
    assert root.rank == 0
    assert root.reason.startswith("still in all_reduce() when rank 1 finished and left: ")
    assert "uneven work" in root.hint and "join_uneven_inputs" in root.hint


def quick():
    return 1


def test_concurrent_background_launches_never_change_the_warning_filters():
    before = list(warnings.filters)
    for _ in range(5):
        launches = [notebook_launcher(quick, num_processes=2, display="none", block=False) for _ in range(3)]
        for launch in launches:
            assert launch.result(timeout=120) == [1, 1]
        assert warnings.filters == before
    assert threading.active_count() < 20


SCRIPT_ENDS_EARLY = textwrap.dedent("""
    import time
    from nblaunch import notebook_launcher
    def slow():
        print("started", flush=True)
        time.sleep(600)
    launch = notebook_launcher(slow, num_processes=2, display="none", block=False)
    while "started" not in launch.logs(0) + launch.logs(1):
        time.sleep(0.01)
    print("LOGS", launch.log_dir, flush=True)
""")


def test_a_script_that_ends_during_a_background_launch_stops_it_and_says_so(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))  # its own registry and logs
    done = subprocess.run([sys.executable, "-c", SCRIPT_ENDS_EARLY], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "still runs: stopping it" in done.stderr and "launch.result()" in done.stderr
    log_dir = done.stdout.split("LOGS ", 1)[1].strip()
    for rank in (0, 1):
        log = open(os.path.join(log_dir, f"rank{rank}.log")).read()
        assert "started" in log and "stack when the launch stopped" in log
    registry = os.path.join(str(tmp_path), f"nblaunch-{os.getuid()}", "launches")
    assert [name for name in os.listdir(registry) if name.endswith(".json")] == []
