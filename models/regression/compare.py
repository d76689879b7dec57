"""INT8 against FP32 on held-out samples, measured here with ONNX Runtime and nothing from the
build: the published FP32 file and the bundle's INT8 model are both run on every sample, and each
output is compared.

Samples are run one at a time, so that no batch axis has to be trusted: a model whose graph fixes
the batch at B gets the sample repeated B times (all B rows are then the same), and a time-major
output ``[T, B, C]`` compares as well as a batch-major one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from models.quantize.measures import steadied_cosines

__all__ = ["OutputScore", "compare_models", "cosine"]


@dataclass(frozen=True)
class OutputScore:
    """One output's fidelity: cosine similarity of INT8 to FP32 per sample (mean and worst), and
    for class scores the share of decisions (argmax) that agree."""

    name: str
    cosine: float
    worst_cosine: float
    agreement: float | None = None
    plain_cosine: float | None = None  # without the floor for near-empty samples

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "cosine": round(self.cosine, 5),
                "worst_cosine": round(self.worst_cosine, 5),
                "plain_cosine": None if self.plain_cosine is None else round(self.plain_cosine, 5),
                "agreement": None if self.agreement is None else round(self.agreement, 5)}


def cosine(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Cosine similarity of two arrays taken as vectors; two all-zero arrays are identical."""
    left = reference.astype(np.float64).ravel()
    right = candidate.astype(np.float64).ravel()
    norms = float(np.linalg.norm(left) * np.linalg.norm(right))
    if norms == 0.0:
        return 1.0 if not left.any() and not right.any() else 0.0
    return float(np.dot(left, right) / norms)


def _fixed_batch(session: Any) -> int:
    first = session.get_inputs()[0].shape[0]
    return first if isinstance(first, int) and first > 0 else 1


def _run(session: Any, name: str, sample: np.ndarray) -> list[np.ndarray]:
    batch = np.repeat(sample[None], _fixed_batch(session), axis=0)
    return [np.asarray(output) for output in session.run(None, {name: batch})]


def _common_view(reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two outputs cut to the same shape where they differ only in how many copies of the
    sample they hold (FP32 fixed at batch 10, INT8 made dynamic and run at 1)."""
    if reference.shape == candidate.shape or reference.ndim != candidate.ndim:
        return reference, candidate
    common = tuple(min(left, right) for left, right in zip(reference.shape, candidate.shape))
    cut = tuple(slice(0, size) for size in common)
    return reference[cut], candidate[cut]


def compare_models(reference: Any, candidate: Any, samples: np.ndarray,
                   decisions: dict[int, int]) -> list[OutputScore]:
    """Each output of ``candidate`` (an ONNX Runtime session) against ``reference`` on every
    sample (samples x sample shape).

    Args:
        decisions: Output index to the axis whose argmax is a decision (class scores).

    Raises:
        ValueError: The two models do not have the same outputs, or shapes that can be compared.
    """
    input_name = reference.get_inputs()[0].name
    candidate_input = candidate.get_inputs()[0].name
    names = [output.name for output in reference.get_outputs()]
    if len(candidate.get_outputs()) != len(names):
        raise ValueError(f"the INT8 model has {len(candidate.get_outputs())} outputs, "
                         f"the FP32 model {len(names)}")
    cosines: list[list[float]] = [[] for _ in names]
    pairs: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in names]
    agreements: dict[int, list[float]] = {index: [] for index in decisions}
    for sample in samples:
        for index, (fp32, int8) in enumerate(zip(_run(reference, input_name, sample),
                                                 _run(candidate, candidate_input, sample))):
            fp32, int8 = _common_view(fp32, int8)
            if fp32.shape != int8.shape:
                raise ValueError(f"output {names[index]}: FP32 shape {list(fp32.shape)}, "
                                 f"INT8 shape {list(int8.shape)}")
            cosines[index].append(cosine(fp32, int8))
            pairs[index].append((fp32, int8))
            if index in agreements:
                axis = decisions[index]
                agreements[index].append(float(np.mean(fp32.argmax(axis) == int8.argmax(axis))))
    scores = []
    for index, (name, values) in enumerate(zip(names, cosines)):
        # Steadied as the build's judges take it (models.quantize.measures): a sample whose
        # FP32 output is almost all zero (a probability map of a photo without text) agrees
        # when the INT8 one is almost zero too, whatever the direction of the two noises.
        steadied = steadied_cosines(np.stack([fp32 for fp32, _ in pairs[index]]),
                                    np.stack([int8 for _, int8 in pairs[index]]))
        scores.append(OutputScore(
            name, float(np.mean(steadied)), float(np.min(steadied)),
            float(np.mean(agreements[index])) if index in agreements else None,
            plain_cosine=float(np.mean(values))))
    return scores
