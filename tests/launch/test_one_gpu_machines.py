"""What a one-GPU machine (Colab's and Kaggle's free tiers) and a laptop without a GPU get.

This machine has no GPU: the tests stand in for the one probe that counts them (NVML), so the
launcher decides as it would on a one-GPU machine; the ranks then really run, on the CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from nblaunch import LaunchConfigError, RankFailedError, WarmRanks, notebook_launcher
from nblaunch.events import LaunchStarted, RankStarted
from nblaunch.contract.precision import fast_precision
from nblaunch.launch.planning import devices, plan
from nblaunch.launch.planning.plan import plan_here
from nblaunch.launch.planning.request import LaunchRequest


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)


def where_am_i():
    import torch

    dist.init_process_group("gloo")
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available(), dist.get_world_size(), os.getpid()


def test_more_ranks_than_gpus_is_refused_with_cpu_true_offered(one_gpu):
    with pytest.raises(LaunchConfigError, match=r"1 GPU is visible .* or cpu=True to run 2 ranks on the CPU"):
        notebook_launcher(where_am_i, num_processes=2, display="none")


def test_cpu_true_runs_as_many_cpu_ranks_as_asked_with_the_gpus_hidden(one_gpu):
    results = notebook_launcher(where_am_i, num_processes=3, cpu=True, display="none")
    assert [r[:3] for r in results] == [("", False, 3)] * 3
    assert os.getpid() not in {r[3] for r in results}


def test_warm_ranks_take_cpu_true_too(one_gpu):
    with WarmRanks(num_processes=2, cpu=True, display="none") as ranks:
        assert ranks.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"]) == ["", ""]


def test_num_processes_left_out_is_two_cpu_ranks_without_a_gpu(recorder):
    assert len(notebook_launcher(where_am_i, display=recorder)) == 2
    assert recorder.of(LaunchStarted)[0].num_processes == 2


def fails():
    raise ValueError("broken in the only rank")


def test_one_rank_is_a_launch_like_any_other(recorder):
    [(_, _, world, pid)] = notebook_launcher(where_am_i, num_processes=1, display=recorder)
    assert world == 1 and pid != os.getpid() and recorder.of(RankStarted)[0].pid == pid
    assert not dist.is_initialized()  # the rank's group was its own
    with pytest.raises(RankFailedError, match="broken in the only rank") as failed:
        notebook_launcher(fails, num_processes=1, display="none")
    assert failed.value.root_cause.rank == 0


def test_fp8_is_refused_before_anything_starts_where_it_cannot_run(one_gpu, monkeypatch):
    monkeypatch.setattr(devices, "cuda_capability", lambda: (7, 5))  # a T4: no fp8 units
    before = psutil.Process().children(recursive=True)
    with pytest.raises(LaunchConfigError, match=r"fp8 units \(compute capability 8.9 and later\); this machine's are "
                                                r"7.5: use 'bf16' .* or cpu=True"):
        notebook_launcher(where_am_i, num_processes=1, mixed_precision="fp8")
    real_find_spec = plan.importlib.util.find_spec
    monkeypatch.setattr(plan.importlib.util, "find_spec",
                        lambda name, *rest: None if name == "torchao" else real_find_spec(name, *rest))
    with pytest.raises(LaunchConfigError, match=r'not installed: pip install "nblaunch\[fp8\]"'):
        notebook_launcher(where_am_i, num_processes=1, mixed_precision="fp8", cpu=True)
    assert psutil.Process().children(recursive=True) == before  # refused before any process


@pytest.mark.parametrize("option", [{"mixed_precision": "bf16"}, {"start_method": "spawn"}, {"use_port": 29555},
                                    {"cpu": True}, {"max_restarts": 1}])
def test_launch_options_are_refused_with_warm_ranks_not_dropped(option):
    with WarmRanks(num_processes=2, display="none") as ranks:
        name = next(iter(option))
        with pytest.raises(LaunchConfigError, match=f"{name} cannot apply with ranks=: .* Pass it to WarmRanks"):
            notebook_launcher(where_am_i, ranks=ranks, **option)


def rank_precision():
    return os.environ["NBLAUNCH_MIXED_PRECISION"], os.environ["ACCELERATE_MIXED_PRECISION"]


@pytest.mark.parametrize("capability, fast", [((7, 5), "fp16"), ((7, 0), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_auto_is_what_the_gpu_computes_fast_and_a_word_asked_for_is_kept(one_gpu, monkeypatch, capability, fast):
    monkeypatch.setattr(devices, "cuda_capability", lambda: capability)
    assert plan_here(LaunchRequest(where_am_i, mixed_precision="auto")).precision == fast
    assert plan_here(LaunchRequest(where_am_i, mixed_precision="bf16")).precision == "bf16"  # asked for: kept
    on_the_cpu = plan_here(LaunchRequest(where_am_i, num_processes=2, mixed_precision="auto", cpu=True))
    assert on_the_cpu.precision == fast_precision("cpu")


def test_the_quickstart_on_a_t4_trains_in_fp16(one_gpu, monkeypatch):
    """Colab's free GPU: the quickstart's own precision cell, planned for a T4 (7.5), reaches
    every rank (and Accelerate's variable) as fp16."""
    monkeypatch.setattr(devices, "cuda_capability", lambda: (7, 5))
    notebook = json.loads((Path(__file__).parents[2] / "notebooks" / "01_quickstart.ipynb").read_text())
    (source,) = ["".join(c["source"]) for c in notebook["cells"] if "mixed_precision = " in "".join(c["source"])]
    cell = {"num_processes": 1}
    exec(source, cell)
    assert notebook_launcher(rank_precision, num_processes=1, mixed_precision=cell["mixed_precision"],
                             display="none") == [("fp16", "fp16")]
