"""The system shared memory extension: clients register POSIX shared memory regions and pass
tensors by reference, so a camera pipeline on the same board hands frames over without copying
them through HTTP (Triton's ``v2/systemsharedmemory`` API; docs/reference/serving.md §2).

A region is a file under ``/dev/shm`` (the key ``/cam0`` is ``/dev/shm/cam0``), opened once at
register and kept open (unlinking it afterwards is harmless). Inputs are read with ``preadv``
straight into the batch's buffer, one copy as from a mapping; outputs are written with
``pwritev``. Not mapping the file is deliberate: a client that shrinks it after registering would
make any read of a mapping past the new end kill the daemon with SIGBUS, where a read from the
file only comes back short and the request gets a 400.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.api.codec import RequestError
from agent.scattered import DeferredArray

log = logging.getLogger(__name__)

_KEY = re.compile(r"/?[A-Za-z0-9_.-]{1,200}")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class _OpenFile:
    """A region's open file; closed once neither the registry nor a request holds it, so an
    unregister during a request does not pull the file from under it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        weakref.finalize(self, os.close, fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    file: _OpenFile

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def check_size(self, end: int) -> None:
        """Refuse when the file no longer reaches ``end`` (its owner shrank it)."""
        size = self.file.size()
        if size < end:
            raise RequestError("shared memory object is smaller than when it was registered",
                               region=self.name, key=self.key, needed=end, found=size)


class SharedMemoryArray(DeferredArray):
    """An input tensor in a registered region, read when the batch is assembled."""

    __slots__ = ("_region", "_start")

    def __init__(self, region: _Region, start: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        super().__init__(dtype, shape)
        self._region = region
        self._start = start

    def copy_into(self, target: np.ndarray) -> None:
        view = self.check_target(target)
        done = 0
        while done < len(view):
            count = os.preadv(self._region.file.fd, [view[done:]], self._start + done)
            if count == 0:
                self._region.check_size(self._start + len(view))  # raises: it shrank
                raise RequestError("shared memory object ended early", region=self._region.name)
            done += count

    def __repr__(self) -> str:
        return (f"SharedMemoryArray(region={self._region.name!r}, shape={self.shape}, "
                f"dtype={self.dtype})")


class SharedMemoryTarget:
    """Where an output tensor goes: a span of a region, taken when the request is decoded. It
    holds the region's open file, so unregistering the region while the request runs does not
    turn a computed answer into an error."""

    __slots__ = ("_region", "_start", "byte_size")

    def __init__(self, region: _Region, start: int, byte_size: int) -> None:
        self._region = region
        self._start = start
        self.byte_size = byte_size

    @property
    def region(self) -> str:
        return self._region.name

    def write(self, data: np.ndarray) -> None:
        """Write ``data`` (at most ``byte_size`` bytes) at the span's start."""
        if data.nbytes > self.byte_size:
            raise RequestError("output does not fit its shared memory region",
                               region=self._region.name, needed=data.nbytes, found=self.byte_size)
        self._region.check_size(self._start + data.nbytes)
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        done = 0
        while done < len(view):
            done += os.pwritev(self._region.file.fd, [view[done:]], self._start + done)


class SystemSharedMemory:
    """Registered regions by name (thread-safe)."""

    def __init__(self, root: Path = Path("/dev/shm"), *, max_regions: int = 64) -> None:
        self._root = root
        self._max_regions = max_regions
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError("invalid region name", found=name)
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
            raise RequestError("invalid shared memory key (expected like '/name')", found=key)
        for field_name, value in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RequestError(f"'{field_name}' must be a non-negative integer", found=value)
        if byte_size == 0:
            raise RequestError("'byte_size' must be > 0")
        with self._lock:
            if name in self._regions:
                raise RequestError("shared memory region already registered", region=name)
            if len(self._regions) >= self._max_regions:
                raise RequestError("too many shared memory regions", limit=self._max_regions)
            path = self._root / key.lstrip("/")
            try:
                fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:
                raise RequestError("cannot open shared memory key", key=key,
                                   reason=exc.strerror or str(exc)) from None
            file = _OpenFile(fd)
            size = file.size()
            if offset + byte_size > size:
                raise RequestError("region is larger than the shared memory object", key=key,
                                   needed=offset + byte_size, found=size)
            self._regions[name] = _Region(name, key, offset, byte_size, file)
        log.info("registered shared memory region %s (%s, %d bytes at %d)", name, key, byte_size,
                 offset)

    def unregister(self, name: str | None = None) -> None:
        with self._lock:
            if name is None:
                regions = list(self._regions.values())
                self._regions.clear()
            else:
                region = self._regions.pop(name, None)
                if region is None:
                    raise RequestError("shared memory region is not registered", region=name)
                regions = [region]
        for region in regions:  # each file closes when the last request reading it is done
            log.info("unregistered shared memory region %s", region.name)

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if name is None:
                return [region.status() for region in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise RequestError("shared memory region is not registered", region=name, status=404)
        return [region.status()]

    def _span(self, name: str, offset: int, byte_size: int) -> tuple[_Region, int]:
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise RequestError("shared memory region is not registered", region=name)
        if offset + byte_size > region.byte_size:
            raise RequestError("tensor does not fit in the shared memory region", region=name,
                               needed=offset + byte_size, found=region.byte_size)
        start = region.offset + offset
        region.check_size(start + byte_size)
        return region, start

    def target(self, name: str, offset: int, byte_size: int) -> SharedMemoryTarget:
        """The span of ``byte_size`` bytes at ``offset`` in a region, for an output; refused when
        the region cannot hold it now."""
        region, start = self._span(name, offset, byte_size)
        return SharedMemoryTarget(region, start, byte_size)

    def array(self, name: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]
              ) -> SharedMemoryArray:
        """An input tensor in a region, read when it is copied into its batch."""
        dtype = np.dtype(dtype)
        byte_size = math.prod(shape) * dtype.itemsize
        region, start = self._span(name, offset, byte_size)
        return SharedMemoryArray(region, start, dtype, shape)

    def close(self) -> None:
        self.unregister(None)
