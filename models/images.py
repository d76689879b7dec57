"""Calibration images: decoding image files and turning them into model inputs with a
preprocessing spec (the same spec is recorded in the bundle for the device's clients).

A spec is a JSON file (``preprocessing.json`` in the calibration directory by default)::

    {"resize": [224, 224], "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
     "channel_order": "RGB", "scale": 0.00392156862745098}

Each image is decoded to 8-bit RGB, resized with bilinear filtering to ``resize`` (height, width),
multiplied by ``scale`` (default 1/255), normalised per channel with ``mean`` and ``std`` (given in
``channel_order``), reordered to that channel order and laid out C x H x W, or H x W x C when
``layout`` is ``"NHWC"`` (without ``layout``, the model input's layout decides: see
``models.calibration.from_directory``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import CalibrationError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp")
SPEC_FILE = "preprocessing.json"
_KEYS = {"resize", "mean", "std", "channel_order", "scale", "layout"}


@dataclass(frozen=True)
class ImagePreprocessing:
    """How an image file becomes one C x H x W (or H x W x C) float32 sample."""

    resize: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    channel_order: str = "RGB"
    scale: float = 1.0 / 255.0
    layout: str | None = None  # "NCHW" or "NHWC"; None: the model input's

    @classmethod
    def from_file(cls, path: Path) -> ImagePreprocessing:
        """Read and validate a spec; errors name the file and the field."""
        try:
            document = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CalibrationError(
                "calibration images need a preprocessing spec (resize, mean, std, channel_order)",
                path=path) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"cannot read preprocessing spec: {exc}", path=path) from None
        except RecursionError:
            raise CalibrationError("preprocessing spec is nested too deeply", path=path) from None
        if not isinstance(document, dict):
            raise CalibrationError("preprocessing spec must be a JSON object", path=path)
        unknown = sorted(set(document) - _KEYS)
        if unknown:
            raise CalibrationError("unknown preprocessing field", path=path, found=unknown,
                                   expected=sorted(_KEYS))

        def field(name: str, default: Any = None) -> Any:
            if name not in document and default is None:
                raise CalibrationError("preprocessing spec misses a field", path=path, field=name)
            return document.get(name, default)

        def numbers(name: str, count: int, *, positive: bool = False) -> tuple[float, ...]:
            value = field(name)
            if (not isinstance(value, list) or len(value) != count
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                               and math.isfinite(v) for v in value)
                    or (positive and not all(v > 0 for v in value))):
                rule = f"a list of {count} finite {'positive ' if positive else ''}numbers"
                raise CalibrationError("invalid preprocessing field", path=path, field=name,
                                       expected=rule, found=value)
            return tuple(float(v) for v in value)

        resize = numbers("resize", 2, positive=True)
        if not all(v.is_integer() for v in resize):
            raise CalibrationError("invalid preprocessing field", path=path, field="resize",
                                   expected="two positive integers", found=list(resize))
        order = field("channel_order", "RGB")
        if order not in ("RGB", "BGR"):
            raise CalibrationError("invalid preprocessing field", path=path,
                                   field="channel_order", expected="RGB or BGR", found=order)
        scale = field("scale", 1.0 / 255.0)
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not math.isfinite(scale) or scale <= 0):
            raise CalibrationError("invalid preprocessing field", path=path, field="scale",
                                   expected="a finite positive number", found=scale)
        layout = document.get("layout")  # optional: the model input's layout decides
        if layout not in (None, "NCHW", "NHWC"):
            raise CalibrationError("invalid preprocessing field", path=path, field="layout",
                                   expected="NCHW or NHWC", found=layout)
        mean = numbers("mean", 3)
        std = numbers("std", 3, positive=True)
        return cls((int(resize[0]), int(resize[1])), (mean[0], mean[1], mean[2]),
                   (std[0], std[1], std[2]), order, float(scale), layout)

    def load(self, path: Path) -> np.ndarray:
        """Decode, resize and normalise one image file to 3 x H x W float32 (H x W x 3 for an
        NHWC ``layout``)."""
        image_module = require("PIL.Image", extra="host", purpose="reading calibration images")
        try:
            with image_module.open(path) as image:
                rgb = image.convert("RGB").resize((self.resize[1], self.resize[0]),
                                                  image_module.Resampling.BILINEAR)
                pixels = np.asarray(rgb, dtype=np.float32)
        except (OSError, ValueError, image_module.DecompressionBombError) as exc:
            raise CalibrationError(f"cannot decode calibration image: {exc}", path=path) from None
        if self.channel_order == "BGR":
            pixels = pixels[:, :, ::-1]
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        normalised = (pixels * np.float32(self.scale) - mean) / std
        if self.layout == "NHWC":
            return np.ascontiguousarray(normalised)
        return np.ascontiguousarray(normalised.transpose(2, 0, 1))

    def to_manifest(self) -> dict[str, Any]:
        document = asdict(self)
        document["resize"] = list(self.resize)
        document["mean"] = list(self.mean)
        document["std"] = list(self.std)
        return document
