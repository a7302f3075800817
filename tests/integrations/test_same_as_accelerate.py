"""A loop ported by changing its import trains the same as under Accelerate: same weights and
learning rates, for DDP, gradient accumulation and mixed precision (real ``accelerate``, both
under nblaunch's launcher, 2 CPU ranks, unshuffled data)."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")

import torch
from torch.utils.data import DataLoader, TensorDataset

from nblaunch import notebook_launcher


def loop(library: str, accumulation: int, mixed_precision: str):
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import set_seed
    else:
        from nblaunch import Accelerator
        from nblaunch.utils import set_seed
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    data = TensorDataset(x, x @ torch.randn(6, 2, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=4)
    # Sized from the unprepared loader, as Accelerate's examples do.
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=len(loader) // accumulation)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    lrs = []
    for _ in range(2):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return weights, lrs


# fp16 is not compared on the CPU: Accelerate's GradScaler there is CUDA's, which disables itself,
# while nblaunch scales for real (docs/accelerator.md); on GPUs both scale.
@pytest.mark.parametrize("accumulation, mixed_precision", [(1, "no"), (2, "no"), (1, "bf16"), (2, "bf16")])
def test_a_ported_loop_trains_the_same_as_under_accelerate(accumulation, mixed_precision):
    ours = notebook_launcher(loop, args=("nblaunch", accumulation, mixed_precision), num_processes=2, display="none")
    theirs = notebook_launcher(loop, args=("accelerate", accumulation, mixed_precision), num_processes=2,
                               display="none")
    for (our_weights, our_lrs), (their_weights, their_lrs) in zip(ours, theirs):
        assert our_lrs == pytest.approx(their_lrs, abs=1e-12)
        torch.testing.assert_close(our_weights, their_weights, rtol=0, atol=1e-6)


def shuffled_batches(library: str, case: str):
    """Three epochs of a shuffled loader's batches, and a random number drawn after each batch
    (so the global RNG stream is compared too)."""
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed
    else:
        from nblaunch import Accelerator
        from nblaunch.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import SubsetRandomSampler

    set_seed(7)
    data = list(range(23))
    config = DataLoaderConfiguration()
    if case == "plain":
        loader = DataLoader(data, batch_size=3, shuffle=True)
    elif case == "own generator":
        loader = DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    elif case == "subset":
        loader = DataLoader(data, batch_size=3, sampler=SubsetRandomSampler(list(range(0, 23, 2))))
    elif case == "seedable":
        loader = DataLoader(data, batch_size=3, shuffle=True)
        config = DataLoaderConfiguration(use_seedable_sampler=True)
    elif case == "data_seed":
        loader = DataLoader(data, batch_size=3, shuffle=True)
        config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11)
    accelerator = Accelerator(dataloader_config=config)
    loader = accelerator.prepare(loader)
    seen = []
    for _ in range(3):
        for batch in loader:
            seen.append((batch.tolist(), torch.rand(1).item()))
    return seen


@pytest.mark.parametrize("processes", [2, 1])
@pytest.mark.parametrize("case", ["plain", "own generator", "subset", "seedable", "data_seed"])
def test_shuffled_data_comes_in_the_same_order_as_under_accelerate(case, processes):
    ours = notebook_launcher(shuffled_batches, args=("nblaunch", case), num_processes=processes, display="none")
    theirs = notebook_launcher(shuffled_batches, args=("accelerate", case), num_processes=processes,
                               display="none")
    assert ours == theirs
    if processes == 2 and case != "subset":
        first_epoch = [x for rank in ours for batch, _ in rank[:4] for x in batch]
        assert len(first_epoch) == 24 and len(set(first_epoch)) == 23  # shards: all data, 1 repeated


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        yield from range(self.n)


DISPATCH_CASES = [  # (data, length, batch size, split_batches, drop_last, use_seedable_sampler)
    ("stream", 30, 4, False, False, False), ("stream", 31, 4, False, False, False),
    ("stream", 31, 4, True, False, False), ("stream", 30, 4, False, True, False),
    ("stream", 1, 4, False, False, False), ("stream", 99, 16, True, False, False),
    ("list", 31, 4, False, False, False), ("shuffled", 31, 4, False, False, False),
    ("shuffled", 31, 4, True, True, False), ("shuffled", 23, 3, False, False, True),
]


def dispatched_batches(library: str):
    """For every case: each rank's batches and what gather_for_metrics makes of them over two
    epochs, the loader's length, and a random number drawn after each epoch."""
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed
    else:
        from nblaunch import Accelerator
        from nblaunch.utils import DataLoaderConfiguration, set_seed
    seen = {}
    for case in DISPATCH_CASES:
        data, n, batch_size, split, drop_last, seedable = case
        set_seed(3)
        config = DataLoaderConfiguration(dispatch_batches=data != "stream" or None, split_batches=split,
                                         use_seedable_sampler=seedable)
        accelerator = Accelerator(dataloader_config=config)
        dataset = _Stream(n) if data == "stream" else list(range(n))
        loader = accelerator.prepare(DataLoader(dataset, batch_size=batch_size, drop_last=drop_last,
                                                shuffle=data == "shuffled"))
        epochs = []
        for _ in range(2):
            epochs.append([(b.tolist(), accelerator.gather_for_metrics(b).tolist()) for b in loader])
            epochs.append(torch.rand(1).item())
        seen[case] = (epochs, None if data == "stream" else len(loader))
        if library == "accelerate":
            accelerator.state._reset_state()
    return seen


