"""Lightning inside a launch, in real 2-rank launches: the Trainer and Fabric join the ranks
nblaunch started (README, "Coming from Lightning") instead of starting their own, also when the
kernel that forked them is interactive; Lightning's progress bars (TQDM and Rich) reach the
display as progress, and what ``self.log`` logs reaches it as metrics."""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

import pytest
import torch

import nblaunch
from nblaunch import RankFailedError, notebook_launcher
from nblaunch.events import Metrics, Output, Progress

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar  # noqa: E402

from nblaunch.lightning import CellLogger  # noqa: E402


class Regression(L.LightningModule):
    def __init__(self, fail_on_rank: int | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_on_rank = fail_on_rank

    def training_step(self, batch, index):
        if self.global_rank == self.fail_on_rank and index == 2:
            raise ValueError(f"bad batch on rank {self.global_rank}")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    return torch.utils.data.DataLoader(data, batch_size=8)


def fit(fail_on_rank=None, devices=2):
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Regression(fail_on_rank)
    trainer.fit(module, loader())
    weight = module.layer.weight.detach().clone()
    return trainer.world_size, trainer.global_rank, trainer.global_step, weight


def test_a_lightning_trainer_joins_the_launchs_ranks_and_trains_data_parallel():
    results = notebook_launcher(fit, num_processes=2, display="none")
    # 64 examples in batches of 8, shared by 2 ranks: 4 steps each, one world of 2.
    assert [r[:3] for r in results] == [(2, 0, 4), (2, 1, 4)]
    assert torch.equal(results[0][3], results[1][3])  # DDP kept the replicas equal
    steps = nblaunch.last_steps()  # Lightning's own loop: the launch says, once, what would split its steps
    assert not steps.ranks and len(steps.notes) == 1 and "through Lightning's Trainer" in steps.notes[0], str(steps)


def test_ranks_forked_from_an_interactive_kernel_are_not_interactive_to_lightning(monkeypatch):
    # What a Jupyter kernel holds once a cell ran `import lightning`: IPython's prompt, and
    # Lightning's own reading of it in every module that checks it. Lightning then refuses
    # strategy="ddp" ("not compatible with an interactive environment"); a rank is not the kernel.
    monkeypatch.setattr(sys, "ps1", "In : ", raising=False)
    readers = [m for name, m in list(sys.modules.items())
               if name.startswith("lightning") and "_IS_INTERACTIVE" in getattr(m, "__dict__", {})]
    assert len(readers) >= 3  # imports, the Trainer's connector, Fabric's connector (at least)
    for module in readers:
        monkeypatch.setattr(module, "_IS_INTERACTIVE", True)
    with pytest.raises(Exception, match="not compatible with an interactive environment"):
        L.Trainer(accelerator="cpu", devices=2, strategy="ddp")  # here, in the "kernel"
    results = notebook_launcher(fit, num_processes=2, display="none")
    assert [r[:3] for r in results] == [(2, 0, 4), (2, 1, 4)]
    assert sys.ps1 == "In : " and all(m._IS_INTERACTIVE for m in readers)  # the kernel's own state is its own


def test_a_lightning_rank_that_raises_is_named_and_the_other_stopped():
    with pytest.raises(RankFailedError, match="rank 1 failed: ValueError: bad batch on rank 1"):
        notebook_launcher(fit, args=(1,), num_processes=2, display="none")


def run_id():
    import torch.distributed as dist

    return os.environ["TORCHELASTIC_RUN_ID"], dist.is_torchelastic_launched()


@pytest.mark.parametrize("devices", [4, 1])
def test_devices_that_disagree_with_num_processes_fail_at_once_saying_so(devices):
    # The ranks look launched by torchrun (TORCHELASTIC_RUN_ID), so Lightning checks devices= against
    # WORLD_SIZE: without it, devices=4 hung waiting for ranks 2 and 3, devices=1 raised an IndexError.
    with pytest.raises(RankFailedError, match=rf"devices={devices}.*does not match the world size \(2\)"):
        notebook_launcher(fit, args=(None, devices), num_processes=2, display="none", timeout=120)
    assert notebook_launcher(run_id, num_processes=2, display="none", rdzv_id="job-7") == [("job-7", True)] * 2


# --------------------------------------------------------------------------- Fabric
def fabric_fit(launch=True, devices=2):
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="ddp", loggers=CellLogger())
    if launch:
        fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.utils.data.TensorDataset(torch.arange(32.0).unsqueeze(1), torch.randn(32, 1))
    batches = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=4))
    seen = []
    for step, (x, y) in enumerate(batches):
        seen += x[:, 0].long().tolist()
        loss = torch.nn.functional.mse_loss(model(x / 32), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        fabric.log("loss", loss, step=step)
    everyone = fabric.all_gather(torch.tensor(seen))
    return fabric.world_size, fabric.global_rank, seen, everyone.flatten().tolist(), model.weight.detach().clone()


def test_fabric_joins_the_launchs_ranks_shards_the_data_and_keeps_the_replicas_equal(recorder):
    results = notebook_launcher(fabric_fit, num_processes=2, display=recorder)
    assert [r[:2] for r in results] == [(2, 0), (2, 1)]
    shards = [set(r[2]) for r in results]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(32))  # disjoint, complete
    assert results[0][3] == results[1][3] and sorted(results[0][3]) == list(range(32))  # all_gather
    assert torch.equal(results[0][4], results[1][4])
    # fabric.log through CellLogger: each rank's 4 steps, charted per rank
    steps = {rank: [e.step for e in recorder.of(Metrics) if e.rank == rank and "loss" in e.values] for rank in (0, 1)}
    assert steps == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}


