"""Ray from a real Jupyter kernel: ``%%distributed --ray`` cells on warm ranks of two nodes, then
a launch during which the kernel restarts, which leaves nothing running on any node (rank
processes, agents, placement groups)."""

from __future__ import annotations

import time

import nbformat
import psutil
import pytest
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

from nbcells import everything_shown

pytestmark = pytest.mark.ray


def cells(address: str, pid_dir: str) -> list[str]:
    return [
        f"import ray\nray.init(address={address!r}, log_to_driver=False)\nfrom nblaunch import notebook_launcher\n"
        "%load_ext nblaunch",
        "%%distributed -n 2 --ray --nodes 2\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "mine = dist.get_rank() * 10",
        "%%distributed --ray --nodes 2\nimport torch\nt = torch.tensor([float(mine)])\ndist.all_reduce(t)\n(mine, t.item())",
        "%distributed stop",
        "def train(pid_dir):\n"
        "    import os, time, torch.distributed as dist\n"
        "    dist.init_process_group('gloo')\n"
        "    open(os.path.join(pid_dir, str(os.getpid())), 'w').close()\n"
        "    while True:\n"
        "        dist.barrier()\n"
        "        time.sleep(0.1)",
        f"launch = notebook_launcher(train, args=({pid_dir!r},), num_processes=2, num_nodes=2, cluster='ray',\n"
        "                            display='text', block=False)\nlaunch.status",
    ]


def test_a_kernel_restart_during_a_ray_launch_leaves_nothing_running(ray_cluster, ray_state, tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in cells(ray_cluster.address, str(tmp_path))])
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        assert "[(0, 60.0), (10, 60.0), (20, 60.0), (30, 60.0)]" in everything_shown(nb.cells[2])
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 4:  # every rank is up and in the process group
            assert time.monotonic() < deadline, f"the ranks did not start: {everything_shown(nb.cells[-1])}"
            time.sleep(0.05)
        ranks = [psutil.Process(int(p.name)) for p in tmp_path.iterdir()]
        assert len(ray_state.actors()) == 2 and len(ray_state.placement_groups()) == 1
        run_sync(client.km.restart_kernel)(now=True)
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert alive == [], f"ranks outlived the kernel: {alive}"
    deadline = time.monotonic() + 30  # Ray notices a dead driver by itself; this is a backstop
    while (ray_state.actors() or ray_state.placement_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_state.actors() == [] and ray_state.placement_groups() == []
