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


class _Reader:
    """Keys and lengths read from a file through a 64 KiB window, so that a payload skipped is
    never read and a run of small fields costs no call to the file each."""

    WINDOW = 1 << 16

    def __init__(self, file: BinaryIO, size: int) -> None:
        self.file = file
        self.size = size
        self.position = 0
        self._window = b""
        self._start = 0  # the file offset of the window's first byte

    def byte(self) -> int | None:
        offset = self.position - self._start
        if not 0 <= offset < len(self._window):
            self.file.seek(self.position)
            self._window = self.file.read(self.WINDOW)
            self._start, offset = self.position, 0
            if not self._window:
                return None
        self.position += 1
        return self._window[offset]

    def varint(self) -> int | None:
        """The varint here; None at the end of the file before its first byte."""
        value = shift = 0
        while True:
            byte = self.byte()
            if byte is None:
                if shift == 0:
                    return None
                raise Malformed("the file ends inside a varint")
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise Malformed("a varint longer than ten bytes")


def _fields(reader: _Reader, end: int,
            budget: list[int]) -> list[tuple[int, int, int, int]] | None:
    """The fields of the message between the reader's position and ``end``: (number, wire
    type, the payload's start, the payload's end). A length-delimited payload is skipped, not
    read. None once more fields than ``budget[0]`` were read (it counts down)."""
    found = []
    while reader.position < end:
        budget[0] -= 1
        if budget[0] < 0:
            return None
        key = reader.varint()
        if key is None:
            raise Malformed("the file ends inside a message")
        number, wire_type = key >> 3, key & 7
        start = reader.position
        if wire_type == _VARINT:
            if reader.varint() is None:
                raise Malformed("the file ends inside a field")
        elif wire_type in (_FIXED64, _FIXED32):
            reader.position += 8 if wire_type == _FIXED64 else 4
        elif wire_type == _LENGTH:
            length = reader.varint()
            if length is None:
                raise Malformed("the file ends inside a field")
            start = reader.position
            reader.position += length
        else:  # groups (3, 4) are not in ONNX's schema; 6 and 7 are not wire types
            raise Malformed(f"wire type {wire_type}")
        if reader.position > end or number == 0:
            raise Malformed("a field beyond its message")
        found.append((number, wire_type, start, reader.position))
    return found


def initializer_spans(file: BinaryIO, *,
                      max_fields: int | None = None) -> list[tuple[int, int]] | None:
    """The byte spans (start, end) of the payloads of every initializer of the model's graph, in
    file order, found by reading only the keys and lengths of the fields around them; None when
    the model and its graph have more than ``max_fields`` fields (a graph of many small nodes,
    where reading around its few weights costs more than reading them).

    Raises:
        Malformed: The file is not a protobuf message; no span can then be trusted.
    """
    size = file.seek(0, 2)
    reader = _Reader(file, size)
    budget = [size if max_fields is None else max_fields]
    spans = []
    top = _fields(reader, size, budget)
    if top is None:
        return None
    for number, wire_type, start, end in top:
        if number != MODEL_GRAPH or wire_type != _LENGTH:
            continue
        reader.position = start
        graph = _fields(reader, end, budget)
        if graph is None:
            return None
        spans += [(field_start, field_end)
                  for field, field_type, field_start, field_end in graph
                  if field in (GRAPH_INITIALIZER, GRAPH_SPARSE_INITIALIZER)
                  and field_type == _LENGTH]
    return spans


__all__ = ["Malformed", "initializer_spans"]
