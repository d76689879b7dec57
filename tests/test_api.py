"""The HTTP API against stock ``tritonclient`` and raw HTTP: results equal to running the ONNX model
directly, and every kind of bad request answered with a 4xx that leaves the server serving."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException

from agent.backends.base import BackendOptions
from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.batcher import BatchPolicy
from tests.serving_fixtures import ServerThread
from tests.tiny_models import (
    GatedBackend,
    artifacts_for,
    reference_logits,
    tiny_classifier,
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("api") / "model.onnx")


def backend(model_path: Path, cls: type[OnnxRuntimeBackend] = OnnxRuntimeBackend) -> Any:
    instance = cls(artifacts_for(model_path), BackendOptions(max_batch_size=8, threads=1))
    instance.activate()
    return instance


@pytest.fixture(scope="module")
def server(model_path: Path) -> Any:
    running = ServerThread([backend(model_path)], BatchPolicy(max_batch_size=8,
                                                              max_queue_delay_us=2000),
                           max_body_bytes=1 << 20)
    yield running
    running.stop()


@pytest.fixture()
def client(server: ServerThread) -> Any:
    return http.InferenceServerClient(server.url)


def frames(count: int, size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, 3, size, size)).astype(np.float32)


def post(server: ServerThread, path: str, body: bytes, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, Any], bytes]:
    request = urllib.request.Request(f"http://{server.url}{path}", data=body, method="POST",
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def get(server: ServerThread, path: str, headers: dict[str, str] | None = None
        ) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{server.url}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def assert_serving(client: Any, model_path: Path) -> None:
    data = frames(1, seed=99)
    tensor = http.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer("tiny", [tensor])
    np.testing.assert_allclose(result.as_numpy("logits"), reference_logits(model_path, data),
                               rtol=1e-4, atol=1e-5)


# -- health and metadata --------------------------------------------------------------------


def test_health_and_metadata(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("tiny")
    assert not client.is_model_ready("nope")
    server_meta = client.get_server_metadata()
    assert "binary_tensor_data" in server_meta["extensions"]
    assert "system_shared_memory" in server_meta["extensions"]
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, -1, -1]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert meta["versions"] == ["1"]
    config = client.get_model_config("tiny")
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    index = client.get_model_repository_index()
    assert index == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""}]


# -- inference ------------------------------------------------------------------------------


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_infer_matches_the_onnx_model(client: Any, model_path: Path, binary_in: bool,
                                      binary_out: bool) -> None:
    data = frames(3, size=20, seed=1)
    tensor = http.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=binary_in)
    result = client.infer("tiny", [tensor], request_id="req-7",
                          outputs=[http.InferRequestedOutput("logits", binary_data=binary_out)])
    np.testing.assert_allclose(result.as_numpy("logits"), reference_logits(model_path, data),
                               rtol=1e-4, atol=1e-5)
    response = result.get_response()
    assert response["id"] == "req-7"
    assert response["model_version"] == "1"


def test_large_binary_inputs_go_from_received_pieces_into_the_batch(
        client: Any, model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 393 KB request (8 frames of 64x64, the largest the model's profile takes) reaches the
    server in several pieces; they are copied into the batch as received
    (ScatteredArray.copy_into), not joined first, and the answer is still exact."""
    from agent.scattered import ScatteredArray

    copied: list[int] = []
    original = ScatteredArray.copy_into

    def counting(self: ScatteredArray, target: np.ndarray) -> None:
        copied.append(len(self.pieces))
        original(self, target)

    monkeypatch.setattr(ScatteredArray, "copy_into", counting)
    data = frames(8, size=64, seed=4)
    tensor = http.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    result = client.infer("tiny", [tensor])
    np.testing.assert_allclose(result.as_numpy("logits"), reference_logits(model_path, data),
                               rtol=1e-4, atol=1e-5)
    assert copied and copied[0] > 1


