"""The example models, by name.

``resnet18-digits`` is the demo and benchmark model: ResNet-18 trained on the digits set at 32x32.
``smallcnn-digits`` is a tiny CNN for fast tests. Checkpoints are produced by ``edge-agent train``
(deterministic, a minute or two on 2 cores) and cached under the cache directory, never committed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError


@dataclass(frozen=True)
class ZooModel:
    name: str
    factory: str  # "module:callable", called with num_classes
    num_classes: int
    train_size: int  # side of the square images it is trained and evaluated on
    epochs: int
    description: str

    def build(self):  # -> torch.nn.Module, kept untyped so this module stays torch-free
        from models.loader import resolve_callable

        return resolve_callable(self.factory)(num_classes=self.num_classes)


ZOO: dict[str, ZooModel] = {
    model.name: model
    for model in (
        ZooModel(
            name="resnet18-digits",
            factory="models.zoo.resnet:ResNet18",
            num_classes=10,
            train_size=32,
            epochs=10,
            description="ResNet-18 (standard stages and widths) trained on the digits set",
        ),
        ZooModel(
            name="smallcnn-digits",
            factory="models.zoo.small_cnn:SmallCNN",
            num_classes=10,
            train_size=16,
            epochs=6,
            description="four-layer CNN for fast tests",
        ),
    )
}


def get(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        raise ConfigError(
            f"unknown example model '{name}'", known=", ".join(sorted(ZOO))
        ) from None


def cache_dir() -> Path:
    """Where trained checkpoints are cached: ``$EDGE_AGENT_CACHE`` or ``~/.cache/edge-agent``."""
    configured = os.environ.get("EDGE_AGENT_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-agent"


def checkpoint_path(name: str) -> Path:
    return cache_dir() / "checkpoints" / f"{name}.pt"

