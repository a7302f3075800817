"""Log folders: old ones are pruned, a running launch's never is."""

from __future__ import annotations

import os
import time

from nblaunch import notebook_launcher
from nblaunch.launch import logfiles


def waits_for(flag_path):
    while not os.path.exists(flag_path):
        time.sleep(0.01)
    return "done"


def test_pruning_never_removes_a_running_launchs_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a log root of its own
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    flag = tmp_path / "finish"
    launch = notebook_launcher(waits_for, args=(str(flag),), num_processes=2, display="none", block=False)
    try:
        deadline = time.monotonic() + 60
        while launch.status != "running":  # running: its record, naming the folder, is saved
            assert time.monotonic() < deadline
            time.sleep(0.01)
        root = os.path.dirname(launch.log_dir)
        monkeypatch.setattr(logfiles, "_YOUNG_S", -3600)  # every folder counts as old: only records protect
        monkeypatch.setattr(logfiles, "_PRUNE_EVERY_S", 0.0)  # a kernel prunes at most once a minute
        for _ in range(60):  # launches of other kernels, finished
            logfiles.new_log_dir()
        assert os.path.isdir(launch.log_dir)
        assert len(os.listdir(root)) <= logfiles._PRUNE_AT, "old folders were not pruned"
        assert launch.logs(0) == ""
    finally:
        flag.touch()
    assert launch.result(timeout=60) == ["done", "done"]
