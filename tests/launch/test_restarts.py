"""notebook_launcher(max_restarts=N): after a failure every rank is stopped and all start again,
each restart shown, up to N times; a training function resumes from its own checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

from nblaunch import LaunchConfigError, RankFailedError, notebook_launcher
from nblaunch.events import LaunchFinished, LaunchRestarting, RankStarted
from nblaunch.launch.errors import LaunchTimeoutError


def _fails_until(start_that_works: int, seen_dir: str, failing_rank: str = "1") -> int:
    start = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    open(os.path.join(seen_dir, f"rank{os.environ['RANK']}-start{start}-port{os.environ['MASTER_PORT']}"), "w").close()
    if start < start_that_works and os.environ["RANK"] == failing_rank:
        raise ValueError(f"failure in start {start}")
    return start


def test_every_rank_starts_again_until_it_works(recorder, tmp_path):
    results = notebook_launcher(_fails_until, args=(2, str(tmp_path)), num_processes=2, max_restarts=3,
                                display=recorder)
    assert results == [2, 2]
    restarts = recorder.of(LaunchRestarting)
    assert [(r.restart, r.max_restarts, r.failed_rank) for r in restarts] == [(1, 3, 1), (2, 3, 1)]
    assert restarts[0].reason == "ValueError: failure in start 0"
    assert len(recorder.of(RankStarted)) == 6  # 2 ranks x 3 starts
    seen = sorted(os.listdir(tmp_path))
    assert [name.split("-port")[0] for name in seen] == [f"rank{r}-start{s}" for r in (0, 1) for s in range(3)]
    ports = {name.split("-port")[1] for name in seen}
    assert len(ports) == 3  # a fresh rendezvous for every start (no port was pinned)
    [finished] = recorder.of(LaunchFinished)
    assert finished.summary.endswith("after 2 restarts")


def test_the_last_failure_is_raised_when_no_restart_is_left(recorder, tmp_path):
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(_fails_until, args=(5, str(tmp_path)), num_processes=2, max_restarts=1, display=recorder)
    assert "failure in start 1" in caught.value.root_cause.reason
    assert len(recorder.of(LaunchRestarting)) == 1
    [finished] = recorder.of(LaunchFinished)
    assert "restarted 1 of 1 times" in finished.summary


def test_restarts_are_written_in_every_rank_log(tmp_path):
    launch = notebook_launcher(_fails_until, args=(1, str(tmp_path)), num_processes=2, max_restarts=1,
                               display="none", block=False)
    assert launch.result(timeout=120) == [1, 1]
    for rank in (0, 1):
        assert "every rank starts again: restart 1 of 1" in launch.logs(rank)


def test_one_process_with_restarts_starts_again(tmp_path):
    assert notebook_launcher(_fails_until, args=(1, str(tmp_path), "0"), num_processes=1, max_restarts=1,
                             display="none") == [1]


def _sleeps_then_fails(_):
    import time

    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
        raise ValueError("first start fails at once")
    time.sleep(60)


def test_timeout_covers_every_start_together():
    with pytest.raises(LaunchTimeoutError) as caught:
        notebook_launcher(_sleeps_then_fails, args=(0,), num_processes=2, max_restarts=2, timeout=3,
                          display="none")
    assert caught.value.timeout == 3


def _train(checkpoint: str, crash_at_epoch: int | None):
    """Three epochs; saves its state after every epoch; resumes from it when restarted."""
    from torch.utils.data import DataLoader, TensorDataset

    from nblaunch import Accelerator
    from nblaunch.utils import set_seed

    set_seed(0)
    accelerator = Accelerator()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, x @ torch.randn(4, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first_epoch = 0
    if os.path.exists(os.path.join(checkpoint, "optimizer.bin")):
        accelerator.load_state(checkpoint)
        first_epoch = loader.epoch
    for epoch in range(first_epoch, 3):
        for step, (inputs, targets) in enumerate(loader):
            if (epoch == crash_at_epoch and step == 3 and accelerator.process_index == 1
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                raise RuntimeError("a bad day: rank 1 dies mid-epoch")
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.save_state(checkpoint)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return weights, first_epoch


def test_a_restarted_training_resumes_from_its_checkpoint_and_ends_as_if_uninterrupted(recorder, tmp_path):
    uninterrupted = notebook_launcher(_train, args=(str(tmp_path / "a"), None), num_processes=2, display="none")
    restarted = notebook_launcher(_train, args=(str(tmp_path / "b"), 1), num_processes=2, max_restarts=1,
                                  display=recorder)
    assert [r.reason for r in recorder.of(LaunchRestarting)] == ["RuntimeError: a bad day: rank 1 dies mid-epoch"]
    for (ours, resumed_at), (reference, _) in zip(restarted, uninterrupted):
        assert resumed_at == 1  # the restart went on from the checkpoint of epoch 0, not from scratch
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


@pytest.mark.parametrize("arguments, message", [
    ({"max_restarts": -1}, "max_restarts must be an int >= 0"),
    ({"max_restarts": 1.5}, "max_restarts must be an int >= 0"),
    ({"max_restarts": True}, "max_restarts must be an int >= 0"),
    ({"monitor_interval": 0}, "monitor_interval must be a positive number"),
    ({"rdzv_backend": "etcd"}, "rdzv_backend must be 'static' or 'c10d'"),
    ({"max_restarts": 1, "num_nodes": 2, "use_port": 29555}, "max_restarts works on one machine only"),
])
def test_bad_restart_arguments_are_refused_before_anything_starts(arguments, message):
    with pytest.raises(LaunchConfigError, match=message):
        notebook_launcher(_fails_until, args=(0, "."), num_processes=2, display="none", **arguments)


def test_accelerates_elastic_arguments_are_accepted(tmp_path):
    assert notebook_launcher(_fails_until, args=(0, str(tmp_path)), num_processes=2, max_restarts=1,
                             monitor_interval=0.5, rdzv_backend="c10d", display="none") == [0, 0]
