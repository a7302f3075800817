"""Each rank's training steps split into their parts, the straggler named, what the ranks buy
(``nblaunch.worker.step_clock`` in the ranks, ``nblaunch.step_split`` here): real ranks, gloo."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from nblaunch import Accelerator, notebook_launcher
from nblaunch.events import Stalled, StepTimes


class Items(Dataset):
    """``length`` random samples; each takes ``delay`` seconds to make on rank ``slow_rank``."""

    def __init__(self, length: int = 320, delay: float = 0.0, slow_rank: int = 1) -> None:
        self.length, self.delay, self.slow_rank = length, delay, slow_rank

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if self.delay and int(os.environ["RANK"]) == self.slow_rank:
            time.sleep(self.delay)
        return torch.randn(16), torch.randn(1)


class Spins(torch.nn.Module):
    """Its forward busies the CPU for ``seconds`` on rank 1: a rank slow in computing."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        if self.seconds and int(os.environ["RANK"]) == 1:
            until = time.perf_counter() + self.seconds
            while time.perf_counter() < until:
                pass
        return x


class Embedded(torch.nn.Module):
    """A big embedding table and a small head: a sample's step computes little, and the table's
    whole gradient (dense) is all-reduced: a model bound by communication, however busy the CPU."""

    def __init__(self, rows: int, dim: int = 64) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(rows, dim)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x):
        index = (x[:, 0].abs() * 1000).long() % self.table.num_embeddings
        return self.head(self.table(index))