def test_raw_deflate_bodies_are_read_too(server: ServerThread, model_path: Path) -> None:
    # The standard's deflate is zlib-wrapped (what tritonclient sends); some clients send the
    # bare stream.
    data = frames(1, seed=4)
    body, length = binary_body(data)
    squeezer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw = squeezer.compress(body) + squeezer.flush()
    code, headers, payload = post(server, "/v2/models/tiny/infer", raw,
                                  {"Content-Encoding": "deflate",
                                   "Inference-Header-Content-Length": length})
    assert code == 200, payload
    assert json.loads(payload)["outputs"][0]["name"] == "logits"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_responses(client: Any, model_path: Path, algorithm: str) -> None:
    data = frames(2, seed=6)
    tensor = http.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer("tiny", [tensor], request_compression_algorithm=algorithm,
                          response_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("logits"), reference_logits(model_path, data),
                               rtol=1e-4, atol=1e-5)


def test_versioned_url_and_concurrent_clients(server: ServerThread, model_path: Path) -> None:
    data = frames(16, seed=2)
    expected = reference_logits(model_path, data)

    def one(index: int) -> np.ndarray:
        client = http.InferenceServerClient(server.url)
        tensor = http.InferInput("input", [1, 3, 16, 16], "FP32")
        tensor.set_data_from_numpy(data[index:index + 1])
        return client.infer("tiny", [tensor], model_version="1").as_numpy("logits")[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    np.testing.assert_allclose(np.stack(results), expected, rtol=1e-4, atol=1e-5)
    stats = http.InferenceServerClient(server.url).get_inference_statistics("tiny")
    model_stats = stats["model_stats"][0]
    # Concurrent requests were batched: fewer executions than inferences.
    assert model_stats["execution_count"] < model_stats["inference_count"]


def test_shared_memory_inputs_and_outputs(client: Any, model_path: Path) -> None:
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    data = frames(2, seed=3)
    in_bytes, out_bytes = data.nbytes, 2 * 10 * 4
    key_in, key_out = f"/edge-test-in-{id(data)}", f"/edge-test-out-{id(data)}"
    region_in = shm.create_shared_memory_region("frames_in", key_in, in_bytes)
    region_out = shm.create_shared_memory_region("logits_out", key_out, out_bytes)
    try:
        shm.set_shared_memory_region(region_in, [data])
        client.register_system_shared_memory("frames_in", key_in, in_bytes)
        client.register_system_shared_memory("logits_out", key_out, out_bytes)
        status = client.get_system_shared_memory_status()
        assert {entry["name"] for entry in status} == {"frames_in", "logits_out"}
        tensor = http.InferInput("input", list(data.shape), "FP32")
        tensor.set_shared_memory("frames_in", in_bytes)
        output = http.InferRequestedOutput("logits", binary_data=True)
        output.set_shared_memory("logits_out", out_bytes)
        result = client.infer("tiny", [tensor], outputs=[output])
        assert result.get_output("logits")["parameters"]["shared_memory_region"] == "logits_out"
        logits = shm.get_contents_as_numpy(region_out, np.float32, [2, 10])
        np.testing.assert_allclose(logits, reference_logits(model_path, data), rtol=1e-4,
                                   atol=1e-5)
        # Too small a region for the tensor, then an unregistered one: 4xx, server keeps serving.
        small = http.InferInput("input", list(data.shape), "FP32")
        small.set_shared_memory("logits_out", in_bytes)
        with pytest.raises(InferenceServerException, match="does not fit"):
            client.infer("tiny", [small])
        client.unregister_system_shared_memory("frames_in")
        with pytest.raises(InferenceServerException, match="not registered"):
            client.infer("tiny", [tensor])
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region_in)
        shm.destroy_shared_memory_region(region_out)
    assert client.get_system_shared_memory_status() == []
    assert_serving(client, model_path)


def _shm_file(size: int) -> tuple[str, Path]:
    key = f"edge-test-{os.getpid()}-{time.monotonic_ns()}"
    path = Path("/dev/shm") / key
    path.write_bytes(b"\0" * size)
    return "/" + key, path


