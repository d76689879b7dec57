"""The fleet benchmark's signing key and bundles: the swap benchmark's tiny classifier
(agent/tooling/swapbench/onnx_writer.py, 1.7 kB of ONNX) at versions 1, 2 and 3, and a
misbehaving version whose outputs are NaN for every input.

The misbehaving version differs from the healthy ones only by its classifier's bias, which is
NaN: the graph loads, runs and answers with the right shapes, and every logit it gives is NaN,
zeros included, so the warm-up batch of zeros that the update's ``warming`` step runs refuses it
(reason ``non_finite``) before it ever serves. The swap benchmark's ``nan_on_negative`` fault
would pass that warm-up (its NaN needs a negative input), which is the watch window's case, not
this benchmark's: a fleet has no live traffic here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.tooling.swapbench import onnx_writer as onnx
from agent.tooling.swapbench.bundles import MODEL_NAME, manifest

__all__ = ["MODEL_NAME", "FleetBundles", "non_finite_classifier_bytes"]


def non_finite_classifier_bytes(*, seed: int = 0) -> bytes:
    """The tiny classifier's ModelProto (the healthy graph, weights from ``seed``) with a NaN
    bias in its last layer: every output is NaN."""
    rng = np.random.default_rng(seed)
    conv_w = rng.normal(0, 0.5, (onnx.FEATURES, 3, 3, 3)).astype(np.float32)
    conv_b = rng.normal(0, 0.1, onnx.FEATURES).astype(np.float32)
    fc_w = rng.normal(0, 0.5, (onnx.CLASSES, onnx.FEATURES)).astype(np.float32)
    fc_b = np.full(onnx.CLASSES, np.nan, dtype=np.float32)
    initializers = [onnx._tensor("conv_w", conv_w), onnx._tensor("conv_b", conv_b),
                    onnx._tensor("fc_w", fc_w), onnx._tensor("fc_b", fc_b)]
    nodes = [
        onnx._node("Conv", ["input", "conv_w", "conv_b"], ["conv"], "conv",
                   [onnx._attribute_ints("pads", [1, 1, 1, 1])]),
        onnx._node("Relu", ["conv"], ["relu"], "relu"),
        onnx._node("GlobalAveragePool", ["relu"], ["pool"], "pool"),
        onnx._node("Flatten", ["pool"], ["flat"], "flatten"),
        onnx._node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], "fc",
                   [onnx._attribute_int("transB", 1)]),
    ]
    # The same GraphProto and ModelProto fields as onnx_writer.classifier_bytes.
    graph = (onnx._messages(1, nodes) + onnx._text(2, "tiny")
             + onnx._messages(5, initializers)
             + onnx._bytes(11, onnx._value_info("input", ["batch", 3, "height", "width"]))
             + onnx._bytes(12, onnx._value_info("logits", ["batch", onnx.CLASSES])))
    opset = onnx._text(1, "") + onnx._int(2, onnx.OPSET)
    return (onnx._int(1, onnx.IR_VERSION) + onnx._text(2, "edge-agent bench fleet")
            + onnx._bytes(7, graph) + onnx._bytes(8, opset))


class FleetBundles:
    """The signing key pair under ``directory`` and signed bundles made there on demand.

    Args:
        directory: Where the key pair, the ONNX files and the bundles go.
    """

    def __init__(self, directory: Path) -> None:
        from models.signing import write_keypair

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.private_key_path = directory / "release.key"
        self._key = write_keypair(self.private_key_path)
        self.public_key_path = Path(str(self.private_key_path) + ".pub")
        self.healthy_model = onnx.write_classifier(directory / "model-healthy.onnx")
        self.non_finite_model = directory / "model-non-finite.onnx"
        self.non_finite_model.write_bytes(non_finite_classifier_bytes())

    def bundle(self, version: int, *, non_finite: bool = False) -> Path:
        """A signed bundle of the classifier at ``version``: healthy, or NaN for every input."""
        from models.bundle import pack_bundle

        path = self.directory / f"{MODEL_NAME}-{version}{'-nan' if non_finite else ''}.bundle"
        model = self.non_finite_model if non_finite else self.healthy_model
        pack_bundle(path, manifest(version), {"model.onnx": model}, self._key)
        return path
