"""Trained checkpoints of the example models: produced by a command, cached, never committed."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from agent.fsutil import atomic_output_file
from models import zoo

log = logging.getLogger(__name__)


def train_example(name: str, *, force: bool = False, threads: int = 2) -> Path:
    """Train the zoo model ``name`` on the digits set (deterministic) and cache its checkpoint.

    Returns the cached checkpoint; an existing one is reused unless ``force``.
    """
    import torch

    from models.data import load_digits_splits
    from models.train import TrainConfig, predict, top1_accuracy, train

    spec = zoo.get(name)
    path = zoo.checkpoint_path(name)
    if path.exists() and not force:
        log.info("using cached checkpoint %s", path)
        return path
    torch.set_num_threads(threads)
    train_split, held_out = load_digits_splits(spec.train_size)
    torch.manual_seed(0)
    model = spec.build()
    log.info("training %s on %d digits at %dx%d (%d epochs)", name, len(train_split),
             spec.train_size, spec.train_size, spec.epochs)
    started = time.perf_counter()
    train(model, train_split, TrainConfig(epochs=spec.epochs))
    accuracy = top1_accuracy(predict(model, held_out.images), held_out.labels)
    log.info("trained %s in %.0f s: held-out top-1 %.2f%%", name, time.perf_counter() - started, accuracy)
    with atomic_output_file(path) as tmp:
        torch.save(model.state_dict(), tmp)
    return path


def load_example(name: str, *, threads: int = 2):  # -> nn.Module
    """The trained zoo model ``name``, training it first if no checkpoint is cached."""
    from models.loader import load_state_dict

    spec = zoo.get(name)
    path = train_example(name, threads=threads)
    model = spec.build()
    model.load_state_dict(load_state_dict(path))
    return model.eval()