def test_shared_memory_that_shrinks_after_register_is_refused(server: ServerThread, client: Any,
                                                              model_path: Path) -> None:
    """A client that truncates its region after registering it gets a 400 for inputs and for
    outputs, and the daemon keeps serving (read through a mapping, the input would have killed
    it with SIGBUS)."""
    data = frames(1, seed=8)
    in_key, in_path = _shm_file(data.nbytes)
    out_key, out_path = _shm_file(40)
    try:
        in_path.write_bytes(data.tobytes())
        client.register_system_shared_memory("shrinking_in", in_key, data.nbytes)
        client.register_system_shared_memory("shrinking_out", out_key, 40)
        tensor = http.InferInput("input", list(data.shape), "FP32")
        tensor.set_shared_memory("shrinking_in", data.nbytes)
        output = http.InferRequestedOutput("logits")
        output.set_shared_memory("shrinking_out", 40)
        client.infer("tiny", [tensor], outputs=[output])
        np.testing.assert_allclose(np.frombuffer(out_path.read_bytes(), np.float32).reshape(1, 10),
                                   reference_logits(model_path, data), rtol=1e-4, atol=1e-5)
        os.truncate(out_path, 0)
        with pytest.raises(InferenceServerException, match="smaller than when it was registered"):
            client.infer("tiny", [tensor], outputs=[output])
        os.truncate(in_path, 0)
        with pytest.raises(InferenceServerException, match="smaller than when it was registered"):
            client.infer("tiny", [tensor])
        in_path.unlink()  # unlinked after register: the open region still answers for itself
        with pytest.raises(InferenceServerException, match="smaller than when it was registered"):
            client.infer("tiny", [tensor])
    finally:
        client.unregister_system_shared_memory()
        for path in (in_path, out_path):
            path.unlink(missing_ok=True)
    assert_serving(client, model_path)


def test_an_output_region_is_checked_before_the_model_runs(server: ServerThread, client: Any,
                                                           model_path: Path) -> None:
    out_key, out_path = _shm_file(8)
    data = frames(1, seed=9)
    tensor = http.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    try:
        client.register_system_shared_memory("small_out", out_key, 8)
        before = client.get_inference_statistics("tiny")["model_stats"][0]["inference_count"]
        for region in ("small_out", "not_registered"):
            output = http.InferRequestedOutput("logits")
            output.set_shared_memory(region, 8)
            with pytest.raises(InferenceServerException, match="does not fit|not registered"):
                client.infer("tiny", [tensor], outputs=[output])
        after = client.get_inference_statistics("tiny")["model_stats"][0]["inference_count"]
        assert after == before  # refused before it was queued: the model never ran
    finally:
        client.unregister_system_shared_memory()
        out_path.unlink(missing_ok=True)
    assert_serving(client, model_path)


