"""The demo job: a small CNN on scikit-learn's digits, trained on several processes.

Run it with ``python -m nblaunch demo`` (add ``--help`` for options). The data set ships inside
scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def load_digits_dataset(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Digits (1797 images of 8x8) as train and test sets of (1x8x8 float image, label)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train_digits(epochs: int = 5, batch_size: int = 32, lr: float = 2e-3, mixed_precision: str | None = None) -> dict:
    """The training function each rank runs; returns this rank's view of the results."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    from nblaunch.training import Accelerator, set_seed  # deferred: the training side loads in the ranks, as a user's would

    set_seed(0)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    train_set, test_set = load_digits_dataset()
    model = SmallCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    loss_fn = nn.CrossEntropyLoss()
    accelerator.resume()  # `nblaunch demo --resume`: where Ctrl-C stopped the last one, before the loop counts epochs

    losses = []
    step = 0
    # A resumed demo with no epoch left reports the model it loaded.
    correct, total = evaluate(accelerator, model, test_loader) if train_loader.epoch >= epochs else (0, 0)
    for epoch in range(train_loader.epoch, epochs):
        model.train()
        for images, labels in train_loader:
            loss = loss_fn(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            losses.append(loss.item())
            accelerator.log({"loss": loss.item()}, step=step)
        correct, total = evaluate(accelerator, model, test_loader)
        accelerator.log({"test_accuracy": correct / total}, step=step)
        accelerator.print(f"epoch {epoch + 1}/{epochs}: loss {sum(losses[-10:]) / len(losses[-10:]):.3f}, "
                          f"test accuracy {correct / total:.3f} ({total} images)")
    return {"rank": accelerator.process_index, "test_accuracy": correct / total, "losses": losses}


def evaluate(accelerator, model: nn.Module, test_loader) -> tuple[int, int]:
    """Correct predictions and images over the whole test set (every rank's share gathered)."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in test_loader:
            predictions = accelerator.gather_for_metrics(model(images).argmax(dim=1))
            targets = accelerator.gather_for_metrics(labels)
            correct += (predictions == targets).sum().item()
            total += targets.numel()
    return correct, total
