"""Where an ONNX file's weights lie, read from its protobuf wire format without the ``onnx``
package (which the device extra does not install) and without reading the weights themselves.

A model's bytes are almost all weights: the graph's initializers (``GraphProto`` field 5,
``TensorProto``; field 15, sparse ones), stored inline unless the model keeps them as external
data. A tensor holds no nodes, so a question about the graph's operators can skip those spans
and read only the rest: for a 40 MB float model that is a few hundred small reads instead of
40 MB scanned under the interpreter's lock (:func:`models.ort._may_quantize`).

The field numbers are the ONNX schema's (onnx/onnx.proto): ``ModelProto.graph`` = 7,
``GraphProto.initializer`` = 5, ``GraphProto.sparse_initializer`` = 15; the wire format is
protobuf's (a varint key of field number and wire type, then a varint, 8 or 4 bytes, or a varint
length and that many bytes).
"""

from __future__ import annotations

from typing import BinaryIO

MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
GRAPH_SPARSE_INITIALIZER = 15

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class Malformed(ValueError):
    """The bytes are not a protobuf message (or end inside one)."""


def _varint(file: BinaryIO) -> int | None:
    """The varint at the file's position; None at the end of the file before its first byte."""
    value = shift = 0
    while True:
        byte = file.read(1)
        if not byte:
            if shift == 0:
                return None
            raise Malformed("the file ends inside a varint")
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
        if shift > 63:
            raise Malformed("a varint longer than ten bytes")


def _fields(file: BinaryIO, end: int) -> list[tuple[int, int, int, int]]:
    """The fields of the message between the file's position and ``end``: (number, wire type,
    the payload's start, the payload's end). A length-delimited payload is skipped, not read."""
    found = []
    while file.tell() < end:
        key = _varint(file)
        if key is None:
            raise Malformed("the file ends inside a message")
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            start = file.tell()
            if _varint(file) is None:
                raise Malformed("the file ends inside a field")
        elif wire_type in (_FIXED64, _FIXED32):
            start = file.tell()
            file.seek(8 if wire_type == _FIXED64 else 4, 1)
        elif wire_type == _LENGTH:
            length = _varint(file)
            if length is None:
                raise Malformed("the file ends inside a field")
            start = file.tell()
            file.seek(length, 1)
        else:  # groups (3, 4) are not in ONNX's schema; 6 and 7 are not wire types
            raise Malformed(f"wire type {wire_type}")
        if file.tell() > end or number == 0:
            raise Malformed("a field beyond its message")
        found.append((number, wire_type, start, file.tell()))
    return found


def initializer_spans(file: BinaryIO) -> list[tuple[int, int]]:
    """The byte spans (start, end) of the payloads of every initializer of the model's graph, in
    file order, found by reading only the keys and lengths of the fields around them.

    Raises:
        Malformed: The file is not a protobuf message; no span can then be trusted.
    """
    size = file.seek(0, 2)
    file.seek(0)
    spans = []
    for number, wire_type, start, end in _fields(file, size):
        if number != MODEL_GRAPH or wire_type != _LENGTH:
            continue
        file.seek(start)
        spans += [(field_start, field_end)
                  for field, field_type, field_start, field_end in _fields(file, end)
                  if field in (GRAPH_INITIALIZER, GRAPH_SPARSE_INITIALIZER)
                  and field_type == _LENGTH]
    return spans


__all__ = ["Malformed", "initializer_spans"]