def test_http_details(server: ServerThread) -> None:
    head = urllib.request.Request(f"http://{server.url}/v2/health/live", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as response:
        assert response.status == 200
    try:
        urllib.request.urlopen(f"http://{server.url}/v2/models/tiny/infer", timeout=10)
        raise AssertionError("GET on infer was accepted")
    except urllib.error.HTTPError as error:
        assert error.code == 405
        assert "POST" in error.headers["Allow"]
    code, _, payload = post(server, "/v2/repository/index", b'{"ready": "no"}')
    assert code == 400 and "'ready' must be true or false" in json.loads(payload)["error"]
    code, _, payload = post(server, "/v2/repository/models/tiny/unload", b"")
    assert code == 400 and "not allowed" in json.loads(payload)["error"]
    assert post(server, "/v2/repository/models/other/load", b"")[0] == 404


# -- bad requests ---------------------------------------------------------------------------


def binary_body(array: np.ndarray, *, declared: int | None = None, datatype: str = "FP32",
                shape: list[int] | None = None, name: str = "input") -> tuple[bytes, str]:
    raw = array.tobytes()
    header = json.dumps({"inputs": [{
        "name": name, "datatype": datatype, "shape": shape or list(array.shape),
        "parameters": {"binary_data_size": len(raw) if declared is None else declared}}]}).encode()
    return header + raw, str(len(header))


@pytest.mark.parametrize(
    ("case", "status", "message"),
    [
        ("wrong dtype", 400, "wrong datatype"),
        ("wrong shape", 400, "shape does not match"),
        ("wrong byte size", 400, "binary_data_size does not match"),
        ("unknown input", 400, "unknown input"),
        ("unknown model", 404, "unknown model"),
        ("unknown version", 404, "version is not served"),
        ("malformed json", 400, "not valid JSON"),
        ("header longer than body", 400, "does not fit the body"),
        ("binary shorter than declared", 400, "shorter than binary_data_size"),
        ("extra binary bytes", 400, "does not match the inputs"),
        ("json data count", 400, "wrong number of elements"),
        ("batch too large", 400, "batch size out of range"),
        ("body over the limit", 413, "too large"),
        ("no inputs", 400, "non-empty 'inputs'"),
        ("deeply nested json", 400, "nested too deeply"),
        ("huge integer literal", 400, None),  # JSON's digit limit (3.11) or the shape check
        ("nan literal", 400, "not valid JSON"),
        ("string data", 400, "must hold numbers"),
        ("bool data", 400, "must hold numbers"),
        ("null data", 400, "must hold numbers"),
        ("ragged data", 400, "must hold numbers"),
        ("data out of range", 400, "out of range for FP32"),
        ("binary body without its header length", 400, "Inference-Header-Content-Length"),
        ("frame outside the profile", 400, "outside the range the model is built for"),
        ("classification", 400, "classification extension is not supported"),
        ("output twice", 400, "requested twice"),
        ("body that does not decompress", 400, "cannot be read"),
        ("unknown content encoding", 415, "Content-Encoding"),
        ("encoding the server cannot decode", 415, "Content-Encoding"),
        ("gzip that stops early", 400, "ends early"),
        ("gzip bomb", 413, "too large once decompressed"),
    ],
)
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(
        server: ServerThread, client: Any, model_path: Path, case: str, status: int,
        message: str | None) -> None:
    data = frames(1)
    path = "/v2/models/tiny/infer"
    headers: dict[str, str] = {}
    if case == "wrong dtype":
        body, length = binary_body(data.astype(np.float64), datatype="FP64")
    elif case == "wrong shape":
        body, length = binary_body(data, shape=[1, 4, 16, 12])
    elif case == "wrong byte size":
        body, length = binary_body(data[:, :, :8], shape=[1, 3, 16, 16])
    elif case == "unknown input":
        body, length = binary_body(data, name="images")
    elif case == "unknown model":
        body, length = binary_body(data)
        path = "/v2/models/other/infer"
    elif case == "unknown version":
        body, length = binary_body(data)
        path = "/v2/models/tiny/versions/9/infer"
    elif case == "malformed json":
        body, length = b'{"inputs": [', str(len(b'{"inputs": ['))
    elif case == "header longer than body":
        body, _ = binary_body(data)
        length = str(len(body) + 10)
    elif case == "binary shorter than declared":
        body, length = binary_body(data)
        body = body[:-100]
    elif case == "extra binary bytes":
        body, length = binary_body(data)
        body += b"\0" * 16
    elif case == "json data count":
        body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32",
                                       "shape": [1, 3, 16, 16], "data": [0.0] * 10}]}).encode()
        length = ""
    elif case == "batch too large":
        body, length = binary_body(frames(9))
    elif case == "body over the limit":
        body, length = binary_body(frames(1, size=300))
    elif case == "no inputs":
        body, length = b'{"inputs": []}', ""
    elif case == "deeply nested json":
        body, length = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ""
    elif case == "huge integer literal":
        body = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [' + b"9" * 5000 + b"]}]}"
        length = ""
    elif case in ("nan literal", "string data", "bool data", "null data", "ragged data",
                  "data out of range"):
        value = {"nan literal": "NaN", "string data": '"0.5"', "bool data": "true",
                 "null data": "null", "ragged data": "[0.5]", "data out of range": "1e300"}[case]
        values = ", ".join(["0.5"] * 767 + [value])
        body = ('{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 16, 16], '
                f'"data": [{values}]}}]}}').encode()
        length = ""
    elif case == "binary body without its header length":
        body, _ = binary_body(data)
        length = ""
    elif case == "frame outside the profile":
        body, length = binary_body(frames(1, size=72))  # the profile allows 8 to 64
    elif case in ("classification", "output twice"):
        header = json.loads(binary_body(data)[0][:int(binary_body(data)[1])])
        header["outputs"] = ([{"name": "logits", "parameters": {"classification": 3}}]
                             if case == "classification" else [{"name": "logits"}] * 2)
        encoded = json.dumps(header).encode()
        body, length = encoded + data.tobytes(), str(len(encoded))
    elif case == "body that does not decompress":
        body, length = binary_body(data)
        headers["Content-Encoding"] = "gzip"
    elif case == "unknown content encoding":
        body, length = binary_body(data)
        headers["Content-Encoding"] = "lz4"
    elif case == "encoding the server cannot decode":
        # aiohttp knows zstd but cannot decode it without an extra package: it answered with a
        # plain-text 400 before any handler ran.
        body, length = binary_body(data)
        headers["Content-Encoding"] = "zstd"
    elif case == "gzip that stops early":
        body, length = binary_body(data)
        body = gzip.compress(body)[:-20]
        headers["Content-Encoding"] = "gzip"
    elif case == "gzip bomb":
        body, length = gzip.compress(b"\0" * (8 << 20)), "10"  # 8 KiB that expand to 8 MiB
        headers["Content-Encoding"] = "gzip"
    if length:
        headers["Inference-Header-Content-Length"] = length
    code, _, payload = post(server, path, body, headers)
    assert code == status, payload
    if message is not None:
        assert message in json.loads(payload)["error"]
    assert_serving(client, model_path)


def test_tritonclient_sees_the_error_message(client: Any) -> None:
    data = frames(1).astype(np.int32)
    tensor = http.InferInput("input", list(data.shape), "INT32")
    tensor.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException, match="wrong datatype"):
        client.infer("tiny", [tensor])


