"""Launches through torch_xla's xmp.spawn on the CPU (PJRT_DEVICE=CPU).

XLA's CPU client runs collectives with one device; with two they abort after ~15 s (an XLA CPU
limitation), so collectives are tested with one device and two devices without collectives.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from nblaunch import LaunchConfigError, RankFailedError, notebook_launcher
from nblaunch.events import LaunchStarted, RankFinished, RankState


def where_am_i(tag):
    import torch_xla
    import torch_xla.runtime as xr

    print(f"{tag} from ordinal {xr.global_ordinal()} on {torch_xla.device()}")
    return {"ordinal": xr.global_ordinal(), "local": xr.local_ordinal(), "world": xr.world_size(), "pid": os.getpid()}


def test_one_device_returns_its_result_and_its_log(recorder):
    [result] = notebook_launcher(where_am_i, args=("hello",), start_method="xla", display=recorder)
    assert (result["ordinal"], result["world"]) == (0, 1)
    assert recorder.lines(0) == ["hello from ordinal 0 on xla:0"]
    started = recorder.of(LaunchStarted)[0]
    assert started.start_method == "xla" and "xmp.spawn" in started.start_reason


def test_two_devices_are_two_ranks_with_their_own_ordinals_and_logs(recorder, monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = notebook_launcher(where_am_i, args=("hi",), num_processes=2, start_method="xla", display=recorder)
    assert [(r["ordinal"], r["local"], r["world"]) for r in results] == [(0, 0, 2), (1, 1, 2)]
    assert results[0]["pid"] == results[1]["pid"]  # one process, one thread per device
    assert recorder.lines(0) == ["hi from ordinal 0 on xla:0"]
    assert recorder.lines(1) == ["hi from ordinal 1 on xla:1"]
    assert [e.state for e in recorder.of(RankFinished)] == [RankState.DONE, RankState.DONE]


def all_reduce():
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    total = xm.all_reduce(xm.REDUCE_SUM, torch.full((3,), 5.0, device=torch_xla.device()))
    torch_xla.sync()
    return total.cpu().tolist()


def test_a_collective_runs():
    assert notebook_launcher(all_reduce, start_method="xla", display="none") == [[5.0, 5.0, 5.0]]


def fails():
    raise ValueError("xla rank failed")


def test_an_error_names_the_rank_and_chains_the_original():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(fails, start_method="xla", display="none")
    assert info.value.root_cause.rank == 0
    assert type(info.value.__cause__) is ValueError
    assert 'raise ValueError("xla rank failed")' in info.value.root_cause.traceback


def closure_of(scale):
    def train():
        import torch
        import torch_xla

        device = torch_xla.device()
        torch.manual_seed(0)
        x = torch.randn(64, 4)
        y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5]) * scale
        model = torch.nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(20):
            loss = ((model(x.to(device)).squeeze(-1) - y.to(device)) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses.append(loss.item())
        return losses

    return train


def test_a_closure_trains_on_the_xla_device_and_its_loss_falls():
    # torch_xla pickles the function for its process pool, even with fork: a closure must travel.
    [losses] = notebook_launcher(closure_of(2.0), start_method="xla", display="none")
    assert losses[-1] < losses[0] / 100


def test_a_runtime_already_initialised_here_is_refused_before_anything_starts():
    script = textwrap.dedent(
        """
        import torch, torch_xla
        torch.ones(1, device=torch_xla.device())  # the runtime starts in this process
        from nblaunch import notebook_launcher, LaunchConfigError
        try:
            notebook_launcher(lambda: 1, start_method="xla", display="none")
        except LaunchConfigError as error:
            print("refused:", error)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "refused: an XLA device was used in this kernel before the launch: restart the runtime" in done.stdout, done.stderr


def test_num_processes_must_match_the_devices():
    with pytest.raises(LaunchConfigError, match="CPU_NUM_DEVICES"):
        os.environ["CPU_NUM_DEVICES"] = "1"
        try:
            notebook_launcher(fails, num_processes=2, start_method="xla")
        finally:
            del os.environ["CPU_NUM_DEVICES"]
