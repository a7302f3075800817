"""How the launcher decides: start method, devices, threads, and the variables each rank gets."""

from __future__ import annotations

import pytest

from nblaunch import LaunchConfigError
from nblaunch.launch.planning import devices
from nblaunch.launch.planning.plan import plan_here
from nblaunch.launch.planning.request import LaunchRequest


def noop():
    return None


def plan(**overrides):
    arguments = dict(
        function=noop, args=(), num_processes=2, mixed_precision="no", use_port=None, master_addr="127.0.0.1",
        node_rank=0, num_nodes=1, start_method=None, timeout=None, display="none", cpu=False,
    )
    arguments.update(overrides)
    return plan_here(LaunchRequest(**arguments))


def test_fork_is_chosen_on_a_cpu_machine_and_the_reason_is_given():
    chosen = plan()
    assert (chosen.start_method, chosen.device_kind) == ("fork", "cpu")
    assert "each process begins as a copy of this one" in chosen.start_reason


def test_cuda_already_initialised_here_means_the_launch_server_and_fork_is_refused(monkeypatch):
    # This machine has no GPU: stand in for the one probe that would say CUDA is initialised.
    monkeypatch.setattr(devices, "cuda_initialized", lambda: True)
    chosen = plan()
    assert chosen.start_method == "server" and "CUDA was initialised in this process" in chosen.start_reason
    with pytest.raises(LaunchConfigError, match="start_method='fork' would break CUDA"):
        plan(start_method="fork")
    assert plan(cpu=True).start_method == "fork"  # debug_launcher hides the GPUs


def test_gpus_are_counted_without_initialising_cuda():
    import torch

    count = devices.cuda_device_count()
    assert count == 0  # no NVIDIA driver on the CI machine; NVML simply is not there
    assert not torch.cuda.is_initialized()


def test_cuda_visible_devices_is_read_as_the_cuda_runtime_reads_it(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible_gpus(3) == [0, 1, 2]
    for value, seen in (("0,1,-1,2", [0, 1]), ("", []), ("3,1", [3, 1]), ("1,9,2", [1]),
                        ("GPU-5e1d,2", [None, 2]), (" 2 , 0", [2, 0]), ("0,1,2,3,4,5,6,7,0", [0, 1, 2, 3, 4, 5, 6, 7])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert devices.visible_gpus(8) == seen, value  # up to the first invalid entry; UUIDs not resolved


def test_multi_node_ranks_are_offset_by_the_node():
    chosen = plan(num_nodes=2, node_rank=1, use_port=29555, master_addr="10.1.2.3")
    env = chosen.rank_environ(1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["NODE_RANK"]) == ("3", "1", "4", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.1.2.3", "29555")
