from __future__ import annotations

import logging

import numpy as np
import pytest

from agent.errors import CalibrationError
from models.calibration import from_array, from_directory
from models.onnx_model import TensorSpec
from tests.helpers import write_samples

IMAGE = TensorSpec("input", "float32", (-1, 3, 8, 8), ("batch", "", "", ""))
DYNAMIC = TensorSpec("input", "float32", (-1, 3, -1, -1), ("batch", "", "height", "width"))


def _images(count: int, shape=(3, 8, 8)) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((count, *shape)).astype(np.float32)


def test_directory_reads_samples_in_name_order_and_hashes_them(tmp_path):
    images = _images(6)
    write_samples(tmp_path / "calib", images)
    data = from_directory(tmp_path / "calib", [IMAGE], samples=6)
    assert len(data) == 6
    np.testing.assert_array_equal(data.arrays["input"], images)
    again = from_directory(tmp_path / "calib", [IMAGE], samples=6)
    assert data.sha256() == again.sha256()
    assert data.sha256() != from_directory(tmp_path / "calib", [IMAGE], samples=5).sha256()


def test_samples_with_a_leading_batch_of_one_are_accepted(tmp_path):
    write_samples(tmp_path, _images(3)[:, None])  # 1 x C x H x W files
    data = from_directory(tmp_path, [DYNAMIC], samples=3)
    assert data.arrays["input"].shape == (3, 3, 8, 8)


def test_fewer_samples_than_asked_warns_and_uses_them(tmp_path, caplog):
    write_samples(tmp_path, _images(4))
    with caplog.at_level(logging.WARNING, logger="models.calibration"):
        data = from_directory(tmp_path, [IMAGE], samples=512)
    assert len(data) == 4
    assert "only 4 calibration samples" in caplog.text


def test_empty_directory_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no samples here")
    with pytest.raises(CalibrationError, match="empty"):
        from_directory(tmp_path, [IMAGE])


def test_missing_directory_is_an_error(tmp_path):
    with pytest.raises(CalibrationError, match="not found"):
        from_directory(tmp_path / "nope", [IMAGE])


def test_wrong_shape_names_the_file(tmp_path):
    write_samples(tmp_path, _images(2))
    np.save(tmp_path / "sample-0001.npy", _images(1, (3, 9, 8))[0])
    with pytest.raises(CalibrationError, match="wrong shape") as error:
        from_directory(tmp_path, [IMAGE])
    assert "sample-0001.npy" in str(error.value)


def test_samples_in_the_other_layout_get_a_hint_to_transpose(tmp_path):
    nhwc = TensorSpec("image", "float32", (-1, 24, 32, 3), ("batch", "", "", ""))
    np.save(tmp_path / "a.npy", _images(1, (3, 24, 32))[0])  # channels-first for an NHWC model
    with pytest.raises(CalibrationError, match=r"channels-first.*transpose\(1, 2, 0\)"):
        from_directory(tmp_path, [nhwc])
    nchw = TensorSpec("image", "float32", (-1, 3, 24, 32), ("batch", "", "", ""))
    (tmp_path / "a.npy").unlink()
    np.save(tmp_path / "b.npy", _images(1, (24, 32, 3))[0])
    with pytest.raises(CalibrationError, match=r"channels-last.*transpose\(2, 0, 1\)"):
        from_directory(tmp_path, [nchw])
    np.save(tmp_path / "b.npy", _images(1, (3, 20, 20))[0])  # merely the wrong size: no hint
    with pytest.raises(CalibrationError, match="wrong shape") as error:
        from_directory(tmp_path, [nchw])
    assert "transpose" not in str(error.value)


def test_samples_of_different_sizes_cannot_be_stacked(tmp_path):
    np.save(tmp_path / "a.npy", _images(1, (3, 8, 8))[0])
    np.save(tmp_path / "b.npy", _images(1, (3, 16, 16))[0])
    with pytest.raises(CalibrationError, match="differ in shape"):
        from_directory(tmp_path, [DYNAMIC])


def test_corrupt_file_is_an_error_naming_it(tmp_path):
    write_samples(tmp_path, _images(2))
    (tmp_path / "sample-0002.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(CalibrationError, match="cannot read") as error:
        from_directory(tmp_path, [IMAGE])
    assert "sample-0002.npy" in str(error.value)


def test_npz_input_names_must_match_the_model(tmp_path):
    np.savez(tmp_path / "s0.npz", image=_images(1)[0])
    with pytest.raises(CalibrationError, match="input names") as error:
        from_directory(tmp_path, [IMAGE])
    assert "image" in str(error.value) and "input" in str(error.value)


def test_npz_feeds_a_model_with_two_inputs(tmp_path):
    second = TensorSpec("mask", "float32", (-1, 1, 8, 8), ("batch", "", "", ""))
    for index in range(3):
        np.savez(tmp_path / f"s{index}.npz", input=_images(1)[0], mask=np.ones((1, 8, 8), np.float32))
    data = from_directory(tmp_path, [IMAGE, second], samples=3)
    assert data.arrays["mask"].shape == (3, 1, 8, 8)
    np.save(tmp_path / "plain.npy", _images(1)[0])
    with pytest.raises(CalibrationError, match="several inputs"):
        from_directory(tmp_path, [IMAGE, second], samples=4)


def test_from_array_takes_a_fixed_subset():
    images = _images(50)
    first = from_array(images, "input", 20)
    second = from_array(images, "input", 20)
    assert len(first) == 20
    np.testing.assert_array_equal(first.arrays["input"], second.arrays["input"])
    with pytest.raises(CalibrationError, match="empty"):
        from_array(images[:0], "input", 20)


def test_copies_among_calibration_samples_are_warned_about(tmp_path, caplog):
    from models.calibration import from_directory, warn_about_copies

    rng = np.random.default_rng(0)
    distinct = rng.standard_normal((5, 3, 4, 4)).astype(np.float32)
    assert warn_about_copies({"input": distinct}, "x") == 5
    assert not caplog.records
    for index in range(8):  # a frame dumped over and over, and two more
        np.save(tmp_path / f"{index}.npy", distinct[0] if index < 6 else distinct[index - 5])
    spec = TensorSpec("input", "float32", (-1, 3, 4, 4), ("batch", "", "", ""))
    with caplog.at_level("WARNING", logger="models.calibration"):
        calibration = from_directory(tmp_path, [spec], samples=8)
    assert len(calibration) == 8
    [record] = [record for record in caplog.records if "copies" in record.getMessage()]
    assert "5 of the 8 calibration samples" in record.getMessage()
    assert "rest on 3 distinct samples" in record.getMessage()