def _train(delay: float = 0.0, spin: float = 0.0, width: int = 64, batch_size: int = 8, accumulate: int = 1,
           length: int = 640, square_layers: int = 0, embedding_rows: int = 0):
    accelerator = Accelerator(gradient_accumulation_steps=accumulate)
    torch.manual_seed(0)
    squares = [layer for _ in range(square_layers) for layer in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = torch.nn.Sequential(Spins(spin), torch.nn.Linear(16, width), torch.nn.ReLU(), *squares,
                                torch.nn.Linear(width, 1))
    if embedding_rows:
        model = Embedded(embedding_rows)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Items(length, delay), batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.process_index


def _steps(*args, **kwargs):
    launch = notebook_launcher(_train, args=args, num_processes=2, display="none", block=False, **kwargs)
    assert launch.result() == [0, 1]
    return launch.steps


def test_a_rank_starved_of_data_is_named_and_the_others_wait_for_it_in_the_sync():
    steps = _steps(0.003)  # 3 ms an item, 8 a batch: rank 1 waits ~24 ms a step for data
    assert steps.straggler == 1 and steps.cause == "data", str(steps)
    assert steps[1].data >= 0.015
    assert steps[0].communication >= 0.7 * steps[1].data, str(steps)  # rank 0 waits for it in the gradient sync
    assert steps[0].data < 0.2 * steps[1].data
    assert steps[1].arrival_lag >= 0.7 * steps[1].data
    assert steps[0].count == steps[1].count == 40 and steps[0].samples == 8
    assert "rank 1 holds the others up: it waits" in str(steps) and "for data" in str(steps)
    assert "num_workers" in steps.advice


def test_a_rank_slow_in_its_forward_is_named_by_when_it_arrives_at_the_sync():
    steps = _steps(0.0, 0.02)
    assert steps.straggler == 1 and steps.cause == "compute", str(steps)
    assert steps[1].compute - steps[0].compute >= 0.015  # its forward, though the backward's wall times match
    assert steps[1].arrival_lag >= 0.015
    assert steps[0].communication >= 0.015  # rank 0 waits for it
    assert "its forward and backward take" in steps.finding


def test_balanced_ranks_have_no_straggler():
    steps = _steps()
    assert steps.straggler is None, str(steps)
    assert len(steps) == 2 and all(r.count == 40 for r in steps)
    for rank in steps:
        parts = sum(rank.parts().values())
        assert parts == pytest.approx(rank.step, rel=0.25), rank  # the parts make the step


def test_a_big_model_with_a_tiny_batch_spends_its_step_communicating():
    steps = _steps(0.0, 0.0, 64, 1, 1, 96, 0, 40_000)  # 2.6M parameters (an embedding table), one sample a step
    for rank in steps:
        assert max(rank.parts(), key=lambda part: rank.parts()[part]) == "communication", str(steps)
    assert steps.cause == "communication" and steps.straggler is None, str(steps)
    assert "gradient accumulation" in steps.advice


def test_with_accumulation_a_step_is_an_optimizer_step():
    steps = _steps(0.0, 0.0, 64, 8, 4)
    assert steps[0].count == steps[1].count == 10  # 40 batches, 4 to a step
    assert steps[0].samples == 32


def test_the_summary_is_the_launchs_last_word_and_the_split_can_be_turned_off(monkeypatch):
    seen: list = []

    class Recorder:
        def on_event(self, event):
            seen.append(event)

        def close(self):
            pass

    assert notebook_launcher(_train, num_processes=2, display=Recorder()) == [0, 1]
    finished = seen[-1]
    assert finished.steps is not None and len(finished.steps) == 2
    assert str(finished.steps).startswith("steps split: 40 steps per rank")
    seen.clear()
    monkeypatch.setenv("NBLAUNCH_STEP_SPLIT", "0")
    launch = notebook_launcher(_train, num_processes=2, display=Recorder(), block=False)
    assert launch.result() == [0, 1]
    assert not any(isinstance(e, StepTimes) for e in seen) and len(launch.steps) == 0 and seen[-1].steps is None


def _stops_syncing_after_6_steps():
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(20):
        if accelerator.process_index == 1 and step == 6:
            while True:  # alive, never at the 7th sync: stopped by the test
                time.sleep(0.05)
        accelerator.backward(model(torch.randn(8, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()


def test_a_stalled_sync_is_named_by_count():
    stalled = threading.Event()
    verdicts: list[str] = []

    class Watch:
        def on_event(self, event):
            if isinstance(event, Stalled):
                verdicts.append(event.verdict)
                stalled.set()

        def close(self):
            pass

    launch = notebook_launcher(_stops_syncing_after_6_steps, num_processes=2, display=Watch(), block=False,
                               stall_after=2)
    try:
        assert stalled.wait(60), "no stall was reported"
    finally:
        launch.cancel()
        with pytest.raises(BaseException):
            launch.result()
    assert "rank 0 waits in its 7th gradient sync; rank 1 has entered 6, and is at" in verdicts[0], verdicts[0]
    assert "test_step_split.py" in verdicts[0]


def test_a_rank_forked_from_a_process_with_a_clock_of_its_own_starts_without_it(monkeypatch):
    # The test process itself inside a "launch" (a channel open, as some tests do), its clock made:
    # a forked rank must neither inherit it (steps counted on, the switch ignored) nor its counts.
    from nblaunch.worker import channel, step_clock

    read_end, write_end = os.pipe()
    channel.open_channel(write_end)
    try:
        assert step_clock.start(cuda=False) is not None
        step_clock.entered("gather")
    finally:
        channel.close_channel()
        os.close(read_end)
        os.close(write_end)
    monkeypatch.setenv("NBLAUNCH_STEP_SPLIT", "0")
    launch = notebook_launcher(_train, num_processes=2, display="none", block=False)
    assert launch.result() == [0, 1] and len(launch.steps) == 0
    monkeypatch.delenv("NBLAUNCH_STEP_SPLIT")
    assert _steps()[0].count == 40


def _saves_the_whole_model():
    import copy
    import io

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))  # one process: the user's own module, timed
    torch.save(accelerator.unwrap_model(model), io.BytesIO())
    copy.deepcopy(model)
    return "saved"


def test_a_timed_model_still_pickles():
    assert notebook_launcher(_saves_the_whole_model, num_processes=1, display="none") == ["saved"]


def _forwards_without_sync():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(Items(160), batch_size=8))
    for x, y in loader:
        with accelerator.no_sync(model):  # DDP decides in the forward: this backward will not all-reduce
            loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss, retain_graph=True)
        accelerator.backward(loss)  # the same graph again: still one step, still no sync
        optimizer.step()
        optimizer.zero_grad()


def test_a_backward_after_a_forward_under_no_sync_is_no_gradient_sync():
    launch = notebook_launcher(_forwards_without_sync, num_processes=2, display="none", block=False)
    launch.result()
    steps = launch.steps
    assert [r.count for r in steps] == [10, 10] and all(r.arrival_lag is None for r in steps), str(steps)
