"""notebook_launcher(..., cluster="ray", detach=True) on a real two-node Ray cluster: a driver
starts the launch and exits; another driver connected to the cluster lists it, watches it,
collects it or cancels it; nothing of it is left in Ray afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from nblaunch import LaunchCancelledError, attach, launches
from nblaunch.events import Output

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("nothing_left_in_ray")]

DRIVER = """
import os, sys, ray
ray.init(address=os.environ["RAY_ADDRESS"], namespace="another-driver", log_to_driver=False)
from nblaunch import notebook_launcher

def train(go):
    import os, time
    rank = int(os.environ["RANK"])
    print(f"ready {rank}", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
    return rank * 10

launch = notebook_launcher(train, args=(sys.argv[1],), num_processes=1, num_nodes=2, cluster="ray", detach=True,
                           display="none")
print("id", launch.launch_id, flush=True)
"""


def _start_from_a_driver_that_exits(ray_cluster, go: str) -> str:
    done = subprocess.run([sys.executable, "-c", DRIVER, go], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, NBLAUNCH_STATE_DIR=os.path.dirname(go),
                                   RAY_ADDRESS=ray_cluster.address))
    assert done.returncode == 0, done.stdout + done.stderr
    return re.search(r"^id (\w+)$", done.stdout, re.M)[1]


def _keepers_gone(ray_state) -> None:
    deadline = time.monotonic() + 60  # a backstop: a keeper leaves within a second of being collected
    while any(a.class_name == "LaunchKeeper" for a in ray_state.actors()):
        assert time.monotonic() < deadline, ray_state.actors()
        time.sleep(0.1)


def test_a_launch_outlives_its_driver_and_another_driver_collects_it(ray_cluster, ray_state, recorder, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("NBLAUNCH_STATE_DIR", str(tmp_path))
    go = str(tmp_path / "go")
    launch_id = _start_from_a_driver_that_exits(ray_cluster, go)
    listed = repr(launches())
    assert re.search(rf"{launch_id}\s+(starting|running) .* train on 2 ranks", listed), listed
    launch = attach(launch_id[:5], display=recorder)
    deadline = time.monotonic() + 60
    while sum(1 for e in recorder.of(Output) if any(line.startswith("ready") for line in e.lines)) < 2:
        assert time.monotonic() < deadline, recorder.events
        time.sleep(0.05)
    open(go, "w").close()
    assert launch.result(timeout=120) == [0, 10]
    assert launch.status == "done"
    _keepers_gone(ray_state)


def test_cancel_from_another_driver_stops_every_node(ray_cluster, ray_state, tmp_path, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_STATE_DIR", str(tmp_path))
    launch_id = _start_from_a_driver_that_exits(ray_cluster, str(tmp_path / "never"))
    launch = attach(launch_id, display="none")
    deadline = time.monotonic() + 60
    while launch.status != "running":
        assert time.monotonic() < deadline, launch.status
        time.sleep(0.05)
    assert launch.cancel()
    with pytest.raises(LaunchCancelledError):
        launch.result(timeout=120)
    assert launch.status == "cancelled" and not launch.cancel()
    _keepers_gone(ray_state)
