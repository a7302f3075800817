"""The XLA branches of the training code that run without torch_xla (main lane).

The real XLA runs are in tests/xla/test_xla_accelerator.py (XLA lane). Here torch_xla's rank
lookup is replaced by a fake one, to check what is ours: the per-thread state, the choice
between XLA and the CPU, fp16 refusal, and pointing an optimizer at moved parameters.
"""

from __future__ import annotations

import threading

import pytest
import torch

from nblaunch.training import DistributedType, PartialState
from nblaunch.training.model.placement import ReplacedParameters, move_keeping_ties
from nblaunch.training.precision.modes import check_supported
from nblaunch.training.runtime import xla as xla_backend


def in_threads(function, count=2):
    """``function(i)`` in ``count`` threads that all stay alive until every one has run it."""
    results = [None] * count
    all_done = threading.Barrier(count)

    def run(i):
        results[i] = function(i)
        all_done.wait()  # no thread ends (and frees its state) before the others are done

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.fixture
def fake_xla(monkeypatch):
    """An XLA launch whose device threads are told their ordinal through ``ordinal.value``."""
    ordinal = threading.local()
    monkeypatch.setenv("NBLAUNCH_XLA", "1")
    monkeypatch.setattr(xla_backend, "rank_state", lambda: {
        "process_index": ordinal.value, "local_process_index": ordinal.value, "num_processes": 2,
        "num_local_processes": 2, "device": torch.device("xla", ordinal.value)})
    return ordinal


def test_on_xla_each_thread_is_its_own_rank(fake_xla):
    def rank(i):
        fake_xla.value = i
        state = PartialState()
        return (state.process_index, state.num_processes, state.device, state.distributed_type,
                PartialState().__dict__ is state.__dict__, id(state.__dict__))

    first, second = in_threads(rank)
    assert first[:5] == (0, 2, torch.device("xla", 0), DistributedType.XLA, True)
    assert second[:5] == (1, 2, torch.device("xla", 1), DistributedType.XLA, True)
    assert first[5] != second[5]


def test_on_the_cpu_threads_share_the_process_state():
    ids = in_threads(lambda i: id(PartialState().__dict__))
    assert ids[0] == ids[1] == id(PartialState().__dict__)


def test_cpu_true_is_refused_in_an_xla_launch_and_wins_outside_one(fake_xla, monkeypatch):
    with pytest.raises(ValueError, match="cpu=True inside an XLA launch"):
        PartialState(cpu=True)
    monkeypatch.delenv("NBLAUNCH_XLA")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # a TPU host, outside a launch
    assert PartialState(cpu=True).distributed_type is DistributedType.NO


def test_pjrt_device_cpu_alone_does_not_ask_for_xla(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert PartialState().distributed_type is DistributedType.NO


def test_fp16_is_refused_on_xla_devices():
    with pytest.raises(ValueError, match="'fp16' is not supported on XLA devices"):
        check_supported("fp16", torch.device("xla", 0))
    check_supported("bf16", torch.device("xla", 0))


def test_an_optimizer_follows_its_parameters_when_the_model_gets_new_ones():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # now it has state, keyed by the old parameters
    before = dict(model.named_parameters())
    old_weight = model.weight
    # What moving to an XLA device does: new Parameter objects under the same names.
    model.weight = torch.nn.Parameter(model.weight.detach().clone())
    model.bias = torch.nn.Parameter(model.bias.detach().clone())
    replaced = ReplacedParameters()
    replaced.record(before, model)
    replaced.switch(optimizer)
    params = optimizer.param_groups[0]["params"]
    assert params[0] is model.weight and params[1] is model.bias
    assert model.weight in optimizer.state and old_weight not in optimizer.state
    assert optimizer.state[model.weight]["exp_avg"].shape == (1, 2)


def test_tied_weights_stay_tied_when_moving_makes_new_parameters():
    def tied():
        model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
        model[1].weight = model[0].weight
        return model

    meta = torch.device("meta")  # like XLA, a device that gets new Parameter objects
    plain = tied().to(meta)
    assert plain[1].weight is not plain[0].weight  # what a plain .to() does
    moved = move_keeping_ties(tied(), meta)
    assert moved[1].weight is moved[0].weight and moved[0].weight.device == meta


def test_prepare_takes_an_optimizer_given_before_its_model():
    from nblaunch.training import Accelerator

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared_optimizer, prepared_model = Accelerator().prepare(optimizer, model)
    assert prepared_model is model and prepared_optimizer.optimizer is optimizer
