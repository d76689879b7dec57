"""The system shared memory extension: clients register POSIX shared memory regions and pass
tensors by reference, so a camera pipeline on the same board hands frames over without copying
them through HTTP (Triton's ``v2/systemsharedmemory`` API; docs/reference/serving.md §2).

A region is a file under ``/dev/shm`` (the key ``/cam0`` is ``/dev/shm/cam0``) mapped into this
process. Inputs are read through a zero-copy view and copied once, into the batch's buffer; outputs
are written straight into the region.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.api.codec import RequestError

log = logging.getLogger(__name__)

_KEY = re.compile(r"/?[A-Za-z0-9_.-]{1,200}")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}


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
            try:
                size = os.fstat(fd).st_size
                if offset + byte_size > size:
                    raise RequestError("region is larger than the shared memory object", key=key,
                                       needed=offset + byte_size, found=size)
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._regions[name] = _Region(name, key, offset, byte_size, mapping)
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
        for region in regions:
            try:
                region.mapping.close()
            except BufferError:
                # A request still reads from it; the mapping goes when that view is dropped.
                log.debug("region %s still in use; unmapped when released", region.name)

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
        return region, region.offset + offset

    def view(self, name: str, offset: int, byte_size: int) -> memoryview:
        region, start = self._span(name, offset, byte_size)
        return memoryview(region.mapping)[start:start + byte_size]

    def write(self, name: str, offset: int, data: np.ndarray) -> None:
        region, start = self._span(name, offset, data.nbytes)
        target = np.frombuffer(region.mapping, dtype=np.uint8, count=data.nbytes, offset=start)
        target[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)

    def close(self) -> None:
        self.unregister(None)
