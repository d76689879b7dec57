"""Decoding and encoding KServe v2 inference bodies: JSON, the binary tensor extension and
references to system shared memory regions (docs/reference/serving.md §2).

Everything a client can get wrong raises :class:`RequestError` with a message that says what and
where; the server answers it with a 4xx and keeps serving.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from agent.backends.base import TensorInfo, datatype_of
from agent.errors import InputError
from agent.scattered import Body, DeferredArray

HEADER_LENGTH = "Inference-Header-Content-Length"


class RequestError(InputError):
    """A malformed or unacceptable inference request (HTTP 400 unless ``status`` says else)."""

    def __init__(self, message: str, *, status: int = 400, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.status = status


class SharedMemory(Protocol):
    """What the codec needs of the shared memory registry (agent/api/shm.py)."""

    def array(self, name: str, offset: int, dtype: np.dtype,
              shape: tuple[int, ...]) -> DeferredArray: ...

    def target(self, name: str, offset: int, byte_size: int) -> OutputTarget: ...


class OutputTarget(Protocol):
    """Where an output goes in shared memory (agent/api/shm.py's SharedMemoryTarget)."""

    byte_size: int

    @property
    def region(self) -> str: ...

    def write(self, data: np.ndarray) -> None: ...


@dataclass(frozen=True)
class OutputRequest:
    name: str
    binary: bool | None  # None: follow the request-level binary_data_output
    shm: OutputTarget | None = None  # taken at decoding: an unregister cannot pull it away


@dataclass
class InferRequest:
    """A decoded request: input arrays (batch axis first, of the model's dtypes) and what to
    return."""

    id: str | None
    inputs: dict[str, np.ndarray | DeferredArray]
    outputs: list[OutputRequest]
    binary_output: bool
    priority: int | None = None
    timeout_us: int | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: bytes | str, what: str = "request body") -> Any:
    """Strict JSON (no NaN or Infinity literals); anything unreadable is a RequestError."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise RequestError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(f"{what} is nested too deeply") from None


def _json_object(text: bytes, *, binary_follows: bool = False) -> dict[str, Any]:
    try:
        value = parse_json(text)
    except RequestError as exc:
        if binary_follows or text[:1] != b"{" or not (
                "Extra data" in exc.message or "can't decode" in exc.message):
            raise
        # A binary body sent without its header length reads as JSON followed by junk.
        raise RequestError(f"{exc.message}; a body with binary tensors needs the "
                           f"{HEADER_LENGTH} header") from None
    if not isinstance(value, dict):
        raise RequestError("request body must be a JSON object", found=type(value).__name__)
    return value


def _int_param(parameters: Mapping[str, Any], key: str, where: str, *,
               minimum: int = 0) -> int | None:
    value = parameters.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"parameter '{key}' must be an integer >= {minimum}", where=where,
                           found=repr(value))
    return value


def _parameters(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    parameters = entry.get("parameters", {})
    if not isinstance(parameters, dict):
        raise RequestError("'parameters' must be a JSON object", where=where)
    return parameters


def decode_request(body: bytes | memoryview | Body, header_length: str | None,
                   model_inputs: Sequence[TensorInfo], model_outputs: Sequence[TensorInfo],
                   shm: SharedMemory | None) -> InferRequest:
    """Decode and validate one ``/infer`` body against the model's inputs and outputs. The body
    may be a :class:`~agent.scattered.Body` of received pieces: binary inputs then stay views of
    them (a :class:`~agent.scattered.ScatteredArray` where one spans pieces), never joined."""
    if not isinstance(body, Body):
        body = Body([body])
    if header_length is not None:
        try:
            json_length = int(header_length)
        except ValueError:
            raise RequestError(f"{HEADER_LENGTH} is not an integer", found=header_length) from None
        if not 0 < json_length <= len(body):
            raise RequestError(f"{HEADER_LENGTH} does not fit the body", found=json_length,
                               body_bytes=len(body))
        header, binary = body.bytes(0, json_length), body.tail(json_length)
    else:
        header, binary = body.bytes(), Body([])
    document = _json_object(header, binary_follows=header_length is not None)
    request_parameters = _parameters(document, "request")
    entries = document.get("inputs")
    if not isinstance(entries, list) or not entries:
        raise RequestError("request needs a non-empty 'inputs' list")

    by_name = {info.name: info for info in model_inputs}
    inputs: dict[str, np.ndarray | DeferredArray] = {}
    cursor = 0
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise RequestError("each input must be a JSON object", index=index)
        name = entry.get("name")
        info = by_name.get(name) if isinstance(name, str) else None
        if info is None or not isinstance(name, str):
            raise RequestError("unknown input", input=name, expected=sorted(by_name))
        if name in inputs:
            raise RequestError("input given twice", input=name)
        array, used = _decode_input(entry, info, binary, cursor, shm)
        cursor += used
        inputs[name] = array
    if cursor != len(binary):
        raise RequestError("binary data does not match the inputs' binary_data_size",
                           declared=cursor, received=len(binary))
    missing = sorted(set(by_name) - set(inputs))
    if missing:
        raise RequestError("missing input", input=missing)

    batch = next(iter(inputs.values())).shape[0]
    outputs = _decode_outputs(document.get("outputs"), model_outputs, batch, shm)
    binary_output = request_parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise RequestError("parameter 'binary_data_output' must be true or false",
                           found=binary_output)
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError("'id' must be a string", found=request_id)
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        binary_output=binary_output,
        priority=_int_param(request_parameters, "priority", "request"),
        timeout_us=_int_param(request_parameters, "timeout", "request"),
        parameters=request_parameters,
    )


def _decode_input(entry: Mapping[str, Any], info: TensorInfo, binary: Body, cursor: int,
                  shm: SharedMemory | None) -> tuple[np.ndarray | DeferredArray, int]:
    """One input's array and how many binary bytes it used."""
    name = info.name
    datatype = entry.get("datatype")
    if datatype != info.datatype:
        raise RequestError("wrong datatype", input=name, expected=info.datatype, found=datatype)
    shape = entry.get("shape")
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise RequestError("'shape' must be a list of non-negative integers", input=name,
                           found=shape)
    if shape[0] < 1:
        raise RequestError("batch axis must be >= 1", input=name, found=shape)
    try:
        info.check_sample_shape(tuple(shape[1:]))
    except InputError as exc:
        raise RequestError(exc.message, **exc.fields) from None
    dtype = info.dtype
    count = math.prod(shape)
    byte_size = count * dtype.itemsize
    parameters = _parameters(entry, f"input {name}")
    region = parameters.get("shared_memory_region")
    binary_size = _int_param(parameters, "binary_data_size", f"input {name}")
    has_data = "data" in entry

    if region is not None:
        if has_data or binary_size is not None:
            raise RequestError("an input in shared memory must not also carry data", input=name)
        if shm is None:
            raise RequestError("shared memory is not enabled", input=name)
        region_size = _int_param(parameters, "shared_memory_byte_size", f"input {name}")
        offset = _int_param(parameters, "shared_memory_offset", f"input {name}") or 0
        if region_size is None:
            raise RequestError("'shared_memory_byte_size' is required", input=name)
        if region_size != byte_size:
            raise RequestError("shared_memory_byte_size does not match the shape and datatype",
                               input=name, expected=byte_size, found=region_size)
        return shm.array(str(region), offset, dtype, tuple(shape)), 0

    if binary_size is not None:
        if has_data:
            raise RequestError("an input cannot have both 'data' and binary_data_size", input=name)
        if binary_size != byte_size:
            raise RequestError("binary_data_size does not match the shape and datatype",
                               input=name, expected=byte_size, found=binary_size)
        if cursor + binary_size > len(binary):
            raise RequestError("binary data is shorter than binary_data_size says", input=name,
                               needed=cursor + binary_size, received=len(binary))
        return binary.array(cursor, dtype.newbyteorder("<"), shape), binary_size

    if not has_data:
        raise RequestError("input has no data, binary_data_size or shared memory region",
                           input=name)
    array = _json_data(entry["data"], info)
    if array.size != count:
        raise RequestError("'data' has the wrong number of elements for 'shape'", input=name,
                           expected=count, found=int(array.size))
    return array.reshape(shape), 0


