"""Lightning's Trainer inside a launch: it joins the ranks nblaunch started (README, "Coming from
Lightning") instead of starting its own with strategy="ddp_notebook"."""

from __future__ import annotations

import os

import pytest
import torch

from nblaunch import RankFailedError, notebook_launcher

L = pytest.importorskip("lightning")


class Regression(L.LightningModule):
    def __init__(self, fail_on_rank: int | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_on_rank = fail_on_rank

    def training_step(self, batch, index):
        if self.global_rank == self.fail_on_rank and index == 2:
            raise ValueError(f"bad batch on rank {self.global_rank}")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(fail_on_rank=None, devices=2):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Regression(fail_on_rank)
    trainer.fit(module, loader)
    weight = module.layer.weight.detach().clone()
    return trainer.world_size, trainer.global_rank, trainer.global_step, weight


def test_a_lightning_trainer_joins_the_launchs_ranks_and_trains_data_parallel():
    results = notebook_launcher(fit, num_processes=2, display="none")
    # 64 examples in batches of 8, shared by 2 ranks: 4 steps each, one world of 2.
    assert [r[:3] for r in results] == [(2, 0, 4), (2, 1, 4)]
    assert torch.equal(results[0][3], results[1][3])  # DDP kept the replicas equal


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
