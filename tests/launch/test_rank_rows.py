"""Each rank's row says what it computes on: its Accelerator's device and mixed precision, and
its GPU's utilisation and memory (NVML, asked by the launcher).

This machine has no GPU: a stand-in NVIDIA driver library (``tests/stand_ins.py``, built here)
reports one GPU, 87% busy, 3 of 16 GiB used, and lists as its processes the pids written to a
file; everything above it is real (the plan, the sampler, the supervisor, the ranks, the view).
"""

from __future__ import annotations

import re

from nblaunch import notebook_launcher
from nblaunch.display.render import ranks_html
from nblaunch.display.view_state import LaunchView
from nblaunch.events import GpuUsage, RankDevice, RankStarted
from stand_ins import FAKE_NVML, run_child, stand_in_library


def with_an_accelerator():
    from nblaunch import Accelerator

    Accelerator(mixed_precision="bf16")
    return "made"


def test_a_ranks_accelerator_says_its_device_and_precision(recorder):
    assert notebook_launcher(with_an_accelerator, num_processes=2, display=recorder) == ["made", "made"]
    assert sorted(recorder.of(RankDevice), key=lambda e: e.rank) == [RankDevice(0, "cpu", "bf16"),
                                                                     RankDevice(1, "cpu", "bf16")]


ONE_BUSY_GPU = '''
import json, os
from nblaunch import notebook_launcher
from nblaunch.events import GpuUsage

flag = os.path.abspath("sampled")

class Seen:
    """Lets the rank finish once a sample named its process (the rank waits for that)."""
    usages = []
    def on_event(self, event):
        if isinstance(event, GpuUsage):
            self.usages.append(event)
            if event.own_memory:
                open(flag, "w").close()
    def close(self):
        pass

def rank(pids_file, flag):
    import os, time
    with open(pids_file, "w") as f:
        f.write(f"{os.getpid()}\\n")
    deadline = time.monotonic() + 120  # a backstop: the flag comes within one sampling period
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()

seen = Seen()
[pid] = notebook_launcher(rank, args=(os.environ["FAKE_NVML_PIDS_FILE"], flag), display=seen)
own = [u for u in seen.usages if u.own_memory]
print("RESULT " + json.dumps({"pid": pid, "own": [own[0].rank, own[0].gpu, own[0].utilization, own[0].memory_used,
       own[0].memory_total, own[0].line], "others": [[u.memory_used, u.own_memory] for u in seen.usages if not u.own_memory]}))
'''


def test_a_gpu_ranks_row_gets_its_gpus_utilisation_and_its_own_memory(tmp_path):
    env = {**stand_in_library(tmp_path, "libnvidia-ml.so.1", FAKE_NVML), "FAKE_NVML_GPUS": "1",
           "FAKE_NVML_PIDS_FILE": str(tmp_path / "pids")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    found, _ = run_child(ONE_BUSY_GPU, tmp_path, env)
    # num_processes left out on a one-GPU machine: one rank, on GPU 0 (it runs on the CPU here).
    assert found["own"] == [0, 0, 87, 1 << 30, 16 << 30, "GPU 0 · 87% · 1.0/16 GB"]
    # Before the rank's process was listed, the GPU of its position, with the GPU's memory.
    assert all(other == [3 << 30, False] for other in found["others"])


def test_the_row_shows_device_precision_and_gpu():
    view = LaunchView()
    view.apply(RankStarted(rank=0, pid=10), now=0.0)
    view.apply(RankStarted(rank=1, pid=11), now=0.0)
    view.apply(RankDevice(0, "cuda:0", "bf16"), now=1.0)
    view.apply(GpuUsage(0, 0, 87, 12 << 30, 80 << 30, own_memory=True), now=1.0)
    html = ranks_html(view, now=2.0)
    assert re.search(r"<th[^>]*>device</th>", html)
    rows = re.findall(r'<tr class="nbl-rank".*?</tr>', html)
    assert "cuda:0 · bf16" in rows[0] and "GPU 0 · 87% · 12.0/80 GB" in rows[0]
    assert 'class="nbl-device"' in rows[1] and "GPU" not in rows[1]  # nothing known of rank 1 yet


def test_without_devices_said_there_is_no_device_column():
    view = LaunchView()
    view.apply(RankStarted(rank=0, pid=10), now=0.0)
    assert "device</th>" not in ranks_html(view, now=1.0)