# What JSON ``data`` may hold, by numpy dtype kind: bool for BOOL, int for integer tensors.
_JSON_TYPES: dict[str, tuple[set[type], str]] = {
    "b": ({bool}, "true or false"), "i": ({int}, "integers"), "u": ({int}, "integers"),
    "f": ({int, float}, "numbers")}


def _json_data(data: Any, info: TensorInfo) -> np.ndarray:
    """A JSON ``data`` list (flat or nested) as an array of the input's dtype. Only numbers are
    accepted (integers for integer tensors, true/false for BOOL), and a value the dtype cannot
    hold is refused rather than wrapped or turned into infinity, as Triton refuses it."""
    name, dtype = info.name, info.dtype
    if not isinstance(data, list):
        raise RequestError("'data' must be a list", input=name, found=type(data).__name__)
    try:
        nested = np.asarray(data, dtype=object)
    except ValueError as exc:
        raise RequestError(f"'data' is not a regular array: {exc}", input=name) from None
    values = nested.reshape(-1)
    allowed, kind = _JSON_TYPES[dtype.kind]
    if not set(map(type, values)) <= allowed:
        wrong = next(value for value in values if type(value) not in allowed)
        raise RequestError(f"'data' of a {info.datatype} input must hold {kind} in nested "
                           f"lists of the same length", input=name, found=repr(wrong)[:80])
    if dtype.kind in "iu" and values.size:
        limits = np.iinfo(dtype)
        low, high = min(values), max(values)
        if low < limits.min or high > limits.max:
            raise RequestError(f"'data' value out of range for {info.datatype}", input=name,
                               found=low if low < limits.min else high,
                               minimum=int(limits.min), maximum=int(limits.max))
    elif dtype.kind == "f" and values.size:
        try:
            with np.errstate(over="ignore"):
                converted = values.astype(np.float64).astype(dtype)
            finite = bool(np.isfinite(converted).all())
        except OverflowError:  # an integer beyond any float
            finite = False
        if not finite:
            raise RequestError(f"'data' value out of range for {info.datatype}", input=name,
                               largest=float(np.finfo(dtype).max))
        return converted.reshape(nested.shape)
    return values.astype(dtype).reshape(nested.shape)


