"""Small shared helpers for tests (real models and data, no mocks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_samples(directory: Path, images: np.ndarray, *, prefix: str = "sample") -> Path:
    """One preprocessed C x H x W sample per .npy file, as a calibration directory holds them."""
    directory.mkdir(parents=True, exist_ok=True)
    for index, image in enumerate(images):
        np.save(directory / f"{prefix}-{index:04d}.npy", image)
    return directory
