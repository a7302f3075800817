"""Per-process state: defaults, reset, adoption, and Accelerators made in the notebook itself."""


import pytest
import torch
import torch.distributed as dist

from nblaunch.training import Accelerator, DistributedType, PartialState, reset_process_state


def test_outside_a_launch_is_one_plain_process():
    state = PartialState()
    assert (state.process_index, state.local_process_index, state.num_processes) == (0, 0, 1)
    assert state.distributed_type is DistributedType.NO and state.device == torch.device("cpu")
    assert state.is_main_process and state.is_local_main_process and not dist.is_initialized()
    assert PartialState() is not state and PartialState().__dict__ is state.__dict__  # shared


def _report():
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(2, 2))
    return acc.num_processes, acc.distributed_type.value, type(model).__name__


def test_accelerator_in_notebook_then_two_process_launch(launch):
    here = Accelerator(mixed_precision="bf16")  # made in the "notebook" process
    assert here.num_processes == 1
    assert launch(_report) == [(2, "MULTI_CPU", "DistributedDataParallel")] * 2
    assert launch(_report, num_processes=1) == [(1, "NO", "Linear")]  # one rank
    assert launch(_report) == [(2, "MULTI_CPU", "DistributedDataParallel")] * 2
    assert Accelerator().num_processes == 1 and not dist.is_initialized()


def test_two_accelerators_with_different_settings_in_one_process():
    a = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    b = Accelerator(mixed_precision="fp16", even_batches=False)
    c = Accelerator(cpu=True)
    assert (a.mixed_precision, a.gradient_accumulation_steps, a.scaler) == ("bf16", 2, None)
    assert (b.mixed_precision, b.gradient_accumulation_steps, b.even_batches) == ("fp16", 1, False)
    assert b.scaler is not None and c.mixed_precision == "no" and c.device.type == "cpu"
    ma = a.prepare(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    mc = c.prepare(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    dtypes = {}
    ma[0].register_forward_hook(lambda m, i, o: dtypes.update(a=o.dtype))
    mc[0].register_forward_hook(lambda m, i, o: dtypes.update(c=o.dtype))
    ma(torch.ones(1, 2)), mc(torch.ones(1, 2))
    assert dtypes == {"a": torch.bfloat16, "c": torch.float32}
    # accumulation state is per Accelerator
    with a.accumulate(ma):
        assert not a.sync_gradients
    assert c.sync_gradients


def _owned_and_adopted():
    import socket

    out = {}
    acc = Accelerator()
    out["owned"] = dist.is_initialized() and not acc.state.adopted_process_group
    rank = acc.process_index
    # The "cluster engine" below rendezvouses on a port of its own (re-using MASTER_PORT while a
    # peer may still hold the old store would race); agree on it over the group we still have.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = [s.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    reset_process_state()
    out["owned_destroyed"] = not dist.is_initialized()
    try:
        acc.process_index
    except RuntimeError as e:
        out["stale_error"] = str(e)
    # a group someone else made (a cluster engine): adopted, and never destroyed by us
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}",
                            rank=rank, world_size=2)
    acc = Accelerator()
    out["adopted"] = (acc.state.adopted_process_group, acc.num_processes, acc.process_index,
                      acc.gather(torch.tensor([acc.process_index])).tolist())
    reset_process_state()
    out["adopted_kept"] = dist.is_initialized()
    dist.destroy_process_group()
    return out


def test_reset_destroys_owned_group_and_keeps_adopted_one(launch):
    for rank, r in enumerate(launch(_owned_and_adopted)):
        assert r["owned"] and r["owned_destroyed"] and r["adopted_kept"]
        assert "reset" in r["stale_error"]
        assert r["adopted"] == (True, 2, rank, [0, 1])


def test_xla_without_torch_xla_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(RuntimeError, match="torch_xla cannot be imported"):
        PartialState()
    monkeypatch.delenv("PJRT_DEVICE")
    assert PartialState().distributed_type is DistributedType.NO


def test_stale_state_from_other_launch_variables_is_rebuilt(monkeypatch):
    assert PartialState().num_processes == 1
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    state = PartialState()
    assert state.num_processes == 1 and state.distributed_type is DistributedType.NO


def _remakes_the_state():
    reset_process_state()  # forgets whatever the kernel had, as a fresh script would
    return Accelerator(cpu=True).device.type


def test_a_one_process_launch_leaves_the_kernels_state_as_it_was():
    from nblaunch import notebook_launcher

    Accelerator(mixed_precision="bf16")  # made in the "notebook" process
    before = dict(PartialState().__dict__)
    assert notebook_launcher(_remakes_the_state, num_processes=1, display="none") == ["cpu"]
    assert dict(PartialState().__dict__) == before
