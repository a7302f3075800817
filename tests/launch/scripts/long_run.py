"""A seeded 40-step, one-pass DDP (or FSDP) run on 2 CPU ranks: shuffled DataLoader, AdamW, StepLR.

    python long_run.py PROJECT_DIR [--stop-at 15] [--resume] [--fsdp] [--endless-save] [--accumulate 4]

``--stop-at N``: at step N rank 0 sends SIGINT to this script (its launcher), as a terminal's
Ctrl-C would. At the end the script saves rank 0's weights in PROJECT_DIR/weights.pt and prints
each rank's steps. ``--endless-save``: saving the state never ends (a huge model's save, in
miniature), so that a second interrupt finds it under way. ``--accumulate N``: gradients accumulated
over N batches (a step is a batch: 40 of them, 40 / N optimizer steps).
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


class EndlessSave:
    """Checkpointed with the model; its state takes longer to gather than any test waits."""

    def state_dict(self):
        time.sleep(3600)

    def load_state_dict(self, state):
        pass


def train(project_dir: str, stop_at: int, fsdp: bool, marker: str | None = None, endless_save: bool = False,
          accumulate: int = 1):
    """``marker``: a file rank 0 writes at step 15 (a kernel's interrupt is sent when it appears).
    After the interrupt (``stop_at`` or the marker) each step takes 50 ms longer, so that it lands
    a step or two later whatever else the machine runs."""
    plugin = {}
    if fsdp:
        from nblaunch.utils import FullyShardedDataParallelPlugin

        plugin = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)}
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project_dir,
                                                                  automatic_checkpoint_naming=True),
                              gradient_accumulation_steps=accumulate, **plugin)
    set_seed(0)
    x = torch.randn(320, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if endless_save:
        accelerator.register_for_checkpointing(EndlessSave())
    steps = 0
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        steps += 1
        if steps == stop_at and accelerator.is_main_process:
            os.kill(os.getppid(), signal.SIGINT)  # the launcher: this script
        if marker is not None and steps == 15 and accelerator.is_main_process:
            open(marker, "w").close()
        if (marker is not None and steps >= 15) or 0 < stop_at <= steps:
            # A real step's length (these take a few ms): the launcher, scheduled late on a busy
            # machine, passes the interrupt on within a step or so of real training, not five tiny ones.
            time.sleep(0.05)
    weights = accelerator.get_state_dict(model)
    return steps, {name: value.clone() for name, value in weights.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir")
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--endless-save", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1)
    options = parser.parse_args()
    try:
        results = nblaunch.notebook_launcher(train, args=(options.project_dir, options.stop_at, options.fsdp, None,
                                                                     options.endless_save, options.accumulate),
                                             num_processes=2, display="text", resume=options.resume)
    except KeyboardInterrupt as interrupted:
        print(f"KEPT {interrupted.kept!r}")
        sys.exit(130)
    torch.save(results[0][1], os.path.join(options.project_dir, "weights.pt"))
    print(f"STEPS {[steps for steps, _ in results]}")