def test_fabric_without_launch_says_to_call_it():
    with pytest.raises(RankFailedError, match=r"you must call `\.launch\(\)`"):
        notebook_launcher(fabric_fit, args=(False,), num_processes=2, display="none")


def test_fabric_devices_that_disagree_with_num_processes_fail_saying_so():
    with pytest.raises(RankFailedError, match=r"devices=4.*does not match the world size \(2\)"):
        notebook_launcher(fabric_fit, args=(True, 4), num_processes=2, display="none", timeout=120)


# --------------------------------------------------------------------------- progress bars
def fit_with_bar(bar: str):
    progress_bar = RichProgressBar() if bar == "rich" else TQDMProgressBar()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[progress_bar])
    trainer.fit(Regression(), loader())
    return trainer.global_step


@pytest.mark.parametrize("bar, epochs", [("tqdm", ["Epoch 0", "Epoch 1"]), ("rich", ["Epoch 0/1", "Epoch 1/1"])])
def test_lightnings_progress_bar_is_shown_as_the_ranks_progress_not_drawn(bar, epochs, recorder, monkeypatch):
    pytest.importorskip(bar)
    monkeypatch.setenv("FORCE_COLOR", "1")  # as a Jupyter kernel sets it: rich would take the pipe for a terminal
    assert notebook_launcher(fit_with_bar, args=(bar,), num_processes=2, display=recorder) == [8, 8]
    progress = recorder.of(Progress)
    assert {e.rank for e in progress} == {0} and not any(e.auto for e in progress)  # Lightning draws on rank 0
    # each epoch a bar of its own, closed full: 4 batches of 8 from the 32 examples a rank gets
    closed = [(e.desc, e.n, e.total) for e in progress if e.closed and e.desc.startswith("Epoch")]
    assert closed == [(desc, 4, 4) for desc in epochs]
    drawn = [line for e in recorder.of(Output) for line in e.lines if "it/s" in line or "\x1b[" in line or "━" in line]
    assert not drawn, drawn


# --------------------------------------------------------------------------- self.log -> metrics
def fit_and_log(logger, root):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=logger,
                        default_root_dir=root, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), loader())
    return [type(logger).__name__ for logger in trainer.loggers]


def nblaunch_is_a_lightning_entry_point() -> None:
    if not any(e.value == "nblaunch.lightning:trainer_callbacks"
               for e in entry_points(group="lightning.pytorch.callbacks_factory")):
        pytest.fail("nblaunch's Lightning entry point is not installed: reinstall nblaunch (pip install -e .)")


def test_self_log_reaches_the_display_as_metrics_with_lightnings_default_logger(recorder, tmp_path):
    nblaunch_is_a_lightning_entry_point()
    loggers = notebook_launcher(fit_and_log, args=(None, str(tmp_path)), num_processes=2, display=recorder)
    assert loggers == [["TensorBoardLogger", "CellLogger"]] * 2  # the user's logger first, still writing
    assert list((tmp_path / "lightning_logs").iterdir())
    for rank in (0, 1):
        logged = [(e.step, set(e.values)) for e in recorder.of(Metrics) if e.rank == rank]
        assert logged == [(step, {"loss"}) for step in range(4)]  # no "epoch": Lightning's, not the user's


def test_a_trainer_without_loggers_is_left_so_and_cell_logger_can_be_given(recorder, tmp_path):
    nblaunch_is_a_lightning_entry_point()
    assert notebook_launcher(fit_and_log, args=(False, str(tmp_path)), num_processes=2, display=recorder) == [[]] * 2
    assert not recorder.of(Metrics)
    loggers = notebook_launcher(fit_and_log, args=(CellLogger(), str(tmp_path)), num_processes=2, display=recorder)
    assert loggers == [["CellLogger"]] * 2
    assert sorted((e.rank, e.step) for e in recorder.of(Metrics)) == [(r, s) for r in (0, 1) for s in range(4)]
    assert not (tmp_path / "lightning_logs").exists()


def test_outside_a_launch_nothing_is_added_and_cell_logger_is_silent():
    from nblaunch.lightning import trainer_callbacks

    assert trainer_callbacks() == []
    CellLogger().log_metrics({"loss": 1.0}, step=0)  # no launch: nothing to send to, no error
