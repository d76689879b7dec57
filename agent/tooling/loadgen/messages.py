"""KServe v2 infer messages as the load generator sends and reads them: a request body in the
binary tensor extension, a response's output tensors (binary or JSON), and the check of an answer
against the expected class."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"

# KServe v2 datatypes with a fixed element size, as little-endian numpy types. BYTES (length-
# prefixed strings) and BF16 (no numpy type) are not needed for vision models and are refused.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

Verifier = Callable[[int, Mapping[str, np.ndarray]], bool]
"""``verify(sample_index, outputs) -> bool``; False counts the request as a "mismatch" error."""


def encode_request(
    input_name: str, array: np.ndarray, *, datatype: str, outputs: Sequence[str] = ()
) -> tuple[bytes, int]:
    """An infer request body in the binary tensor extension and the length of its JSON header."""
    raw = np.ascontiguousarray(array, dtype=DATATYPES[datatype]).tobytes()
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": input_name,
                "shape": list(array.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(raw)},
            }
        ]
    }
    if outputs:
        header["outputs"] = [
            {"name": name, "parameters": {"binary_data": True}} for name in outputs
        ]
    else:
        header["parameters"] = {"binary_data_output": True}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + raw, len(encoded)


def decode_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """The output tensors of an infer response, binary or JSON.

    Args:
        body: The whole response body.
        header_length: The ``Inference-Header-Content-Length`` value, or None when the response
            is plain JSON.

    Raises:
        ValueError: The body is not a well-formed response (bad JSON, unknown datatype, a binary
            tensor that does not fit the body or its shape).
    """
    if header_length is None:
        header = json.loads(body)
        offset = len(body)
    else:
        if not 0 < header_length <= len(body):
            raise ValueError(f"header length {header_length} outside a body of {len(body)} bytes")
        header = json.loads(body[:header_length])
        offset = header_length
    outputs: dict[str, np.ndarray] = {}
    try:
        for output in header["outputs"]:
            dtype = DATATYPES.get(output["datatype"])
            if dtype is None:
                raise ValueError(f"unsupported output datatype {output['datatype']!r}")
            shape = [int(dim) for dim in output["shape"]]
            size = (output.get("parameters") or {}).get("binary_data_size")
            if size is None:
                array = np.asarray(output["data"], dtype=dtype).reshape(shape)
            else:
                if offset + size > len(body) or size % dtype.itemsize:
                    raise ValueError(f"binary output {output['name']!r} does not fit the body")
                count = size // dtype.itemsize
                array = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
                offset += size
            outputs[output["name"]] = array
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed infer response: {exc!r}") from exc
    return outputs


def expect_argmax(labels: Sequence[int | Sequence[int]], *, output: str | None = None) -> Verifier:
    """A verifier that the argmax over the last axis matches ``labels[sample_index]``.

    Args:
        labels: Per sample, the expected class (or one class per row of a batched sample).
        output: The output to check; the first one in the response when None.
    """
    expected = [np.atleast_1d(np.asarray(label)).ravel() for label in labels]

    def verify(index: int, outputs: Mapping[str, np.ndarray]) -> bool:
        scores = outputs[output] if output is not None else next(iter(outputs.values()), None)
        if scores is None:
            return False
        return np.array_equal(np.argmax(scores, axis=-1).ravel(), expected[index])

    return verify
