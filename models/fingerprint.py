"""The device fingerprint a TensorRT engine is bound to: TensorRT build, GPU model, L4T release.

A serialized engine only loads on the TensorRT build and GPU it was made with, so the builder names
each plan ``engines/<fingerprint>.plan`` (design 5.1) and the on-device runtime computes the same
fingerprint to pick a prebuilt engine without importing the builder. So this module imports neither
TensorRT nor torch: the compute capability and multiprocessor count are asked of the CUDA driver
through ctypes, the L4T release is read from ``/etc/nv_tegra_release``, and the TensorRT version is
the caller's ``tensorrt.__version__``.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from agent.errors import EngineError

log = logging.getLogger(__name__)

# CUDA driver attribute ids (cuda.h, CUdevice_attribute).
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


@dataclass(frozen=True)
class GpuModel:
    """What tells GPUs apart for TensorRT: the architecture (compute capability) and, within one,
    the size (multiprocessors). Every Orin module is sm87, from the AGX's 16 multiprocessors to
    the 4 of an Orin Nano 4GB; a plan tuned on one size is not meant for another."""

    compute_capability: str  # "8.7"
    multiprocessors: int | None = None


@dataclass(frozen=True)
class DeviceFingerprint:
    """What an engine is bound to: TensorRT version, GPU model, L4T release."""

    trt_version: str
    compute_capability: str
    l4t_release: str | None = None
    multiprocessors: int | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\d+\.\d+", self.compute_capability):
            raise EngineError("compute capability must look like '8.7'", found=self.compute_capability)
        if not self.trt_version or not re.fullmatch(r"[0-9A-Za-z.+-]+", self.trt_version):
            raise EngineError("unexpected TensorRT version string", found=self.trt_version)
        if self.l4t_release is not None and not re.fullmatch(r"\d+(\.\d+)*", self.l4t_release):
            raise EngineError("L4T release must look like '36.4.3'", found=self.l4t_release)
        if self.multiprocessors is not None and (not isinstance(self.multiprocessors, int)
                                                 or self.multiprocessors < 1):
            raise EngineError("multiprocessor count must be a positive integer",
                              found=self.multiprocessors)

    @classmethod
    def of(cls, trt_version: str, gpu: GpuModel, l4t_release: str | None) -> DeviceFingerprint:
        return cls(trt_version=trt_version, compute_capability=gpu.compute_capability,
                   l4t_release=l4t_release, multiprocessors=gpu.multiprocessors)

    def key(self) -> str:
        """A filesystem-safe name, e.g. ``trt10.3.0.30-sm87-mp16-l4t36.4.3``, for
        ``engines/<key>.plan``.

        The full TensorRT version is kept (not just major.minor.patch): the standard runtime only
        loads a plan built by the exact same build. ``mp16`` is the multiprocessor count, which
        tells an AGX Orin (16, or 14 on the 32GB) from an Orin NX or Nano (8, or 4 on the Nano
        4GB), all sm87; an Orin NX and an Orin Nano 8GB still share a key (same GPU, other
        clocks), so a plan from one loads on the other.
        """
        version = re.sub(r"[^0-9A-Za-z.]", "_", self.trt_version)
        key = f"trt{version}-sm{self.compute_capability.replace('.', '')}"
        if self.multiprocessors is not None:
            key += f"-mp{self.multiprocessors}"
        if self.l4t_release is not None:
            key += f"-l4t{self.l4t_release}"
        return key


_TEGRA_RELEASE = re.compile(
    r"^#\s*R(?P<major>\d+)\s*\(release\),\s*REVISION:\s*(?P<revision>\d+(?:\.\d+)*)"
)


def read_l4t_release(root: Path = Path("/")) -> str | None:
    """The L4T release (``"36.4.3"``) from ``<root>/etc/nv_tegra_release``, or None off a Jetson.

    The file's first line reads like ``# R36 (release), REVISION: 4.3, GCID: ..., BOARD: generic,
    EABI: aarch64, DATE: ...`` (older releases omit the space before ``(release)``).
    """
    path = Path(root) / "etc" / "nv_tegra_release"
    try:
        first_line = path.read_text(encoding="utf-8", errors="replace").splitlines()[0]
    except (FileNotFoundError, NotADirectoryError, IndexError):
        return None
    except OSError as exc:
        log.warning("cannot read %s: %s", path, exc)
        return None
    match = _TEGRA_RELEASE.match(first_line.strip())
    if match is None:
        # Engines stay keyed by TensorRT version and SM, which decide compatibility; the L4T part
        # is only a tie-breaker, so an unknown format must not stop a build.
        log.warning("unrecognised %s first line: %r", path, first_line)
        return None
    return f"{match['major']}.{match['revision']}"


def cuda_gpu_model(device_index: int = 0, *, library: str = "libcuda.so.1") -> GpuModel:
    """The compute capability and multiprocessor count of a CUDA device, asked of the driver
    through ctypes.

    Raises:
        EngineError: if the driver library cannot be loaded or a driver call fails.
    """
    try:
        cuda = ctypes.CDLL(library)
    except OSError as exc:
        raise EngineError(
            "cannot load the CUDA driver (no NVIDIA driver on this machine?)",
            library=library,
            reason=str(exc),
        ) from None

    def check(call: str, status: int) -> None:
        if status == 0:
            return
        name = ctypes.c_char_p()
        described = cuda.cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value
        raise EngineError(
            f"CUDA driver call {call} failed",
            status=status,
            error=name.value.decode() if described and name.value else None,
        )

    cuda.cuInit.argtypes = [ctypes.c_uint]
    cuda.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    cuda.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    check("cuInit", cuda.cuInit(0))
    device = ctypes.c_int()
    check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), device_index))

    def attribute(number: int) -> int:
        value = ctypes.c_int()
        check("cuDeviceGetAttribute", cuda.cuDeviceGetAttribute(ctypes.byref(value), number, device))
        return value.value

    major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    return GpuModel(f"{major}.{minor}", attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))
