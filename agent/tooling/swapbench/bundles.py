"""The benchmark's own signing key and signed bundles of the tiny classifier, one per version, so
that ``edge-agent bench swap`` needs nothing but a fresh machine.

Every healthy version carries the same weights: the canary compares a new version's decisions
with the serving one's, and identical models always agree, so a healthy swap is never refused by
chance. The misbehaving versions differ only by their fault (agent/tooling/swapbench/
onnx_writer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.tooling.swapbench.onnx_writer import CLASSES, write_classifier

MODEL_NAME = "tiny"
FRAME_SHAPE = (3, 16, 16)  # one request's frame, batch axis excluded


def manifest(version: int) -> dict[str, Any]:
    """The tiny classifier's manifest at ``version``."""
    return {
        "name": MODEL_NAME,
        "version": version,
        "inputs": [{"name": "input", "dtype": "float32", "shape": [-1, 3, -1, -1],
                    "layout": "NCHW"}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [-1, CLASSES]}],
        "preprocessing": {"resize": list(FRAME_SHAPE[1:]), "mean": [0.5] * 3, "std": [0.25] * 3,
                          "channel_order": "RGB"},
        "precision": {"int8_layers": [], "fp16_layers": [], "fp32_layers": ["conv", "fc"]},
        "max_batch": 16,
        "opt_batch": 4,
        "engine_profile": {"batch": [1, 4, 16], "height": [8, 16, 64], "width": [8, 16, 64]},
        "calibration": {"method": "minmax", "samples": 1, "data_sha256": "00" * 32},
        "accuracy": {},
        "engines": {},
        "min_agent_version": "0.1.0",
    }


class BundleMaker:
    """Makes the signing key pair under ``directory`` and signed bundles there on demand.

    Args:
        directory: Where the key pair, the ONNX files and the bundles go (a temporary folder).
    """

    def __init__(self, directory: Path) -> None:
        from models.signing import write_keypair

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.private_key_path = directory / "bench.key"
        self._key = write_keypair(self.private_key_path)
        self.public_key_path = Path(str(self.private_key_path) + ".pub")
        self._models: dict[str | None, Path] = {}

    def _model(self, fault: str | None) -> Path:
        path = self._models.get(fault)
        if path is None:
            path = write_classifier(self.directory / f"model-{fault or 'healthy'}.onnx",
                                    fault=fault)
            self._models[fault] = path
        return path

    def bundle(self, version: int, *, fault: str | None = None) -> Path:
        """A signed bundle of the classifier at ``version`` (with ``fault``, or healthy)."""
        from models.bundle import pack_bundle

        path = self.directory / f"{MODEL_NAME}-{version}{'-' + fault if fault else ''}.bundle"
        pack_bundle(path, manifest(version), {"model.onnx": self._model(fault)}, self._key)
        return path


__all__ = ["FRAME_SHAPE", "MODEL_NAME", "BundleMaker", "manifest"]
