"""Accelerate's API that real code calls, with real ranks: its own configuration objects,
DDP communication hooks, sync_each_batch, reduce max/min, destroy_process_group, the
``nblaunch.utils`` / ``nblaunch.logging`` modules."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")


def _accelerates_objects():
    from accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs,
                                  GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs)

    from nblaunch import Accelerator

    accelerator = Accelerator(
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
                         GradScalerKwargs(init_scale=1024.0), InitProcessGroupKwargs()],
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        mixed_precision="fp16",
    )
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    return {
        "find_unused": model.find_unused_parameters,
        "scale": accelerator.scaler.get_scale(),
        "split": accelerator.split_batches,
        "steps": accelerator.gradient_accumulation_steps,
    }


def test_accelerates_own_configuration_objects_are_accepted_by_their_fields(launch):
    for result in launch(_accelerates_objects):
        assert result == {"find_unused": True, "scale": 1024.0, "split": True, "steps": 2}


def _train_with_hook(hook, wrapper):
    from nblaunch import Accelerator, DDPCommunicationHookType, DistributedDataParallelKwargs

    torch.manual_seed(0)
    options = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(hook),
                                            comm_wrapper=DDPCommunicationHookType(wrapper))
    accelerator = Accelerator(kwargs_handlers=[options])
    model = accelerator.prepare(torch.nn.Linear(8, 8))
    rank = accelerator.process_index
    model(torch.full((4, 8), float(rank + 1))).sum().backward()
    return model.module.weight.grad.clone()


@pytest.mark.parametrize("hook, wrapper", [("fp16", "no"), ("power_sgd", "no"), ("power_sgd", "fp16"),
                                           ("batched_power_sgd", "fp16")])  # bf16: torch needs NCCL
def test_ddp_communication_hooks_average_the_gradients(launch, hook, wrapper):
    g0, g1 = launch(_train_with_hook, hook, wrapper)
    torch.testing.assert_close(g0, g1)  # every rank ends with the same (compressed) average
    reference = torch.full((8, 8), 4 * 1.5)  # d(sum(W x))/dW = sum over the batch of x, averaged
    tolerance = 0.6 if "power_sgd" in hook else 0.05  # PowerSGD approximates by a low-rank matrix
    assert (g0 - reference).abs().max() < tolerance * reference.max()


def _grads_while_accumulating(sync_each_batch):
    from nblaunch import Accelerator, GradientAccumulationPlugin

    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=2, sync_each_batch=sync_each_batch))
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(2, 1, bias=False))
    with accelerator.accumulate(model):  # the first micro-step: no optimizer step yet
        model(torch.full((1, 2), float(accelerator.process_index + 1))).sum().backward()
    return accelerator.sync_gradients, model.module.weight.grad.clone()


def test_sync_each_batch_all_reduces_every_micro_step(launch):
    (sync0, g0), (sync1, g1) = launch(_grads_while_accumulating, True)
    assert not sync0 and not sync1  # the optimizer still waits
    torch.testing.assert_close(g0, g1)  # but the gradients were averaged already
    (_, g0), (_, g1) = launch(_grads_while_accumulating, False)
    assert not torch.equal(g0, g1)  # no_sync: each rank keeps its own until the last micro-step


def _reductions():
    from nblaunch import PartialState
    from nblaunch.utils import reduce

    state = PartialState()
    value = torch.tensor([float(state.process_index), 5.0 - state.process_index])
    out = {kind: reduce(value, kind).tolist() for kind in ("sum", "mean", "max", "min")}
    state.destroy_process_group()
    import torch.distributed as dist

    out["group_left"] = dist.is_initialized()
    return out


def test_reduce_max_and_min_and_destroy_process_group(launch):
    for r in launch(_reductions):
        assert r == {"sum": [1.0, 9.0], "mean": [0.5, 4.5], "max": [1.0, 5.0], "min": [0.0, 4.0],
                     "group_left": False}


def _logs():
    from nblaunch.logging import get_logger

    logger = get_logger("nblaunch-test", log_level="INFO")
    logger.info("main only")
    logger.info("every rank", main_process_only=False)
    logger.info("in order", main_process_only=False, in_order=True)


def test_get_logger_logs_once_or_from_every_rank(recorder):
    import logging

    from nblaunch import notebook_launcher

    logging.getLogger("nblaunch-test").addHandler(logging.StreamHandler())  # as a user would
    try:
        notebook_launcher(_logs, num_processes=2, display=recorder)
    finally:
        logging.getLogger("nblaunch-test").handlers.clear()
    assert recorder.lines(0, "stderr") == ["main only", "every rank", "in order"]
    assert recorder.lines(1, "stderr") == ["every rank", "in order"]


def test_distributed_type_has_the_members_code_compares_against():
    from nblaunch import DistributedType

    for name in ("DEEPSPEED", "FSDP", "MULTI_NPU", "MULTI_XPU", "MULTI_HPU", "MEGATRON_LM"):
        assert getattr(DistributedType, name).value == name


def test_find_executable_batch_size_halves_after_out_of_memory():
    from nblaunch.utils import find_executable_batch_size

    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert train() == 16 and tried == [64, 32, 16]


def _uneven_join():
    from torch.utils.data import DataLoader

    from nblaunch import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    loader = accelerator.prepare(DataLoader(torch.arange(5.0).reshape(5, 1), batch_size=1))  # 3 and 2 batches
    batches = 0
    with accelerator.join_uneven_inputs([model]):
        for x in loader:
            model(x).sum().backward()  # DDP's all-reduce: the rank that ran out joins instead of leaving
            batches += 1
    with accelerator.join_uneven_inputs([model], even_batches=True):
        evened = sum(1 for _ in loader)
    return batches, evened


def test_join_uneven_inputs_lets_a_rank_with_fewer_batches_finish(launch):
    assert launch(_uneven_join) == [(3, 3), (2, 3)]


def _data_loader_functions():
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
    from torch.utils.data._utils.collate import default_collate

    from nblaunch import AcceleratorState, SeedableRandomSampler, prepare_data_loader
    from nblaunch.utils import copy_tensor_to_devices

    state = AcceleratorState()
    data = torch.arange(8.0)
    plain = prepare_data_loader(DataLoader(data, batch_size=2), state.device, state.num_processes,
                                state.process_index)
    batch_sampler = BatchSampler(SequentialSampler(data), batch_size=2, drop_last=False)
    as_sampler = prepare_data_loader(DataLoader(data, sampler=batch_sampler, batch_size=None,
                                                collate_fn=default_collate))
    sampler = SeedableRandomSampler(range(6), data_seed=3)
    orders = [list(sampler), list(sampler)]
    sampler.set_epoch(0)
    copied = copy_tensor_to_devices(torch.tensor([4.0, 5.0]) if state.process_index == 1 else None)
    return {
        "plain": [b.tolist() for b in plain],
        "as_sampler": [b.tolist() for b in as_sampler],
        "epochs_differ": orders[0] != orders[1],
        "replayed": list(sampler) == orders[0],
        "orders": orders[0],
        "copied": copied.tolist(),
        "mixed_precision": state.mixed_precision,
    }


def test_accelerates_data_loader_functions_under_their_names(launch):
    r0, r1 = launch(_data_loader_functions)
    assert r0["plain"] == [[0.0, 1.0], [4.0, 5.0]] and r1["plain"] == [[2.0, 3.0], [6.0, 7.0]]
    assert r0["as_sampler"] == r0["plain"] and r1["as_sampler"] == r1["plain"]
    for r in (r0, r1):
        assert r["epochs_differ"] and r["replayed"] and r["copied"] == [4.0, 5.0]
        assert r["mixed_precision"] == "no"
    assert r0["orders"] == r1["orders"]  # the seed, not the rank, decides the order


def _profiled(trace_dir):
    from nblaunch import Accelerator, ProfileKwargs

    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(output_trace_dir=trace_dir, record_shapes=True)])
    with accelerator.profile() as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    names = {event.key for event in prof.key_averages()}
    # A handler given to profile() is used instead; Accelerate's own class too.
    from accelerate.utils import ProfileKwargs as Theirs

    with accelerator.profile(Theirs(activities=["cpu"])) as prof:
        torch.relu(torch.ones(3))
    return "aten::mm" in names, "aten::relu" in {event.key for event in prof.key_averages()}


def test_profile_writes_each_ranks_trace(launch, tmp_path):
    import json

    assert launch(_profiled, str(tmp_path)) == [(True, True)] * 2
    for rank in (0, 1):
        with open(tmp_path / f"profile_{rank}.json") as f:
            trace = json.load(f)
        assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
