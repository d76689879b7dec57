"""``edge-agent build``: trained model -> pruned -> ONNX -> INT8 with mixed precision -> signed bundle.

The package's face: callers import from here. The build runs in :mod:`models.pipeline.orchestrate`;
beside it, :mod:`~models.pipeline.options` (what to build), :mod:`~models.pipeline.sources` (the
three model sources), :mod:`~models.pipeline.frames` (frame sizes), :mod:`~models.pipeline.profile` (the engine
profile, found by running the model or given with :mod:`~models.pipeline.profile_shape`),
:mod:`~models.pipeline.report` (the report and the terminal summary),
:mod:`~models.pipeline.keys` (the signing key), :mod:`~models.pipeline.outdir` (the output
directory, the bundle's name and version) and :mod:`~models.pipeline.stages` (stage timings).
"""

from __future__ import annotations

from models.pipeline.frames import frame_size
from models.pipeline.options import (CHECK_SAMPLES, EXAMPLE_FRAME, MAX_BATCH, MAX_FRAME,
                                     MAX_PRUNE_RATIO, MIN_AGENT_VERSION, MIN_FRAME, BuildOptions,
                                     BuildResult)
from models.pipeline.orchestrate import build
from models.pipeline.outdir import next_version
from models.pipeline.profile import choose_engine_profile
from models.pipeline.profile_shape import ProfileShape, parse_profile_shape
from models.pipeline.report import format_summary
from models.pipeline.sources import prune_and_finetune

__all__ = [
    "CHECK_SAMPLES",
    "EXAMPLE_FRAME",
    "MAX_BATCH",
    "MAX_FRAME",
    "MAX_PRUNE_RATIO",
    "MIN_AGENT_VERSION",
    "MIN_FRAME",
    "BuildOptions",
    "BuildResult",
    "ProfileShape",
    "build",
    "choose_engine_profile",
    "format_summary",
    "frame_size",
    "next_version",
    "parse_profile_shape",
    "prune_and_finetune",
]
