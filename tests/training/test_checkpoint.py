"""save_state / load_state: a run stopped mid-epoch and resumed in a fresh launch ends with the
same weights, and sees the same batches, as an uninterrupted run; the files are Accelerate's
(tied weights written once), and a checkpoint that does not fit says what to do."""

import os

import pytest

import torch
from torch.utils.data import DataLoader, TensorDataset

from nblaunch.training import Accelerator, DataLoaderConfiguration, set_seed

EPOCHS, STOP_AT = 2, 7  # 5 batches per rank and epoch: step 7 is in the middle of epoch 2


class Counter:
    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def _setup(seed, dispatch):
    set_seed(seed)  # a fresh launch with another seed must still resume exactly
    acc = Accelerator(mixed_precision="fp16", dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(40, 5, generator=g), torch.randn(40, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched, counter


def _step(acc, model, opt, sched, batch):
    x, y = batch
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    sched.step()
    opt.zero_grad()


def _weights(acc, model):
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def _first_run(ckpt, dispatch):
    # uninterrupted
    acc, model, opt, loader, sched, counter = _setup(0, dispatch)
    seen = []
    for _ in range(EPOCHS):
        for batch in loader:
            seen.append(batch[0][:, 0].tolist())
            _step(acc, model, opt, sched, batch)
    full = {"weights": _weights(acc, model), "seen": seen, "lr": sched.get_last_lr()}
    # interrupted at STOP_AT
    acc, model, opt, loader, sched, counter = _setup(0, dispatch)
    done = False
    for _ in range(EPOCHS):
        for batch in loader:
            _step(acc, model, opt, sched, batch)
            counter.steps += 1
            if counter.steps == STOP_AT:
                acc.save_state(ckpt)
                done = True
                break
        if done:
            break
    return full


def _resume(ckpt, dispatch):
    out = {}
    # nblaunch style: load_state puts the loader back where it was
    acc, model, opt, loader, sched, counter = _setup(123, dispatch)
    acc.load_state(ckpt)
    seen = []
    for _ in range(loader.epoch, EPOCHS):
        for batch in loader:
            seen.append(batch[0][:, 0].tolist())
            _step(acc, model, opt, sched, batch)
    out["auto"] = {"weights": _weights(acc, model), "seen": seen, "lr": sched.get_last_lr(),
                   "steps": counter.steps}
    # Accelerate style: skip_first_batches for the resumed epoch, then the loader itself
    acc, model, opt, loader, sched, counter = _setup(456, dispatch)
    acc.load_state(ckpt)
    per_epoch = len(loader)
    start_epoch, resume_step = divmod(counter.steps, per_epoch)
    seen = []
    for epoch in range(start_epoch, EPOCHS):
        source = acc.skip_first_batches(loader, resume_step) if epoch == start_epoch else loader
        for batch in source:
            seen.append(batch[0][:, 0].tolist())
            _step(acc, model, opt, sched, batch)
    out["skip"] = {"weights": _weights(acc, model), "seen": seen, "lr": sched.get_last_lr()}
    return out


# One process: the shuffle draws from the global RNG as in plain PyTorch, and resuming must find
# the interrupted epoch's order all the same.
# Dispatched (rank 0 reads for all): rank 0 passes over the used rounds on resuming.
@pytest.mark.parametrize("dispatch", [False, True])
@pytest.mark.parametrize("processes", [2, 1])
def test_kill_and_resume_matches_uninterrupted_run(launch, tmp_path, processes, dispatch):
    ckpt = str(tmp_path / "ckpt")
    full = launch(_first_run, ckpt, dispatch, num_processes=processes)
    assert sorted(os.listdir(ckpt)) == sorted(  # Accelerate's layout, nblaunch's data positions and record
        ["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "scaler.pt", "scheduler.bin",
         "nblaunch_complete.json"]
        + [f"random_states_{r}.pkl" for r in range(processes)]
        + [f"nblaunch_positions_{r}.pkl" for r in range(processes)])
    resumed = launch(_resume, ckpt, dispatch, num_processes=processes)
    for rank in range(processes):
        expected = full[rank]
        for style in ("auto", "skip"):
            got = resumed[rank][style]
            assert got["seen"] == expected["seen"][STOP_AT:], (rank, style)
            assert got["lr"] == expected["lr"]
            for a, b in zip(got["weights"], expected["weights"]):
                assert torch.allclose(a, b, atol=1e-6, rtol=0), (rank, style)
        assert resumed[rank]["auto"]["steps"] == STOP_AT
    # the run really depends on where it resumes: the start is far from the end
    assert full[0]["seen"][:STOP_AT] != full[0]["seen"][STOP_AT:STOP_AT * 2]


def test_save_model_writes_unwrapped_weights(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(3, 2))
    path = acc.save_model(model, tmp_path / "out", safe_serialization=False)
    state = torch.load(path) if path.endswith(".bin") else __import__("safetensors.torch").torch.load_file(path)
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], model.weight.detach())


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor under two names


@pytest.mark.parametrize("safe", [True, False])
def test_tied_weights_are_written_once_and_come_back_tied(tmp_path, safe):
    if safe:
        pytest.importorskip("safetensors")
    acc = Accelerator()
    model = acc.prepare(TiedLM())
    acc.save_state(tmp_path, safe_serialization=safe)
    name = "model.safetensors" if safe else "pytorch_model.bin"
    assert name in os.listdir(tmp_path)
    if safe:  # safetensors refuses shared memory: one name holds it, as in Accelerate's files
        from safetensors.torch import load_file, load_model
        assert list(load_file(tmp_path / name)) == ["embed.weight"]
        load_model(TiedLM(), tmp_path / name)  # what Accelerate's load_state reads it with
    again = Accelerator()
    fresh = again.prepare(TiedLM())
    again.load_state(tmp_path)
    assert torch.equal(fresh.embed.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight


def test_a_directory_without_the_weights_says_what_it_holds(tmp_path):
    acc = Accelerator()
    acc.prepare(torch.nn.Linear(2, 2))
    (tmp_path / "notes.txt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors or pytorch_model.bin .*notes.txt"):
        acc.load_state(tmp_path)
    (tmp_path / "rank_0.pkl").write_bytes(b"")  # nblaunch's earlier layout
    with pytest.raises(FileNotFoundError, match=r"in nblaunch's earlier layout .* load_state no longer reads"):
        acc.load_state(tmp_path)


def test_registered_objects_must_match_the_checkpoints(tmp_path):
    acc = Accelerator()
    acc.prepare(torch.nn.Linear(2, 2))
    acc.register_for_checkpointing(Counter())
    acc.save_state(tmp_path)
    again = Accelerator()
    again.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="holds 1 registered objects' states, 0 objects are registered"):
        again.load_state(tmp_path)


def test_a_stateful_loader_position_nblaunch_cannot_read_is_named(tmp_path):
    acc = Accelerator()
    acc.prepare(torch.nn.Linear(2, 2), DataLoader(list(range(8)), batch_size=2))
    acc.save_state(tmp_path)
    os.remove(tmp_path / "nblaunch_positions_0.pkl")  # as Accelerate writes it, with a StatefulDataLoader
    os.remove(tmp_path / "nblaunch_complete.json")  # (Accelerate keeps no record of its files)
    torch.save({"_num_yielded": 2}, tmp_path / "dl_state_dict.bin")
    with pytest.warns(UserWarning, match="skip_first_batches"):
        acc.load_state(tmp_path)