def test_dispatched_batches_are_the_same_as_under_accelerate():
    """dispatch_batches (the default for iterable datasets): rank 0 reads, each rank its part."""
    ours = notebook_launcher(dispatched_batches, args=("nblaunch",), num_processes=2, display="none")
    theirs = notebook_launcher(dispatched_batches, args=("accelerate",), num_processes=2, display="none")
    for rank in (0, 1):
        for case in DISPATCH_CASES:
            assert ours[rank][case] == theirs[rank][case], f"rank {rank}, case {case}"
    for case in DISPATCH_CASES:  # and the run saw the data: every sample, each once, per epoch
        epoch = ours[0][case][0][0]
        gathered = sorted(x for _, together in epoch for x in together)
        n, drop_last = case[1], case[4]
        assert gathered == list(range(n)) or drop_last, case


def local_sgd_run(library: str):
    """Eight steps under LocalSGD(local_sgd_steps=3): the weights after every step."""
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.local_sgd import LocalSGD
        from accelerate.utils import set_seed
    else:
        from nblaunch import Accelerator, LocalSGD
        from nblaunch.utils import set_seed
    set_seed(0)
    accelerator = Accelerator()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    after_step = []
    with LocalSGD(accelerator, model, local_sgd_steps=3) as local_sgd:
        for inputs, targets in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            after_step.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    return after_step, final


def test_local_sgd_steps_and_averages_as_under_accelerate():
    ours = notebook_launcher(local_sgd_run, args=("nblaunch",), num_processes=2, display="none")
    theirs = notebook_launcher(local_sgd_run, args=("accelerate",), num_processes=2, display="none")
    for (our_steps, our_final), (their_steps, their_final) in zip(ours, theirs):
        torch.testing.assert_close(torch.stack(our_steps), torch.stack(their_steps), rtol=0, atol=1e-6)
        torch.testing.assert_close(our_final, their_final, rtol=0, atol=1e-6)
    (rank0, final0), (rank1, final1) = ours
    for step, (a, b) in enumerate(zip(rank0, rank1), start=1):
        # Local steps part the ranks (their batches differ); every third step joins them again.
        assert torch.equal(a, b) == (step % 3 == 0), step
    assert torch.equal(final0, final1)  # averaged on leaving the block


def checkpointed_run(library: str, ckpt: str, resume: bool, seedable: bool, dropout: float):
    """Two epochs with dropout, AdamW and a schedule; stopped after step 7 (mid-epoch 2) with
    save_state, or resumed from there in a fresh launch the way Accelerate's examples do it
    (load_state, then skip_first_batches for the rest of the epoch). The final weights."""
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed
    else:
        from nblaunch import Accelerator
        from nblaunch.utils import DataLoaderConfiguration, set_seed
    set_seed(123 if resume else 0)  # a resumed run gets its random state from the checkpoint
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(40, 5, generator=g), torch.randn(40, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    loader = DataLoader(data, batch_size=4, shuffle=seedable)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    steps, stop_at = 0, 7
    if resume:
        accelerator.load_state(ckpt)
        steps = stop_at
    start_epoch, skip = divmod(steps, len(loader))
    for epoch in range(start_epoch, 2):
        if seedable:
            loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            steps += 1
            if steps == stop_at and not resume:
                accelerator.save_state(ckpt)
    return torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])


# Accelerate's own resume drifts with dropout (the resumed epoch's iterator draws from the restored
# RNG) and with a seedable shuffle (the resumed epoch comes in another order); nblaunch's does not.
@pytest.mark.parametrize("seedable, dropout, accelerate_exact", [(False, 0.0, True), (False, 0.3, False),
                                                                  (True, 0.0, False)],
                         ids=["in order", "dropout", "seedable shuffle"])
def test_a_resumed_run_ends_with_the_same_weights_as_under_accelerate(tmp_path, seedable, dropout,
                                                                      accelerate_exact):
    finals = {}
    for library in ("nblaunch", "accelerate"):
        ckpt = str(tmp_path / library)
        uninterrupted = notebook_launcher(checkpointed_run, args=(library, ckpt, False, seedable, dropout),
                                          num_processes=2, display="none")
        resumed = notebook_launcher(checkpointed_run, args=(library, ckpt, True, seedable, dropout),
                                    num_processes=2, display="none")
        finals[library] = (uninterrupted[0], resumed[0])
    ours, theirs = finals["nblaunch"], finals["accelerate"]
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-6)  # the uninterrupted runs
    torch.testing.assert_close(ours[1], ours[0], rtol=0, atol=1e-6)  # resuming changed nothing
    assert torch.allclose(theirs[1], theirs[0], rtol=0, atol=1e-6) == accelerate_exact
