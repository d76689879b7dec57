"""INT8 post-training quantization to a QDQ ONNX model that TensorRT accepts, with mixed precision.

- :mod:`models.quantize.qdq`: the QDQ format TensorRT needs and :class:`QdqQuantizer`, which
  calibrates once and quantizes once with ONNX Runtime's ``quantize_static``;
- :mod:`models.quantize.ranges`: the calibrated activation ranges (entropy, percentile,
  min-max), as ONNX Runtime's calibrators compute them, in a fraction of their time and memory;
- :mod:`models.quantize.variants`: the mixed-precision variants (layers kept out of INT8),
  derived from the fully quantized model by editing its graph;
- :mod:`models.quantize.evaluate`: scoring a model on fixed samples (:class:`Evaluator`) and how
  closely its outputs follow the FP32 model's (SQNR, cosine);
- :mod:`models.quantize.search`: the mixed-precision search and :func:`quantize_model`, which
  runs calibration, sensitivity and search for the build.
"""

from __future__ import annotations

from models.quantize.evaluate import (
    POOR_OUTPUT_SQNR_DB,
    Evaluator,
    Judgement,
    LayerSensitivity,
    OutputFidelity,
    all_model_outputs,
    cosine_similarity,
    finite_or_none,
    model_outputs,
    output_fidelity,
    sqnr_db,
    top1_classes,
    warn_about_unjudged_outputs,
)
from models.quantize.qdq import (
    CALIBRATION_METHODS,
    CANDIDATE_OP_TYPES,
    QdqQuantizer,
    check_qdq_format,
    quantized_layers,
)
from models.quantize.search import (
    QuantizeConfig,
    QuantizeResult,
    measure_sensitivity,
    quantize_model,
    search_mixed_precision,
    warn_if_too_few_predictions,
)

__all__ = [
    "CALIBRATION_METHODS",
    "CANDIDATE_OP_TYPES",
    "POOR_OUTPUT_SQNR_DB",
    "Evaluator",
    "Judgement",
    "LayerSensitivity",
    "OutputFidelity",
    "QdqQuantizer",
    "QuantizeConfig",
    "QuantizeResult",
    "all_model_outputs",
    "check_qdq_format",
    "cosine_similarity",
    "finite_or_none",
    "measure_sensitivity",
    "model_outputs",
    "output_fidelity",
    "quantize_model",
    "quantized_layers",
    "search_mixed_precision",
    "sqnr_db",
    "top1_classes",
    "warn_about_unjudged_outputs",
    "warn_if_too_few_predictions",
]
