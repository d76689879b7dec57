"""The example data set: scikit-learn's handwritten digits, as 3-channel images.

1,797 real 8x8 grey images of the digits 0-9 (values 0-16) ship inside scikit-learn, so tests and the
demo need no download. They are scaled to [0, 1], resized bilinearly to ``size`` x ``size``,
replicated to 3 channels and normalised with the :data:`DIGITS_PREPROCESSING` spec. The
train/held-out split is fixed (stratified, seed 0), so every run evaluates on the same 360 images.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np

from agent.deps import require

HELD_OUT_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass(frozen=True)
class Preprocessing:
    """How a raw image becomes a model input; recorded in the bundle's manifest."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    channel_order: str = "RGB"
    layout: str = "NCHW"
    scale: float = 1.0 / 16.0  # raw digits pixels are 0..16

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def digits_preprocessing(size: int = 32) -> Preprocessing:
    return Preprocessing(size=size, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


@dataclass(frozen=True)
class DigitsSplit:
    """Images (float32, N x 3 x size x size, normalised) and integer labels."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def fingerprint(self) -> str:
        """sha256 of the exact input bytes, recorded as the calibration data hash."""
        digest = hashlib.sha256(np.ascontiguousarray(self.images).tobytes())
        digest.update(np.ascontiguousarray(self.labels).tobytes())
        return digest.hexdigest()


def _bilinear_matrix(source: int, target: int) -> np.ndarray:
    """A (target x source) matrix that resamples one axis bilinearly (half-pixel centres)."""
    positions = (np.arange(target) + 0.5) * source / target - 0.5
    positions = np.clip(positions, 0, source - 1)
    lower = np.floor(positions).astype(int)
    upper = np.minimum(lower + 1, source - 1)
    weight_upper = positions - lower
    matrix = np.zeros((target, source), dtype=np.float64)
    matrix[np.arange(target), lower] += 1.0 - weight_upper
    matrix[np.arange(target), upper] += weight_upper
    return matrix


def resize_bilinear(images: np.ndarray, size: int) -> np.ndarray:
    """Resize a batch of square grey images (N x H x W) to N x size x size."""
    rows = _bilinear_matrix(images.shape[1], size)
    cols = _bilinear_matrix(images.shape[2], size)
    return np.einsum("ih,nhw,jw->nij", rows, images, cols)


def preprocess(raw: np.ndarray, spec: Preprocessing) -> np.ndarray:
    """Turn raw grey digits (N x 8 x 8, values 0..16) into normalised N x 3 x S x S float32."""
    grey = resize_bilinear(raw.astype(np.float64) * spec.scale, spec.size)
    rgb = np.repeat(grey[:, None, :, :], 3, axis=1)
    mean = np.asarray(spec.mean).reshape(1, 3, 1, 1)
    std = np.asarray(spec.std).reshape(1, 3, 1, 1)
    return ((rgb - mean) / std).astype(np.float32)


def load_digits_splits(size: int = 32) -> tuple[DigitsSplit, DigitsSplit]:
    """Return the fixed (train, held-out) splits at ``size`` x ``size``."""
    datasets = require("sklearn.datasets", extra="host", purpose="the digits example data")
    model_selection = require("sklearn.model_selection", extra="host", purpose="the digits split")
    digits = datasets.load_digits()
    raw = digits.images.astype(np.float32)
    labels = digits.target.astype(np.int64)
    train_idx, held_idx = model_selection.train_test_split(
        np.arange(len(labels)),
        test_size=HELD_OUT_FRACTION,
        random_state=SPLIT_SEED,
        stratify=labels,
    )
    spec = digits_preprocessing(size)
    return (
        DigitsSplit(preprocess(raw[train_idx], spec), labels[train_idx]),
        DigitsSplit(preprocess(raw[held_idx], spec), labels[held_idx]),
    )
