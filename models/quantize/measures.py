"""The measures judges score outputs by: top-1 classes, the F1 of decisions, SQNR and the
cosine per sample (steadied for near-empty samples), each of an output against the FP32 model's.
"""

from __future__ import annotations

import math

import numpy as np



def top1_classes(outputs: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Predicted class per sample: the argmax over ``axis``, or over each sample's values
    flattened (outputs beyond 2-D, and the default)."""
    if axis is not None and outputs.ndim == 2:
        return outputs.argmax(axis=axis)
    return outputs.reshape(outputs.shape[0], -1).argmax(axis=1)


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``reference``, in dB (infinite
    when they are equal; positions where both hold the same infinity are left out)."""
    want, got = _comparable(reference, test)
    noise = float(np.sum((want - got) ** 2))
    signal = float(np.sum(want ** 2))
    if noise == 0.0:
        return float("inf")
    if not math.isfinite(noise):
        return float("-inf")
    return 10.0 * float(np.log10(max(signal, 1e-30) / noise))


# A sample whose FP32 and INT8 values are both tiny next to a typical sample (a heatmap with
# nothing in it) has no direction worth comparing: the cosine is taken with this share of the
# samples' root-mean-square norm added as a common component, so such a pair agrees (two empty
# samples score 1) while a sample with content moves by less than 0.1%.
COSINE_FLOOR = 0.03


def cosine_score(reference: np.ndarray, test: np.ndarray) -> float:
    """Mean over samples (axis 0) of the cosine between each sample's FP32 and candidate values,
    steadied for near-empty samples (:data:`COSINE_FLOOR`): robust to sparse maps that are zero
    almost everywhere, where a relative error over the whole map is not."""
    cosines = steadied_cosines(reference, test)
    return float(np.clip(np.mean(cosines), -1.0, 1.0)) if cosines.size else 1.0


def steadied_cosines(reference: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Each sample's cosine as :func:`cosine_score` takes it: a floor of :data:`COSINE_FLOOR`
    of the samples' mean energy is added to both sides, so that a sample whose FP32 values are
    almost all zero (a probability map of a photo with no text, values of 1e-6) is judged by
    whether the candidate is almost zero too, not by the direction of its noise."""
    want, got = _comparable(reference, test)
    if want.shape[0] == 0:
        return np.zeros(0)
    want = want.reshape(want.shape[0], -1)
    got = got.reshape(got.shape[0], -1)
    if not np.isfinite(got).all():
        return np.zeros(want.shape[0])
    want_norms = np.einsum("ij,ij->i", want, want)
    got_norms = np.einsum("ij,ij->i", got, got)
    floor = (COSINE_FLOOR ** 2) * float(np.mean(want_norms))
    if floor == 0.0:
        floor = 1e-30  # every FP32 sample is zero: the candidate agrees only where it is zero too
    return (np.einsum("ij,ij->i", want, got) + floor) / np.sqrt(
        (want_norms + floor) * (got_norms + floor))


def cosine_similarity(reference: np.ndarray, test: np.ndarray) -> float:
    """Plain mean cosine per sample (axis 0), without :func:`cosine_score`'s floor."""
    a = reference.reshape(reference.shape[0], -1).astype(np.float64)
    b = test.reshape(test.shape[0], -1).astype(np.float64)
    numerator = np.sum(a * b, axis=1)
    denominator = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.mean(numerator / np.maximum(denominator, 1e-30)))


def _comparable(reference: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64, with the positions where they hold the same non-finite value (the log
    of a zero, in both models) set to zero."""
    want = np.asarray(reference, dtype=np.float64)
    got = np.asarray(test, dtype=np.float64)
    same = ~np.isfinite(want) & ((want == got) | (np.isnan(want) & np.isnan(got)))
    if same.any():
        want, got = np.where(same, 0.0, want), np.where(same, 0.0, got)
    return want, got


def decision_f1(reference: np.ndarray, test: np.ndarray, threshold: float) -> float:
    """The F1 score (Dice), in percent, of the positions where the candidate is above
    ``threshold`` against those where FP32 is: 100 where neither has any. A map that is below
    the threshold almost everywhere (text in a photo) keeps 99.9% of its positions' decisions
    even when INT8 loses all of it; the F1 of what is above does not. (Its IoU, F1 / (2 - F1),
    falls twice as fast: FP16 alone cost a text detector's masks 1.8 IoU points on their edges,
    0.9 of F1.)"""
    want, got = reference > threshold, test > threshold
    total = int(np.count_nonzero(want)) + int(np.count_nonzero(got))
    if total == 0:
        return 100.0
    return 200.0 * int(np.count_nonzero(want & got)) / total


def split_parts(array: np.ndarray, axis: int, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """``array`` cut along ``axis`` into pieces of ``sizes`` (the inputs a Concat joined);
    the whole array where the sizes do not add up to that axis."""
    if array.ndim <= axis or sum(sizes) != array.shape[axis]:
        return [array]
    return np.split(array, np.cumsum(sizes)[:-1], axis=axis)