def test_metrics_are_prometheus_text(server: ServerThread, client: Any, model_path: Path) -> None:
    assert_serving(client, model_path)
    status, body = get(server, "/metrics")
    text = body.decode()
    assert status == 200
    assert 'edge_agent_requests_total{model="tiny",outcome="success"}' in text
    assert 'edge_agent_model_version{model="tiny"} 1.0' in text
    for name in ("edge_agent_queue_duration_seconds_bucket", "edge_agent_compute_duration_seconds",
                 "edge_agent_request_duration_seconds", "edge_agent_batch_size_bucket",
                 "edge_agent_queue_depth"):
        assert name in text


# -- queue limit, shutdown, token -----------------------------------------------------------


def wait_for(condition: Any, describe: Any = None, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in time: {describe and describe()}")
        time.sleep(0.01)


def test_full_queue_answers_503(model_path: Path) -> None:
    gated = backend(model_path, GatedBackend)
    running = ServerThread([gated], BatchPolicy(max_batch_size=1, max_queue_delay_us=0,
                                                max_queue_size=1))
    try:
        gated.gate.clear()
        data = frames(1)
        body, length = binary_body(data)
        headers = {"Inference-Header-Content-Length": length}
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(post, running, "/v2/models/tiny/infer", body, headers)
            assert gated.running.wait(5)
            # The second is staged in the spare buffer set, the third waits in the queue: the
            # fourth is over the limit.
            batcher = running.service.batcher
            second = pool.submit(post, running, "/v2/models/tiny/infer", body, headers)
            wait_for(lambda: gated.events.count("stage1") == 2 and batcher.queue_depth == 0,
                     lambda: (batcher.load(), gated.events))
            third = pool.submit(post, running, "/v2/models/tiny/infer", body, headers)
            wait_for(lambda: batcher.queue_depth == 1, lambda: (batcher.load(), gated.events))
            code, _, payload = post(running, "/v2/models/tiny/infer", body, headers)
            assert code == 503
            assert "queue is full" in json.loads(payload)["error"]
            gated.gate.set()
            assert [f.result()[0] for f in (first, second, third)] == [200, 200, 200]
        stats = running.service.stats()["inference_stats"]
        assert (stats["success"]["count"], stats["fail"]["count"]) == (3, 1)  # adds up to 4
    finally:
        gated.gate.set()
        running.stop()


def test_shutdown_drains_in_flight_requests(model_path: Path) -> None:
    gated = backend(model_path, GatedBackend)
    running = ServerThread([gated], BatchPolicy(max_batch_size=2, max_queue_delay_us=0))
    gated.gate.clear()
    body, length = binary_body(frames(1))
    headers = {"Inference-Header-Content-Length": length}
    with ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(post, running, "/v2/models/tiny/infer", body, headers)
                     for _ in range(3)]
        assert gated.running.wait(5)
        wait_for(lambda: running.service.batcher.load().arrivals_total == 3)
        stopping = asyncio.run_coroutine_threadsafe(running.server.stop(drain=True),
                                                    running.loop)
        threading.Event().wait(0.2)
        assert not stopping.done()  # waits for the requests it holds
        import socket

        with pytest.raises(ConnectionRefusedError):  # the listener closed first
            socket.create_connection(running.url.split(":"), timeout=5).close()
        gated.gate.set()
        stopping.result(10)
        running.stopped = True
        results = [future.result(10) for future in in_flight]
    assert [code for code, _, _ in results] == [200, 200, 200]
    for _, _, payload in results:
        assert json.loads(payload)["outputs"][0]["shape"] == [1, 10]
    running.stop()


