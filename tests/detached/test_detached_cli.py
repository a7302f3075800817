"""``nblaunch ls``, ``nblaunch attach`` and ``nblaunch stop`` on a real detached launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from nblaunch import LaunchCancelledError, notebook_launcher


def _waits_for(go: str) -> int:
    import os
    import time

    rank = int(os.environ["RANK"])
    print(f"waiting {rank}", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
    return rank


def _nblaunch(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nblaunch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    from processes import stop_every_launch_in

    monkeypatch.setenv("NBLAUNCH_STATE_DIR", str(tmp_path / "state"))
    yield str(tmp_path / "state")
    stop_every_launch_in(str(tmp_path / "state"))


def test_list_watch_detach_and_stop_from_a_terminal(tmp_path, state_dir):
    launch = notebook_launcher(_waits_for, args=(str(tmp_path / "never"),), num_processes=2, detach=True,
                               display="none")
    listed = _nblaunch("ls").communicate(timeout=60)[0]
    assert launch.launch_id in listed and "_waits_for on 2 ranks" in listed, listed

    watcher = _nblaunch("attach", launch.launch_id[:5])
    deadline = time.monotonic() + 60  # a backstop: the replay comes within a second
    seen = ""
    while seen.count("waiting") < 2:
        assert time.monotonic() < deadline, seen
        seen += watcher.stdout.readline()
    watcher.send_signal(signal.SIGINT)  # Ctrl-C: stop watching
    out, err = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, err
    assert f"stopped watching; launch {launch.launch_id} goes on (running)" in err
    assert launch.status == "running"

    stopper = _nblaunch("stop", launch.launch_id)
    assert stopper.communicate(timeout=60)[0] == f"nblaunch: stopping launch {launch.launch_id}\n"
    assert stopper.returncode == 0
    with pytest.raises(LaunchCancelledError):
        launch.result(timeout=60)
    again = _nblaunch("stop", launch.launch_id)
    assert "has already ended (cancelled)" in again.communicate(timeout=60)[1] and again.returncode == 1
    missing = _nblaunch("attach", "zzz")
    assert "no detached launch of this user has an id starting with 'zzz'" in missing.communicate(timeout=60)[1]
    assert missing.returncode == 1
    assert os.path.exists(os.path.join(tmp_path, "state", "detached", launch.launch_id, "collected"))