def _decode_outputs(entries: Any, model_outputs: Sequence[TensorInfo], batch: int,
                    shm: SharedMemory | None) -> list[OutputRequest]:
    infos = {info.name: info for info in model_outputs}
    names = list(infos)
    if entries is None or entries == []:  # as Triton: no outputs named means all of them
        return [OutputRequest(name, None) for name in names]
    if not isinstance(entries, list):
        raise RequestError("'outputs' must be a list")
    result: list[OutputRequest] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise RequestError("each requested output needs a 'name'", index=index)
        name = entry["name"]
        if name not in names:
            raise RequestError("unknown output", output=name, expected=names)
        if any(wanted.name == name for wanted in result):
            raise RequestError("output requested twice", output=name)
        parameters = _parameters(entry, f"output {name}")
        if "classification" in parameters:
            raise RequestError("the classification extension is not supported; ask for the "
                               "output tensor and take its top classes on the client",
                               output=name)
        binary = parameters.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise RequestError("parameter 'binary_data' must be true or false", output=name,
                               found=repr(binary))
        region = parameters.get("shared_memory_region")
        if region is not None:
            size = _int_param(parameters, "shared_memory_byte_size", f"output {name}")
            if size is None:
                raise RequestError("'shared_memory_byte_size' is required", output=name)
            offset = _int_param(parameters, "shared_memory_offset", f"output {name}") or 0
            if shm is None:
                raise RequestError("shared memory is not enabled", output=name)
            # Taken before the model runs: a request whose answer has nowhere to go is refused.
            target = shm.target(str(region), offset, size)
            info = infos[name]
            if all(d >= 0 for d in info.sample_shape):
                needed = batch * math.prod(info.sample_shape) * info.dtype.itemsize
                if needed > size:
                    raise RequestError("output does not fit its shared memory region",
                                       output=name, needed=needed, found=size)
            result.append(OutputRequest(name, binary, target))
        else:
            result.append(OutputRequest(name, binary))
    return result


def encode_response(request: InferRequest, outputs: Mapping[str, np.ndarray], *, model_name: str,
                    model_version: str) -> tuple[bytes, dict[str, str]]:
    """The response body and headers for one request's outputs."""
    header_outputs: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    for wanted in request.outputs:
        array = np.ascontiguousarray(outputs[wanted.name])
        entry: dict[str, Any] = {"name": wanted.name, "datatype": datatype_of(array.dtype),
                                 "shape": list(array.shape)}
        if wanted.shm is not None:
            wanted.shm.write(array)
            entry["parameters"] = {"shared_memory_region": wanted.shm.region,
                                   "shared_memory_byte_size": array.nbytes}
        elif wanted.binary if wanted.binary is not None else request.binary_output:
            entry["parameters"] = {"binary_data_size": array.nbytes}
            little_endian = array.astype(array.dtype.newbyteorder("<"), copy=False)
            chunks.append(little_endian.reshape(-1).view(np.uint8).data)
        else:
            entry["data"] = array.ravel().tolist()
        header_outputs.append(entry)
    document: dict[str, Any] = {"model_name": model_name, "model_version": model_version,
                                "outputs": header_outputs}
    if request.id is not None:
        document["id"] = request.id
    header = json.dumps(document, separators=(",", ":")).encode()
    if not chunks:
        return header, {"Content-Type": "application/json"}
    body = b"".join([header, *chunks])
    return body, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
