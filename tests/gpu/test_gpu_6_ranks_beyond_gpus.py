"""Issue 31, item 6: more ranks than GPUs on a one-GPU machine.

What works: CPU ranks with ``cpu=True`` (gloo; the GPU hidden, so no rank touches CUDA), for
``notebook_launcher`` and warm ranks. What is refused, before anything starts, with what to do:
two GPU ranks on the one GPU. Why refused: NCCL will not put two ranks of a group on one device,
which the last test checks on this machine with raw torch (so the refusal's reason stays true).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from gpu_common import DRIVER_PROBE_SOURCE, GPU_MARKS
from nblaunch import LaunchConfigError, WarmRanks, notebook_launcher

pytestmark = GPU_MARKS

REFUSAL = r"num_processes=2, but 1 GPU is visible .* or cpu=True to run 2 ranks on the CPU"


def cpu_rank() -> dict:
    """What a cpu=True rank sees: the GPU hidden, gloo, and CUDA never initialised here."""
    import torch
    import torch.distributed as dist

    from nblaunch import Accelerator

    namespace: dict = {}
    exec(DRIVER_PROBE_SOURCE, namespace)
    accelerator = Accelerator()
    t = torch.ones(2) * (accelerator.process_index + 1)
    dist.all_reduce(t)
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "available": torch.cuda.is_available(),
        "backend": dist.get_backend(), "device": str(accelerator.device), "sum": t.tolist(),
        "torch_initialised": torch.cuda.is_initialized(), "driver_initialised": namespace["cuda_driver_initialised"](),
    }


def test_two_gpu_ranks_on_one_gpu_are_refused_before_anything_starts(record_property):
    started = time.perf_counter()
    with pytest.raises(LaunchConfigError, match=REFUSAL):
        notebook_launcher(cpu_rank, num_processes=2, display="none")
    record_property("seconds_to_refuse", time.perf_counter() - started)
    with pytest.raises(LaunchConfigError, match=REFUSAL):
        WarmRanks(num_processes=2, display="none")


def test_cpu_ranks_on_a_gpu_machine_use_gloo_and_never_touch_cuda():
    results = notebook_launcher(cpu_rank, num_processes=2, cpu=True, display="none", timeout=120)
    for result in results:
        assert result["visible"] == "" and result["available"] is False and result["backend"] == "gloo"
        assert result["device"] == "cpu" and result["sum"] == [3.0, 3.0]
        assert result["torch_initialised"] is False and result["driver_initialised"] is False, result


def test_warm_cpu_ranks_on_a_gpu_machine_form_a_gloo_group():
    with WarmRanks(num_processes=2, cpu=True, display="none") as ranks:
        results = ranks.run(cpu_rank, timeout=120)
    assert [r["backend"] for r in results] == ["gloo", "gloo"] and results[0]["sum"] == [3.0, 3.0]
    assert not any(r["driver_initialised"] for r in results)


TWO_NCCL_RANKS_ON_ONE_GPU = '''
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(index, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE="2")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print("ALL_REDUCE", t.item(), flush=True)

if __name__ == "__main__":
    mp.start_processes(rank, args=(int(sys.argv[1]),), nprocs=2, start_method="spawn")
'''


def test_nccl_itself_refuses_two_ranks_on_one_gpu(tmp_path, record_property):
    """The fact the refusal rests on, on this machine's torch and NCCL (raw torch, no nblaunch)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_NCCL_RANKS_ON_ONE_GPU)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(script), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        said, _ = proc.communicate(timeout=90)
        outcome = "worked" if proc.returncode == 0 else "refused"
    except subprocess.TimeoutExpired:
        said, outcome = "no answer in 90 s", "hung"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the script's ranks too, whatever happened
        except ProcessLookupError:
            pass
        proc.wait()
    lines = said.strip().splitlines() or [""]
    detail = next((l for l in lines if "Duplicate GPU" in l or "invalid usage" in l.lower()), lines[-1])
    record_property("two_nccl_ranks_on_one_gpu", f"{outcome}: {detail[:300]}")
    assert outcome == "refused", f"NCCL with two ranks on one GPU {outcome}: {detail}"
