"""Deterministic training and evaluation on in-memory image data sets.

Used to train the example models and to fine-tune between pruning steps. Determinism: a fixed seed
for weights and batch order, deterministic torch algorithms, and a fixed thread count; the same
command on the same machine gives the same checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from models.data import DigitsSplit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 8
    batch_size: int = 64
    learning_rate: float = 0.05
    weight_decay: float = 5e-4
    max_shift_px: int = 2
    seed: int = 0


def set_deterministic(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def _shift_batch(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Random translation by up to ``max_shift`` pixels, padding with the background value."""
    if max_shift <= 0:
        return images
    background = images.amin()
    padded = nn.functional.pad(images, [max_shift] * 4, value=float(background))
    dx, dy = torch.randint(0, 2 * max_shift + 1, (2,), generator=generator).tolist()
    height, width = images.shape[-2:]
    return padded[..., dy : dy + height, dx : dx + width]


def train(
    model: nn.Module,
    data: DigitsSplit,
    config: TrainConfig = TrainConfig(),
    *,
    progress: bool = True,
) -> nn.Module:
    """Train ``model`` in place with SGD, momentum and a cosine schedule; returns it in eval mode."""
    set_deterministic(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    images = torch.from_numpy(data.images)
    labels = torch.from_numpy(data.labels)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=config.learning_rate,
        momentum=0.9,
        weight_decay=config.weight_decay,
        nesterov=True,
    )
    steps_per_epoch = math.ceil(len(data) / config.batch_size)
    total_steps = max(1, config.epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.learning_rate, total_steps=total_steps, pct_start=0.2
    )
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(config.epochs):
        started = time.perf_counter()
        order = torch.randperm(len(data), generator=generator)
        running = 0.0
        for start in range(0, len(data), config.batch_size):
            index = order[start : start + config.batch_size]
            batch = _shift_batch(images[index], config.max_shift_px, generator)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch), labels[index])
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += float(loss.detach()) * len(index)
        if progress:
            log.info(
                "epoch %d/%d  loss %.4f  (%.1f s)",
                epoch + 1,
                config.epochs,
                running / len(data),
                time.perf_counter() - started,
            )
    return model.eval()


@torch.no_grad()
def predict(model: nn.Module, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """Logits of ``model`` (in eval mode) for float32 NCHW images."""
    model.eval()
    outputs = [
        model(torch.from_numpy(images[start : start + batch_size])).numpy()
        for start in range(0, len(images), batch_size)
    ]
    return np.concatenate(outputs, axis=0)


def top1_accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy in percent."""
    return float((logits.argmax(axis=1) == labels).mean() * 100.0)
