"""Calibration data: real, preprocessed input samples, from memory or from a directory of files.

A calibration directory holds one preprocessed sample per file: ``.npy`` (one array, for models
with one input; shape C x H x W, or 1 x C x H x W) or ``.npz`` (one array per input name, for models
with several inputs); or, for models with one image input, image files (PNG, JPEG, BMP, ...) with
a preprocessing spec (``preprocessing.json`` beside them; see :mod:`models.images`). Files are read
in name order, so the same directory always gives the same set and the same data hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.errors import CalibrationError
from models.onnx_model import TensorSpec

log = logging.getLogger(__name__)

DEFAULT_SAMPLES = 512
RECOMMENDED_MIN_SAMPLES = 500
RECOMMENDED_MAX_SAMPLES = 1000


@dataclass(frozen=True)
class CalibrationSet:
    """Samples per input name, each array N x (sample shape)."""

    arrays: dict[str, np.ndarray]
    source: str
    preprocessing: dict[str, object] | None = None  # the image spec, when built from images

    def __len__(self) -> int:
        return int(next(iter(self.arrays.values())).shape[0])

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.arrays):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(self.arrays[name]).tobytes())
        return digest.hexdigest()

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(self), batch_size):
            yield {name: array[start : start + batch_size] for name, array in self.arrays.items()}

    def to_manifest(self, method: str) -> dict[str, object]:
        return {"method": method, "samples": len(self), "data_sha256": self.sha256(), "source": self.source}


def _check_count(available: int, wanted: int, source: str, *, warn: bool = True) -> int:
    if available == 0:
        raise CalibrationError("calibration set is empty", source=source)
    if wanted < 1:
        raise CalibrationError("calibration sample count must be >= 1", found=wanted)
    if not warn:
        return min(available, wanted)
    if available < wanted:
        log.warning(
            "only %d calibration samples available (asked for %d; %d-%d recommended): "
            "INT8 ranges may be less accurate",
            available,
            wanted,
            RECOMMENDED_MIN_SAMPLES,
            RECOMMENDED_MAX_SAMPLES,
        )
        return available
    if wanted < RECOMMENDED_MIN_SAMPLES:
        log.warning(
            "calibrating on %d samples; %d-%d are recommended",
            wanted,
            RECOMMENDED_MIN_SAMPLES,
            RECOMMENDED_MAX_SAMPLES,
        )
    return wanted


def from_array(
    images: np.ndarray, input_name: str, samples: int = DEFAULT_SAMPLES, *, seed: int = 0, source: str = "memory"
) -> CalibrationSet:
    """Pick ``samples`` images (a fixed random subset) from an in-memory N x C x H x W array."""
    count = _check_count(int(images.shape[0]), samples, source)
    order = np.random.default_rng(seed).permutation(images.shape[0])[:count]
    return CalibrationSet({input_name: np.ascontiguousarray(images[np.sort(order)])}, source)


def _matches(sample_shape: tuple[int, ...], spec: TensorSpec) -> bool:
    expected = spec.shape[1:]  # the batch axis is not part of one sample
    if len(sample_shape) != len(expected):
        return False
    return all(want in (-1, got) for want, got in zip(expected, sample_shape))


def _layout_hint(sample_shape: tuple[int, ...], spec: TensorSpec) -> str:
    """A hint for an image sample given in the other layout: channels-first (C x H x W) for a
    model that takes channels-last (H x W x C), or the other way round; "" otherwise."""
    expected = spec.shape[1:]
    if len(sample_shape) != 3 or len(expected) != 3:
        return ""
    as_channels_last = (sample_shape[1], sample_shape[2], sample_shape[0])  # C,H,W -> H,W,C
    as_channels_first = (sample_shape[2], sample_shape[0], sample_shape[1])  # H,W,C -> C,H,W

    def fits(shape: tuple[int, ...]) -> bool:
        return all(want in (-1, got) for want, got in zip(expected, shape))

    if 0 < expected[2] <= 4 and fits(as_channels_last):
        return ("; the samples look channels-first (C x H x W) and the model takes channels-last "
                "(N x H x W x C): transpose each sample with .transpose(1, 2, 0)")
    if 0 < expected[0] <= 4 and fits(as_channels_first):
        return ("; the samples look channels-last (H x W x C) and the model takes channels-first "
                "(N x C x H x W): transpose each sample with .transpose(2, 0, 1)")
    return ""


def _read_file(path: Path, inputs: list[TensorSpec]) -> dict[str, np.ndarray]:
    try:
        if path.suffix.lower() == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                arrays = {name: archive[name] for name in archive.files}
        else:
            arrays = {inputs[0].name: np.load(path, allow_pickle=False)}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CalibrationError(f"cannot read calibration sample: {exc}", path=path) from exc
    if path.suffix.lower() == ".npy" and len(inputs) > 1:
        raise CalibrationError(
            "model has several inputs: give each sample as an .npz with one array per input name",
            path=path,
            inputs=", ".join(spec.name for spec in inputs),
        )
    expected_names = {spec.name for spec in inputs}
    if set(arrays) != expected_names:
        raise CalibrationError(
            "calibration sample's input names do not match the model",
            path=path,
            expected=sorted(expected_names),
            found=sorted(arrays),
        )
    checked = {}
    for spec in inputs:
        array = arrays[spec.name]
        if array.ndim == len(spec.shape) and array.shape[0] == 1:
            array = array[0]
        if not _matches(tuple(array.shape), spec):
            raise CalibrationError(
                "calibration sample has the wrong shape" + _layout_hint(tuple(array.shape), spec),
                path=path,
                input=spec.name,
                expected=["N" if dim == -1 else dim for dim in spec.shape[1:]],
                found=list(array.shape),
            )
        if array.dtype.kind not in "fiu":
            raise CalibrationError("calibration sample is not numeric", path=path, dtype=array.dtype)
        if array.size == 0:
            raise CalibrationError("calibration sample is empty", path=path, input=spec.name,
                                   found=list(array.shape))
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise CalibrationError("calibration sample holds NaN or infinite values", path=path,
                                   input=spec.name)
        checked[spec.name] = array.astype(spec.dtype, copy=False)
    return checked


def from_directory(
    directory: Path,
    inputs: list[TensorSpec],
    samples: int = DEFAULT_SAMPLES,
    *,
    preprocessing: Path | None = None,
    probe: bool = False,
) -> CalibrationSet:
    """Read up to ``samples`` files (name order) from ``directory``; see the module docstring.

    Args:
        preprocessing: The spec for image files; default ``directory/preprocessing.json``.
        probe: Reading a sample or two to learn the input's shape, not to calibrate: no warning
            about how few there are.
    """
    from models.images import IMAGE_SUFFIXES, SPEC_FILE, ImagePreprocessing

    directory = Path(directory)
    if not directory.is_dir():
        raise CalibrationError("calibration directory not found", path=directory)
    entries = sorted(path for path in directory.iterdir() if path.is_file())
    arrays_files = [path for path in entries if path.suffix.lower() in (".npy", ".npz")]
    image_files = [path for path in entries if path.suffix.lower() in IMAGE_SUFFIXES]
    if arrays_files and image_files:
        raise CalibrationError("calibration directory mixes arrays (.npy/.npz) and images",
                               path=directory)
    spec: ImagePreprocessing | None = None
    if image_files:
        if len(inputs) != 1:
            raise CalibrationError("image calibration needs a model with one input; give .npz "
                                   "samples instead", path=directory,
                                   inputs=", ".join(item.name for item in inputs))
        spec = ImagePreprocessing.from_file(preprocessing or directory / SPEC_FILE)
        if spec.layout is None:
            spec = dataclasses.replace(spec, layout=_image_layout(inputs[0]))
    elif preprocessing is not None:
        raise CalibrationError("a preprocessing spec applies to calibration images, but the "
                               "directory holds arrays (.npy/.npz), which are used as they are",
                               path=directory, spec=preprocessing)
    files = image_files or arrays_files
    count = _check_count(len(files), samples, str(directory), warn=not probe)
    per_input: dict[str, list[np.ndarray]] = {item.name: [] for item in inputs}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files[:count]:
        sample = _read_image(path, spec, inputs[0]) if spec else _read_file(path, inputs)
        for name, array in sample.items():
            if shapes.setdefault(name, array.shape) != array.shape:
                # One batch must stack: all samples of an input share a shape.
                raise CalibrationError(
                    "calibration samples differ in shape",
                    path=path,
                    input=name,
                    expected=list(shapes[name]),
                    found=list(array.shape),
                )
            per_input[name].append(array)
    arrays = {name: np.stack(values) for name, values in per_input.items()}
    log.info("read %d calibration %s from %s", count, "images" if spec else "samples", directory)
    if not probe:
        warn_about_copies(arrays, str(directory))
    return CalibrationSet(arrays, str(directory), spec.to_manifest() if spec else None)


def warn_about_copies(arrays: dict[str, np.ndarray], source: str) -> int:
    """Warn when some calibration samples are exact copies of others (a frame dumped repeatedly,
    a broken export loop): the INT8 ranges and the accuracy check then rest on fewer distinct
    samples than the count says, and agreement on copies proves little. Returns the distinct
    sample count."""
    count = len(next(iter(arrays.values())))
    digests = set()
    for index in range(count):
        digest = hashlib.sha256()
        for name in sorted(arrays):
            digest.update(np.ascontiguousarray(arrays[name][index]).tobytes())
        digests.add(digest.digest())
    if len(digests) < count:
        log.warning("%d of the %d calibration samples from %s are copies of others: calibration "
                    "and the accuracy check rest on %d distinct samples", count - len(digests),
                    count, source, len(digests))
    return len(digests)


def _image_layout(input_spec: TensorSpec) -> str:
    """The layout calibration images are given for a model input: NHWC when its last axis holds
    3 channels and axis 1 does not, else NCHW."""
    shape = input_spec.shape
    if len(shape) == 4 and shape[3] == 3 and shape[1] != 3:
        return "NHWC"
    return "NCHW"


def _read_image(path: Path, spec: Any, input_spec: TensorSpec) -> dict[str, np.ndarray]:
    array = spec.load(path)
    if not _matches(tuple(array.shape), input_spec):
        raise CalibrationError(
            "preprocessed image does not fit the model input",
            path=path,
            input=input_spec.name,
            expected=["N" if dim == -1 else dim for dim in input_spec.shape[1:]],
            found=list(array.shape),
        )
    return {input_spec.name: array.astype(input_spec.dtype, copy=False)}
