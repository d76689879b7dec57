"""The ONNX Runtime backend accepts the frame sizes a TensorRT engine of the same bundle would:
the bundle's engine profile bounds the input's height and width, wherever its layout puts them."""

from __future__ import annotations

import pytest

from agent.backends.base import TensorInfo
from agent.backends.onnxruntime import _with_profile_limits
from agent.errors import InputError

RANGE = [32, 224, 448]


def _limits(shape, layout, profile):
    info = TensorInfo("image", "FP32", shape)
    manifest = {"inputs": [{"name": "image", "shape": list(shape), "layout": layout}],
                "engine_profile": profile}
    return _with_profile_limits(info, manifest)


@pytest.mark.parametrize("shape, layout, profile, expected", [
    ((-1, 3, -1, -1), "NCHW", {"height": RANGE, "width": RANGE}, ((3, 32, 32), (3, 448, 448))),
    ((-1, -1, -1, 3), "NHWC", {"height": RANGE, "width": RANGE}, ((32, 32, 3), (448, 448, 3))),
    ((-1, 3, -1, 32), "NCHW", {"height": RANGE}, ((3, 32, 32), (3, 448, 32))),
    ((-1, 3, -1, -1), None, {"height": RANGE, "width": RANGE}, ((3, 32, 32), (3, 448, 448))),
])
def test_the_profile_bounds_the_height_and_width_axes(shape, layout, profile, expected):
    assert _limits(shape, layout, {"batch": [1, 8, 32], **profile}).limits == expected


def test_no_spatial_range_leaves_the_input_unbounded():
    assert _limits((-1, 3, 32, 32), "NCHW", {"batch": [1, 8, 32]}).limits is None


def test_an_nhwc_frame_outside_the_profile_is_refused():
    info = _limits((-1, -1, -1, 3), "NHWC", {"height": RANGE, "width": RANGE})
    info.check_sample_shape((64, 64, 3))
    with pytest.raises(InputError, match="outside the range"):
        info.check_sample_shape((512, 64, 3))