def test_bearer_token_guards_everything_but_health(model_path: Path) -> None:
    running = ServerThread([backend(model_path)], BatchPolicy(max_batch_size=4), token="s3cret")
    try:
        assert get(running, "/v2/health/ready")[0] == 200
        assert get(running, "/v2/models/tiny")[0] == 401
        assert get(running, "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
        assert get(running, "/v2/models/tiny", {"Authorization": "Bearer s3cret"})[0] == 200
        client = http.InferenceServerClient(running.url)
        data = frames(1)
        tensor = http.InferInput("input", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException):
            client.infer("tiny", [tensor])
        result = client.infer("tiny", [tensor], headers={"Authorization": "Bearer s3cret"})
        np.testing.assert_allclose(result.as_numpy("logits"), reference_logits(model_path, data),
                                   rtol=1e-4, atol=1e-5)
    finally:
        running.stop()


def test_malformed_http_is_logged_as_one_line(server: ServerThread,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp logs a client's malformed request with a traceback at ERROR; the server's filter
    makes it one line at INFO, so that clients cannot fill the log with tracebacks."""
    import socket

    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        with socket.create_connection(server.url.split(":"), timeout=10) as raw:
            raw.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: abc\r\n\r\n")
            assert raw.recv(1024).split(b"\r\n")[0].endswith(b" 400 Bad Request")
        wait_for(lambda: any(r.name == "aiohttp.server" for r in caplog.records))
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    assert "BadHttpMessage" in records[0].getMessage() and "\n" not in records[0].getMessage()


def test_expect_100_continue_refuses_an_oversized_body_before_it_is_sent(
        server: ServerThread) -> None:
    import socket

    with socket.create_connection(server.url.split(":"), timeout=10) as raw:
        raw.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n")
        answer = raw.recv(4096)
    assert answer.split(b"\r\n")[0].endswith(b"413 Request Entity Too Large"), answer
    assert b"100 Continue" not in answer
    with socket.create_connection(server.url.split(":"), timeout=10) as raw:
        raw.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 2\r\n\r\n")
        assert raw.recv(4096).startswith(b"HTTP/1.1 100 Continue")
        raw.sendall(b"{}")
        assert b"200 OK" in raw.recv(4096)


def test_a_client_that_goes_away_frees_its_queue_place(model_path: Path) -> None:
    """aiohttp cancels the handler of a client that disconnects (handler_cancellation), and the
    batcher drops its queued request: the place is free for the next client, and nothing is
    computed for nobody."""
    import socket

    gated = backend(model_path, GatedBackend)
    running = ServerThread([gated], BatchPolicy(max_batch_size=1, max_queue_delay_us=0,
                                                max_queue_size=1))
    try:
        gated.gate.clear()
        body, length = binary_body(frames(1))
        headers = {"Inference-Header-Content-Length": length}
        batcher = running.service.batcher
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(post, running, "/v2/models/tiny/infer", body, headers)
            assert gated.running.wait(5)
            second = pool.submit(post, running, "/v2/models/tiny/infer", body, headers)
            wait_for(lambda: gated.events.count("stage1") == 2 and batcher.queue_depth == 0)
            with socket.create_connection(running.url.split(":"), timeout=10) as raw:
                raw.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\n"
                            b"Inference-Header-Content-Length: " + length.encode() +
                            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                wait_for(lambda: batcher.queue_depth == 1)
            wait_for(lambda: batcher.queue_depth == 0, lambda: batcher.load())
            third = pool.submit(post, running, "/v2/models/tiny/infer", body, headers)
            wait_for(lambda: batcher.queue_depth == 1)  # admitted: the queue had room again
            gated.gate.set()
            assert [f.result()[0] for f in (first, second, third)] == [200, 200, 200]
        assert gated.events.count("run-start") == 3  # the abandoned request never ran
    finally:
        gated.gate.set()
        running.stop()


def test_compressed_json_requests_are_read_too(server: ServerThread) -> None:
    code, _, payload = post(server, "/v2/repository/index", gzip.compress(b'{"ready": true}'),
                            {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert code == 200, payload
    assert [entry["name"] for entry in json.loads(payload)] == ["tiny"]


def test_decoding_bounds_output_and_reads_whole_streams() -> None:
    from agent.api.codec import RequestError
    from agent.api.encoding import decode_body

    # Concatenated gzip members are one body; bytes after a deflate stream are refused.
    assert decode_body(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 100) == b"abcd"
    with pytest.raises(RequestError, match="bytes after the end"):
        decode_body(zlib.compress(b"ab") + b"junk", "deflate", 100)
    # A bomb is stopped having produced at most the limit and one byte.
    bomb = zlib.compress(b"\0" * (64 << 20), 9)
    tracemalloc = pytest.importorskip("tracemalloc")
    tracemalloc.start()
    try:
        with pytest.raises(RequestError) as caught:
            decode_body(bomb, "deflate", 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.status == 413
    assert peak < 8 << 20, peak  # not the 64 MiB the body expands to


def test_brotli_bodies_are_bounded_too() -> None:
    brotli = pytest.importorskip("brotli")
    if not hasattr(brotli.Decompressor(), "can_accept_more_data"):
        pytest.skip("Brotli before 1.2 cannot bound its output")
    from agent.api.codec import RequestError
    from agent.api.encoding import decode_body

    assert decode_body(brotli.compress(b"frame" * 1000), "br", 1 << 20) == b"frame" * 1000
    with pytest.raises(RequestError) as caught:
        decode_body(brotli.compress(b"\0" * (16 << 20)), "br", 1 << 20)
    assert caught.value.status == 413
    with pytest.raises(RequestError, match="ends early"):
        decode_body(brotli.compress(b"frame" * 1000)[:-4], "br", 1 << 20)


# -- found by probing: bytes a client should not be able to turn into 500s or wrong counts ----


def _raw_exchange(server: ServerThread, request: bytes) -> bytes:
    """Send raw bytes; return the whole answer (head and Content-Length bytes of body)."""
    import socket

    with socket.create_connection(server.url.split(":"), timeout=10) as raw:
        raw.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += raw.recv(65536)
        head, body = answer.split(b"\r\n\r\n", 1)
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
        while len(body) < int(fields.get(b"Content-Length", b"0")):
            body += raw.recv(65536)
    return head + b"\r\n\r\n" + body


def test_undecodable_bytes_in_a_token_are_a_401(model_path: Path) -> None:
    running = ServerThread([backend(model_path)], BatchPolicy(max_batch_size=4), token="s3cret")
    try:
        answer = _raw_exchange(running, b"GET /v2/models/tiny HTTP/1.1\r\nHost: x\r\n"
                                        b"Authorization: Bearer \xff\xfe\r\n\r\n")
        assert answer.split(b"\r\n")[0].endswith(b"401 Unauthorized"), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    finally:
        running.stop()


@pytest.mark.parametrize("value", [b"foo", b"\xff"])
def test_an_unsupported_expect_header_is_a_json_417(server: ServerThread, value: bytes) -> None:
    answer = _raw_exchange(server, b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nExpect: "
                                   + value + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert answer.split(b"\r\n")[0].endswith(b"417 Expectation Failed"), answer
    assert "unsupported Expect header" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def test_an_output_region_unregistered_while_its_request_runs_still_gets_the_answer(
        model_path: Path) -> None:
    # The region's span is taken when the request is decoded; it was looked up again after the
    # model ran, so the answer became a 400 that the statistics counted as a success.
    gated = backend(model_path, GatedBackend)
    running = ServerThread([gated], BatchPolicy(max_batch_size=1, max_queue_delay_us=0))
    client = http.InferenceServerClient(running.url)
    out_key, out_path = _shm_file(40)
    data = frames(1, seed=12)
    try:
        client.register_system_shared_memory("leaving_out", out_key, 40)
        gated.gate.clear()
        document = {"inputs": [{"name": "input", "shape": list(data.shape), "datatype": "FP32",
                                "data": data.ravel().tolist()}],
                    "outputs": [{"name": "logits", "parameters": {
                        "shared_memory_region": "leaving_out", "shared_memory_byte_size": 40}}]}
        with ThreadPoolExecutor(1) as pool:  # tritonclient's client stays on this thread
            pending = pool.submit(post, running, "/v2/models/tiny/infer",
                                  json.dumps(document).encode())
            assert gated.running.wait(5)
            client.unregister_system_shared_memory("leaving_out")
            gated.gate.set()
            code, _, payload = pending.result(10)
        assert code == 200, payload
        np.testing.assert_allclose(np.frombuffer(out_path.read_bytes(), np.float32).reshape(1, 10),
                                   reference_logits(model_path, data), rtol=1e-4, atol=1e-5)
        stats = running.service.stats()["inference_stats"]
        assert (stats["success"]["count"], stats["fail"]["count"]) == (1, 0)
    finally:
        gated.gate.set()
        out_path.unlink(missing_ok=True)
        running.stop()


def test_a_trickled_body_is_joined_into_few_pieces(server: ServerThread, model_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # One piece per TCP segment kept by reference made a byte-by-byte client cost ~250x its
    # body in memory and stall the event loop while decoding views of every piece.
    import socket

    import agent.api.server as server_module

    counts: list[int] = []
    original = server_module.Body

    def counting(pieces: Any) -> Any:
        counts.append(len(pieces))
        return original(pieces)

    monkeypatch.setattr(server_module, "Body", counting)
    data = frames(4, size=64, seed=13)  # 196 KB
    body, length = binary_body(data)
    head = (f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {length}\r\n\r\n").encode()
    with socket.create_connection(server.url.split(":"), timeout=10) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.sendall(head)
        for start in range(0, len(body), 512):
            raw.sendall(body[start:start + 512])
            time.sleep(0.0005)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += raw.recv(65536)
    assert answer.split(b"\r\n")[0].endswith(b"200 OK"), answer[:200]
    assert counts and counts[-1] <= len(body) // (64 * 1024) + 2, counts


def test_a_chunked_body_over_the_limit_is_counted(model_path: Path) -> None:
    running = ServerThread([backend(model_path)], BatchPolicy(max_batch_size=4),
                           max_body_bytes=4096)
    try:
        chunk = b"x" * 8192
        answer = _raw_exchange(running, b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\n"
                                        b"Transfer-Encoding: chunked\r\n\r\n"
                                        + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
        assert answer.split(b"\r\n")[0].endswith(b"413 Request Entity Too Large"), answer[:200]
        stats = running.service.stats()["inference_stats"]
        assert stats["fail"]["count"] == 1
    finally:
        running.stop()


def test_an_empty_outputs_list_asks_for_every_output(server: ServerThread) -> None:
    data = frames(1, seed=14)
    document = {"inputs": [{"name": "input", "shape": list(data.shape), "datatype": "FP32",
                            "data": data.ravel().tolist()}], "outputs": []}
    code, _, payload = post(server, "/v2/models/tiny/infer", json.dumps(document).encode())
    assert code == 200 and [output["name"] for output in json.loads(payload)["outputs"]] == ["logits"]


def test_a_nan_literal_is_named_without_a_hint_about_binary_tensors(server: ServerThread) -> None:
    body = b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": [NaN]}]}'
    code, _, payload = post(server, "/v2/models/tiny/infer", body)
    message = json.loads(payload)["error"]
    assert code == 400 and "NaN is not a JSON number" in message
    assert "Inference-Header-Content-Length" not in message


def test_a_timeout_beyond_triton_s_uint64_is_a_counted_400(model_path: Path) -> None:
    running = ServerThread([backend(model_path)], BatchPolicy(max_batch_size=4))
    try:
        data = frames(1, seed=15)
        body = ('{"parameters": {"timeout": 1' + "0" * 400 + '}, "inputs": [{"name": "input", '
                f'"shape": {list(data.shape)}, "datatype": "FP32", '
                f'"data": {data.ravel().tolist()}}}]}}').encode()
        code, _, payload = post(running, "/v2/models/tiny/infer", body)
        assert code == 400 and "timeout must be from 0 to" in json.loads(payload)["error"]
        assert running.service.stats()["inference_stats"]["fail"]["count"] == 1
    finally:
        running.stop()
