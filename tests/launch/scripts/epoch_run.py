"""Epochs of one step each on 2 CPU ranks (DDP), an evaluation over a second prepared DataLoader
after every epoch: whatever step an interrupt stops at is the last of an epoch, so the stop must
let the loop's end-of-epoch code run first.

    python epoch_run.py PROJECT_DIR [--stop-at 12] [--resume]

Rank 0 prints ``EVAL <epoch> <loss>`` after each evaluation. ``--stop-at N``: after epoch N's
evaluation rank 0 sends SIGINT to this script (its launcher). At the end the script saves rank
0's weights in PROJECT_DIR/weights.pt.
"""

import argparse
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import nblaunch
from nblaunch import Accelerator
from nblaunch.utils import ProjectConfiguration, set_seed

EPOCHS = 30


def train(project_dir: str, stop_at: int):
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project_dir,
                                                                  automatic_checkpoint_naming=True))
    set_seed(0)
    x, held_out = torch.randn(8, 8), torch.randn(16, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)  # 1 step an epoch
    evaluation = DataLoader(TensorDataset(held_out, held_out.sum(1, keepdim=True)), batch_size=4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader, evaluation = accelerator.prepare(model, optimizer, loader, evaluation)
    accelerator.resume()  # resume=True: loaded now, so loader.epoch is where the stopped run got to
    for epoch in range(loader.epoch, EPOCHS):
        for inputs, targets in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            loss = sum(torch.nn.functional.mse_loss(model(i), t) for i, t in evaluation)
        if accelerator.is_main_process:
            print(f"EVAL {epoch} {loss.item():.6f}", flush=True)
            if epoch == stop_at:
                os.kill(os.getppid(), signal.SIGINT)  # the launcher: this script
        if stop_at >= 0 and epoch >= stop_at:
            time.sleep(0.05)  # a slower epoch's stand-in: the interrupt finds the ranks training
    return {name: value.clone() for name, value in accelerator.get_state_dict(model).items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir")
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args()
    try:
        results = nblaunch.notebook_launcher(train, args=(options.project_dir, options.stop_at), num_processes=2,
                                             display="text", resume=options.resume)
    except KeyboardInterrupt:
        sys.exit(130)
    torch.save(results[0], os.path.join(options.project_dir, "weights.pt"))
