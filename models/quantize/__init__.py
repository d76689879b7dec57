"""INT8 post-training quantization to a QDQ ONNX model that TensorRT accepts, with mixed precision.

- :mod:`models.quantize.qdq`: the QDQ format TensorRT needs and :class:`QdqQuantizer`, which
  calibrates once and quantizes once with ONNX Runtime's ``quantize_static``;
- :mod:`models.quantize.ranges`: the calibrated activation ranges (entropy, percentile,
  min-max), as ONNX Runtime's calibrators compute them, in a fraction of their time and memory;
- :mod:`models.quantize.variants`: the mixed-precision variants (layers kept out of INT8),
  derived from the fully quantized model by editing its graph;
- :mod:`models.quantize.judges`: how each output is judged against FP32 (by what it is, or as
  the user says: ``--output-metric``, ``--evaluator``), from what the graph tells
  (:mod:`~models.quantize.graph_facts`) and with the measures of
  :mod:`~models.quantize.measures`;
- :mod:`models.quantize.evaluate`: running models on fixed samples and judging every output
  (:class:`Evaluator`);
- :mod:`models.quantize.fp16`: kept-out layers judged as the board runs them, in FP16;
- :mod:`models.quantize.search`: the mixed-precision search and :func:`quantize_model`, which
  runs calibration, sensitivity and search for the build.
"""

from __future__ import annotations

from models.quantize.evaluate import (
    POOR_OUTPUT_SQNR_DB,
    Evaluator,
    LayerSensitivity,
    OutputFidelity,
    Verdict,
    all_model_outputs,
    fidelity,
    finite_or_none,
    model_outputs,
    output_fidelity,
    warn_about_unjudged_outputs,
)
from models.quantize.graph_facts import OutputFacts, output_facts
from models.quantize.judges import (
    DEFAULT_MIN_COSINE,
    DEFAULT_MIN_SQNR_DB,
    USER_METRICS,
    CustomJudge,
    OutputJudge,
    OutputMetric,
    choose_judges,
)
from models.quantize.measures import (
    cosine_score,
    cosine_similarity,
    decision_f1,
    sqnr_db,
    top1_classes,
)
from models.quantize.qdq import (
    CALIBRATION_METHODS,
    CANDIDATE_OP_TYPES,
    QdqQuantizer,
    check_qdq_format,
    quantized_layers,
)
from models.quantize.search import (
    BudgetUnreachableError,
    QuantizeConfig,
    QuantizeResult,
    format_sensitivity,
    measure_sensitivity,
    quantize_model,
    rank_layers,
    search_mixed_precision,
    too_few_predictions,
    warn_if_too_few_predictions,
)

__all__ = [
    "CALIBRATION_METHODS",
    "CANDIDATE_OP_TYPES",
    "DEFAULT_MIN_COSINE",
    "DEFAULT_MIN_SQNR_DB",
    "POOR_OUTPUT_SQNR_DB",
    "USER_METRICS",
    "BudgetUnreachableError",
    "CustomJudge",
    "Evaluator",
    "LayerSensitivity",
    "OutputFacts",
    "OutputFidelity",
    "OutputJudge",
    "OutputMetric",
    "QdqQuantizer",
    "QuantizeConfig",
    "QuantizeResult",
    "Verdict",
    "all_model_outputs",
    "check_qdq_format",
    "choose_judges",
    "cosine_score",
    "cosine_similarity",
    "decision_f1",
    "fidelity",
    "finite_or_none",
    "format_sensitivity",
    "measure_sensitivity",
    "model_outputs",
    "output_facts",
    "output_fidelity",
    "quantize_model",
    "quantized_layers",
    "rank_layers",
    "search_mixed_precision",
    "sqnr_db",
    "too_few_predictions",
    "top1_classes",
    "warn_about_unjudged_outputs",
    "warn_if_too_few_predictions",
]
