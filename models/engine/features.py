"""Which parts of the build API the installed TensorRT has, decided from its version string.

8.5 (JetPack 5.1) needs ``EXPLICIT_BATCH``; 8.6 adds the builder optimization level; 10.0 the
progress monitor; 11.x drops weak typing (precision flags and per-layer precision).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from agent.errors import EngineError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorRTFeatures:
    """The version-dependent parts of the build API, decided from ``trt.__version__``."""

    version: tuple[int, int, int]
    # 8.x: the ONNX parser only accepts networks created with EXPLICIT_BATCH.
    needs_explicit_batch: bool
    # < 11: BuilderFlag.INT8/FP16, layer.precision and the precision-constraint flags exist.
    weak_typing: bool
    # 8.6+: IBuilderConfig.builder_optimization_level.
    optimization_level: bool
    # 10.0+: IBuilderConfig.progress_monitor (progress reports, and a build that can be stopped).
    progress_monitor: bool = False

    @classmethod
    def from_version(cls, text: str) -> TensorRTFeatures:
        match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
        if match is None:
            raise EngineError("cannot parse the TensorRT version", found=text)
        version = (int(match[1]), int(match[2]), int(match[3] or 0))
        if version < (8, 5, 0):
            raise EngineError("TensorRT 8.5 (JetPack 5.1) or newer is needed", found=text)
        if version[0] in (9,) or version[0] > 11:
            # 9.x was a data-centre-only line and 12+ does not exist yet; the 11.x rules
            # (strong typing) are the safer guess for anything newer than 10.
            log.warning(
                "TensorRT %s is not a tested release; applying the %s rules",
                text,
                "10.x" if version[0] == 9 else "11.x",
            )
        return cls(
            version=version,
            needs_explicit_batch=version[0] < 10,
            weak_typing=version[0] < 11,
            optimization_level=version >= (8, 6, 0),
            progress_monitor=version >= (10, 0, 0),
        )
