"""Calibration from image files with a preprocessing spec (``models/images.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.errors import CalibrationError
from models.calibration import from_directory
from models.onnx_model import TensorSpec

Image = pytest.importorskip("PIL.Image")

DYNAMIC = TensorSpec("input", "float32", (-1, 3, -1, -1), ("batch", "", "height", "width"))
FIXED = TensorSpec("input", "float32", (-1, 3, 12, 10), ("batch", "", "", ""))
SPEC = {"resize": [12, 10], "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.5],
        "channel_order": "RGB"}


def write_images(directory: Path, count: int, *, spec: dict | None = SPEC,
                 size: tuple[int, int] = (20, 16)) -> np.ndarray:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, size=(count, size[1], size[0], 3), dtype=np.uint8)
    for index, image in enumerate(pixels):
        Image.fromarray(image).save(directory / f"frame{index:03d}.png")
    if spec is not None:
        (directory / "preprocessing.json").write_text(json.dumps(spec))
    return pixels


def expected_sample(image: np.ndarray, spec: dict) -> np.ndarray:
    """The spec applied independently: bilinear resize by Pillow, then scale and normalise."""
    height, width = spec["resize"]
    resized = np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.BILINEAR),
                         dtype=np.float32)
    if spec.get("channel_order") == "BGR":
        resized = resized[:, :, ::-1]
    normalised = (resized / 255.0 - np.array(spec["mean"])) / np.array(spec["std"])
    return normalised.transpose(2, 0, 1).astype(np.float32)


def test_images_become_normalised_chw_samples_and_record_the_spec(tmp_path: Path) -> None:
    pixels = write_images(tmp_path / "calib", 5)
    data = from_directory(tmp_path / "calib", [FIXED], samples=5)
    assert data.arrays["input"].shape == (5, 3, 12, 10)
    for index in range(5):
        np.testing.assert_allclose(data.arrays["input"][index], expected_sample(pixels[index], SPEC),
                                   rtol=1e-5, atol=1e-5)
    assert data.preprocessing["resize"] == [12, 10]
    assert data.preprocessing["channel_order"] == "RGB"


def test_bgr_order_and_an_explicit_spec_file(tmp_path: Path) -> None:
    pixels = write_images(tmp_path / "calib", 2, spec=None)
    spec = {**SPEC, "channel_order": "BGR"}
    spec_path = tmp_path / "bgr.json"
    spec_path.write_text(json.dumps(spec))
    data = from_directory(tmp_path / "calib", [DYNAMIC], samples=2, preprocessing=spec_path)
    np.testing.assert_allclose(data.arrays["input"][1], expected_sample(pixels[1], spec),
                               rtol=1e-5, atol=1e-5)


def test_images_without_a_spec_say_what_is_missing(tmp_path: Path) -> None:
    write_images(tmp_path / "calib", 2, spec=None)
    with pytest.raises(CalibrationError, match="preprocessing spec"):
        from_directory(tmp_path / "calib", [DYNAMIC], samples=2)


@pytest.mark.parametrize(("change", "field"), [
    ({"resize": [12]}, "resize"),
    ({"resize": [12.5, 10]}, "resize"),
    ({"std": [0.2, 0.0, 0.5]}, "std"),
    ({"channel_order": "RGBA"}, "channel_order"),
    ({"scale": -1}, "scale"),
    ({"gamma": 2.2}, None),
])
def test_bad_specs_name_the_field(tmp_path: Path, change: dict, field: str | None) -> None:
    write_images(tmp_path / "calib", 1, spec={**SPEC, **change})
    with pytest.raises(CalibrationError) as info:
        from_directory(tmp_path / "calib", [DYNAMIC], samples=1)
    if field is None:
        assert "unknown preprocessing field" in str(info.value)
    else:
        assert info.value.fields["field"] == field


def test_a_corrupt_image_is_named(tmp_path: Path) -> None:
    write_images(tmp_path / "calib", 2)
    (tmp_path / "calib" / "frame001.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(CalibrationError) as info:
        from_directory(tmp_path / "calib", [DYNAMIC], samples=2)
    assert info.value.fields["path"].name == "frame001.png"


def test_images_that_do_not_fit_a_fixed_input_are_refused(tmp_path: Path) -> None:
    write_images(tmp_path / "calib", 1, spec={**SPEC, "resize": [8, 8]})
    with pytest.raises(CalibrationError, match="does not fit"):
        from_directory(tmp_path / "calib", [FIXED], samples=1)


def test_arrays_and_images_cannot_be_mixed(tmp_path: Path) -> None:
    write_images(tmp_path / "calib", 1)
    np.save(tmp_path / "calib" / "extra.npy", np.zeros((3, 12, 10), np.float32))
    with pytest.raises(CalibrationError, match="mixes"):
        from_directory(tmp_path / "calib", [DYNAMIC], samples=2)


@pytest.mark.parametrize(("text", "field"), [
    ('{"resize": [8, 8], "mean": [NaN, 0, 0], "std": [1, 1, 1]}', "mean"),
    ('{"resize": [8, 8], "mean": [0, 0, 0], "std": [Infinity, 1, 1]}', "std"),
    ('{"resize": [8, 8], "mean": [0, 0, 0], "std": [1, 1, 1], "scale": NaN}', "scale")])
def test_a_spec_with_nan_or_infinity_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    from agent.errors import CalibrationError
    from models.images import ImagePreprocessing

    spec = tmp_path / "preprocessing.json"
    spec.write_text(text)
    with pytest.raises(CalibrationError, match="invalid preprocessing field") as caught:
        ImagePreprocessing.from_file(spec)
    assert caught.value.fields["field"] == field
