"""A prepared DataLoader shows each rank's progress by itself, in real 2-rank launches."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from nblaunch import notebook_launcher
from nblaunch.display.view_state import LaunchView
from nblaunch.events import Progress


def two_epochs(wrap_in_tqdm: bool) -> int:
    from nblaunch.training import Accelerator

    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(torch.arange(40.0), batch_size=4))
    batches = 0
    for epoch in range(2):
        if wrap_in_tqdm:
            from tqdm.auto import tqdm

            batches += sum(1 for _ in tqdm(loader, desc=f"mine {epoch}"))
        else:
            batches += sum(1 for _ in loader)
    return batches


def test_each_epoch_of_a_prepared_loader_is_a_bar_per_rank(recorder):
    assert notebook_launcher(two_epochs, args=(False,), num_processes=2, display=recorder) == [10, 10]
    auto = [e for e in recorder.of(Progress) if e.auto]
    for rank in (0, 1):
        closed = [(e.desc, e.n, e.total) for e in auto if e.rank == rank and e.closed]
        assert closed == [("batches, epoch 0", 5, 5), ("batches, epoch 1", 5, 5)]


def test_a_rank_that_draws_its_own_bar_shows_only_that_one(recorder):
    import pytest

    pytest.importorskip("tqdm")
    assert notebook_launcher(two_epochs, args=(True,), num_processes=2, display=recorder) == [10, 10]
    view = LaunchView()
    for event in recorder.events:
        view.apply(event, 0.0)
    for rank in (0, 1):
        assert [bar.desc for bar in view.ranks[rank].shown_bars()] == ["mine 1"]
