"""Request bodies sent with a ``Content-Encoding`` (gzip, deflate, br), decoded with a bound.

aiohttp's own decoding is off (agent/api/server.py): it answered an encoding it cannot decode
with a plain-text 400 before any handler ran, and decoded without a limit. Here a small
compressed body that expands past the server's ``max_body_bytes`` is refused (413) as soon as it
does, since no decoding step produces more than the bytes still allowed.
"""

from __future__ import annotations

import zlib

from agent.api.codec import RequestError

# Content-Encoding values the server decodes (br needs the Brotli package, which the device
# extra does not install: without it br is a 415 like any unknown encoding).
ENCODINGS = ("identity", "gzip", "deflate", "br")
_DECODE_PIECE = 1 << 16  # compressed bytes handed to the br decoder at a time


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """Decompress a request body sent with ``Content-Encoding``, refusing it (413) as soon as its
    output passes ``limit`` bytes: a small compressed body can expand to gigabytes, so no step
    produces more than the bytes still allowed.

    Raises:
        RequestError: 415 for an encoding this host cannot decode, 400 for a body that is not
            valid in its encoding (or stops early, or has bytes after its end), 413 for one that
            expands past ``limit``.
    """
    if encoding == "br":
        return _decode_brotli(raw, limit)
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    else:
        # deflate is zlib-wrapped by the standard, though some clients send the bare stream.
        zlib_header = len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0
        wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    pieces: list[bytes] = []
    size = 0
    data = raw
    decoder = zlib.decompressobj(wbits)
    try:
        while True:
            piece = decoder.decompress(data, limit - size + 1)
            size += len(piece)
            if size > limit:
                raise RequestError("request body too large once decompressed", status=413,
                                   limit=limit)
            pieces.append(piece)
            data = decoder.unconsumed_tail
            if decoder.eof:
                if not decoder.unused_data:
                    break
                if encoding != "gzip":
                    raise RequestError(f"request body cannot be read: bytes after the end of "
                                       f"the {encoding} stream")
                # Concatenated gzip members are one gzip body.
                data, decoder = decoder.unused_data, zlib.decompressobj(wbits)
            elif not data and not piece:
                raise RequestError(f"request body cannot be read: {encoding} data ends early")
    except zlib.error as exc:
        raise RequestError(f"request body cannot be read: not valid {encoding}",
                           reason=str(exc)) from None
    return b"".join(pieces)


def _decode_brotli(raw: bytes, limit: int) -> bytes:
    try:
        import brotli  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        brotli = None
    if brotli is None or not hasattr(brotli.Decompressor(), "can_accept_more_data"):
        # Before Brotli 1.2 a decompressor cannot bound its output.
        raise RequestError("Content-Encoding br needs the Brotli package (1.2 or newer) on "
                           "this host", status=415, supported=["identity", "gzip", "deflate"])
    decoder = brotli.Decompressor()
    pieces: list[bytes] = []
    size = 0
    try:
        for start in range(0, max(len(raw), 1), _DECODE_PIECE):
            chunk = raw[start:start + _DECODE_PIECE]
            while True:
                piece = decoder.process(chunk, output_buffer_limit=limit - size + 1)
                size += len(piece)
                if size > limit:
                    raise RequestError("request body too large once decompressed", status=413,
                                       limit=limit)
                pieces.append(piece)
                chunk = b""
                if decoder.can_accept_more_data():
                    break
    except brotli.error as exc:
        raise RequestError("request body cannot be read: not valid br", reason=str(exc)) from None
    if not decoder.is_finished():
        raise RequestError("request body cannot be read: br data ends early")
    return b"".join(pieces)
