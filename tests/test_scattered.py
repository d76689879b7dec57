"""Request bodies kept in received pieces (agent/scattered.py) and their decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agent.api.codec import RequestError, decode_request
from agent.backends.base import TensorInfo
from agent.scattered import Body, ScatteredArray, copy_rows


def split(data: bytes, cuts: list[int]) -> Body:
    edges = [0, *cuts, len(data)]
    return Body([data[a:b] for a, b in zip(edges, edges[1:])])


def test_span_and_bytes_cross_piece_boundaries() -> None:
    data = bytes(range(100))
    body = split(data, [10, 10, 37, 90])  # an empty piece too
    assert len(body) == 100 and body.piece_count == 4
    for start, stop in [(0, 100), (5, 15), (10, 37), (36, 91), (99, 100), (50, 50)]:
        assert body.bytes(start, stop) == data[start:stop]
        assert sum(len(v) for v in body.span(start, stop)) == stop - start
    assert body.tail(37).bytes() == data[37:]
    with pytest.raises(IndexError, match=r"outside a body of 100"):
        body.span(90, 101)


def test_array_is_a_view_within_one_piece_and_scattered_across_pieces() -> None:
    values = np.arange(60, dtype=np.float32)
    data = b"head" + values.tobytes()
    body = split(data, [4 + 40, 4 + 100])  # pieces of 10, 15 and 35 floats after the header
    inside = body.array(4, np.dtype(np.float32), (2, 5))
    assert isinstance(inside, np.ndarray)
    np.testing.assert_array_equal(inside, values[:10].reshape(2, 5))
    assert np.shares_memory(inside, np.frombuffer(body.span(4, 44)[0], np.uint8))

    across = body.array(4, np.dtype(np.float32), (3, 4, 5))
    assert isinstance(across, ScatteredArray) and len(across.pieces) == 3
    assert across.shape == (3, 4, 5) and across.ndim == 3 and across.nbytes == 240
    np.testing.assert_array_equal(np.asarray(across), values.reshape(3, 4, 5))
    target = np.full((3, 4, 5), -1.0, np.float32)
    across.copy_into(target)
    np.testing.assert_array_equal(target, values.reshape(3, 4, 5))


def test_copy_rows_writes_pieces_into_batch_rows_and_casts_otherwise() -> None:
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    scattered = split(values.tobytes(), [7, 50]).array(0, np.dtype(np.float32), (2, 3, 4))
    assert isinstance(scattered, ScatteredArray)
    batch = np.zeros((5, 3, 4), np.float32)
    copy_rows(batch[1:3], scattered)
    np.testing.assert_array_equal(batch[1:3], values)
    assert not batch[0].any() and not batch[3:].any()
    wider = np.zeros((2, 3, 4), np.float64)  # another dtype: joined, then cast
    copy_rows(wider, scattered)
    np.testing.assert_array_equal(wider, values)


def test_scattered_array_refuses_wrong_sizes_and_targets() -> None:
    pieces = [memoryview(b"\0" * 8), memoryview(b"\0" * 8)]
    with pytest.raises(ValueError, match="16 bytes cannot hold"):
        ScatteredArray(pieces, np.dtype(np.float32), (5,))
    array = ScatteredArray(pieces, np.dtype(np.float32), (4,))
    for target in (np.zeros(5, np.float32), np.zeros(4, np.int32), np.zeros(8, np.float32)[::2]):
        with pytest.raises(ValueError, match="cannot copy"):
            array.copy_into(target)


INPUT = TensorInfo("input", "FP32", (-1, 3, -1, -1))
OUTPUT = TensorInfo("logits", "FP32", (-1, 10))


@pytest.mark.parametrize("cuts", [[], [3], [30, 31], [60, 500, 2000], list(range(1, 3000, 97))])
def test_decoding_a_body_in_pieces_equals_decoding_it_whole(cuts: list[int]) -> None:
    frames = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    header = json.dumps({"id": "x", "inputs": [{
        "name": "input", "datatype": "FP32", "shape": list(frames.shape),
        "parameters": {"binary_data_size": frames.nbytes}}]}).encode()
    whole = header + frames.tobytes()
    expected = decode_request(whole, str(len(header)), [INPUT], [OUTPUT], None)
    pieces = decode_request(split(whole, [c for c in cuts if c < len(whole)]), str(len(header)),
                            [INPUT], [OUTPUT], None)
    assert pieces.id == expected.id == "x"
    np.testing.assert_array_equal(np.asarray(pieces.inputs["input"]), frames)
    np.testing.assert_array_equal(expected.inputs["input"], frames)


def test_a_body_in_pieces_that_lies_about_lengths_is_refused() -> None:
    frames = np.zeros((1, 3, 4, 4), np.float32)
    header = json.dumps({"inputs": [{
        "name": "input", "datatype": "FP32", "shape": [1, 3, 4, 4],
        "parameters": {"binary_data_size": frames.nbytes}}]}).encode()
    body = split(header + frames.tobytes()[:-4], [10, 100])
    with pytest.raises(RequestError, match="shorter than binary_data_size"):
        decode_request(body, str(len(header)), [INPUT], [OUTPUT], None)
    with pytest.raises(RequestError, match="does not fit the body"):
        decode_request(body, str(len(body) + 1), [INPUT], [OUTPUT], None)
