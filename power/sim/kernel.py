"""The kernel's answer to writes into a fake board tree: a :class:`~power.io.Writer` that applies
the rules the real sysfs and debugfs files apply, so the board layer meets them in tests and in the
simulator.

Rules by JetPack release (``docs/reference/power_anchors.md`` section 3):

- **JetPack 4 (kernel 4.9).** devfreq ``min_freq`` above the current ``max_freq``, or ``max_freq``
  below ``min_freq``, fails with ``EINVAL``; so does the same inversion of cpufreq's
  ``scaling_min_freq``/``scaling_max_freq``. Accepted values are stored as written (cpufreq's
  clamped to the cpuinfo range).
- **JetPack 5, 6, 7 (5.10+).** The limits are QoS requests and never fail: devfreq's are kept in
  kHz (the minimum rounded down, the maximum up; a maximum of 0 removes the cap), the files show
  the effective limits (the requests within the table's range, the minimum lowered to the maximum
  when they cross), and a request is remembered, so raising the maximum later lifts a clamped
  minimum back. cpufreq's effective limits are resolved to table entries (the minimum up, the
  maximum down) [I].
- Every release: ``cur_freq``/``scaling_cur_freq`` move into the new limits (the nearest table
  entry inside them); an EMC ``rate`` is taken only while ``mrq_rate_locked`` is 1, rounded up to
  a ``possible_rates`` entry [I]; ``railgate_enable`` takes 0/1 and ``power/control`` auto/on,
  anything else is ``EINVAL``; ``railgate_delay`` and ``power/autosuspend_delay_ms`` take a
  non-negative decimal integer (ms, shown as written, the two files one value; ASSUMPTION, the
  reference gives neither their rules nor their place: a negative delay, which runtime PM reads
  as "never suspend", is refused here as the board layer never writes one); a file the kernel does not let anyone write (``cur_freq``, a
  temperature) fails with ``EACCES``, a missing one with ``ENOENT``; a cpufreq policy whose CPUs
  are all offline answers ``EBUSY`` to writes. (The real kernel answers ``EBUSY`` to reads of
  such a policy's attributes as well; reads do not go through a writer, so the tree still shows
  them: tests that need the failing reads patch them at ``power.io``'s ``os`` seam,
  ``tests/test_power_probe_offline.py``.)

``read_only``: paths that fail with ``EACCES`` as a root-only file does for a user (the tests run
as root, where a chmod would not stop a write). Every accepted write is appended to :attr:`log`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from power.io import check_relpath, read_int, read_text

_DEVFREQ_LIMITS = ("min_freq", "max_freq")
_CPUFREQ_LIMITS = ("scaling_min_freq", "scaling_max_freq")


def _error(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


class FakeKernel:
    def __init__(self, root: Path, jetpack: int, *, read_only: frozenset[str] = frozenset()
                 ) -> None:
        self.root = Path(root)
        self.jetpack = jetpack
        self.read_only = set(read_only)
        self.log: list[tuple[str, str]] = []
        # QoS requests of 5.10+ kernels, by limit file: (min request, max request), in the file's
        # unit; absent until the first write, when the shown values are the requests.
        self._requests: dict[str, tuple[int, int]] = {}
        self._unlocked_rate: dict[str, int] = {}

    @property
    def clamps(self) -> bool:
        return self.jetpack >= 5

    def write(self, relpath: str, value: str) -> None:
        check_relpath(relpath)
        path = self.root / relpath
        if not path.is_file():
            raise _error(errno.ENOENT, path)
        if relpath in self.read_only:
            raise _error(errno.EACCES, path)
        folder, name = relpath.rsplit("/", 1)
        if name in _DEVFREQ_LIMITS and "/devfreq/" in relpath:
            self._devfreq(path, folder, name, self._number(path, value))
        elif name in _CPUFREQ_LIMITS:
            self._cpufreq(path, folder, name, self._number(path, value))
        elif name == "mrq_rate_locked":
            self._choice(path, value, ("0", "1"))
            self._emc_lock(folder, value.strip() == "1")
        elif name == "rate" and folder.endswith("clk/emc"):
            self._emc_rate(path, folder, self._number(path, value))
        elif name == "railgate_enable":
            self._choice(path, value, ("0", "1"))
            self._runtime_status(folder, gated_allowed=value == "1")
        elif relpath.endswith("power/control"):
            self._choice(path, value, ("auto", "on"))
            self._runtime_status(folder.rsplit("/", 1)[0], gated_allowed=value == "auto")
        elif name == "railgate_delay" or relpath.endswith("power/autosuspend_delay_ms"):
            self._number(path, value)
            self._put(path, value.strip())
            self._mirror_delay(folder.removesuffix("/power"), value.strip())
        elif name == "online" and "/cpu/cpu" in relpath:
            self._choice(path, value, ("0", "1"))
        elif name in ("emc_iso_cap", "emc") and "nvpmodel_" in relpath:
            self._number(path, value)
            self._put(path, value)
        elif name in ("pwm1", "pwm1_enable"):
            number = self._number(path, value)
            if name == "pwm1" and not 0 <= number <= 255:
                raise _error(errno.EINVAL, path)
            self._put(path, value)
        else:
            raise _error(errno.EACCES, path)
        self.log.append((relpath, value))

    # -- rules ------------------------------------------------------------------------------

    @staticmethod
    def _number(path: Path, value: str) -> int:
        text = value.strip()
        if not (text.isascii() and text.isdigit()):  # kstrtoul takes ASCII digits only
            raise _error(errno.EINVAL, path)
        return int(text)

    def _choice(self, path: Path, value: str, words: tuple[str, ...]) -> None:
        if value.strip() not in words:
            raise _error(errno.EINVAL, path)
        self._put(path, value.strip())

    @staticmethod
    def _put(path: Path, value: str | int) -> None:
        path.write_text(f"{value}\n")

    def _table(self, relpath: str) -> list[int]:
        return sorted(int(word) for word in read_text(self.root, relpath).split())

    def _devfreq(self, path: Path, folder: str, name: str, value: int) -> None:
        table = self._table(f"{folder}/available_frequencies")
        cur_min = read_int(self.root, f"{folder}/min_freq")
        cur_max = read_int(self.root, f"{folder}/max_freq")
        if not self.clamps:
            if name == "min_freq" and value > cur_max or name == "max_freq" and value < cur_min:
                raise _error(errno.EINVAL, path)
            self._put(path, value)
            new_min, new_max = (value, cur_max) if name == "min_freq" else (cur_min, value)
        else:
            req_min, req_max = self._requests.get(folder, (cur_min, cur_max))
            if name == "min_freq":
                req_min = value // 1000 * 1000
            else:
                req_max = table[-1] if value == 0 else -(-value // 1000) * 1000
            self._requests[folder] = (req_min, req_max)
            new_max = min(max(req_max, table[0]), table[-1])
            new_min = min(max(req_min, table[0]), new_max)
            self._put(self.root / folder / "min_freq", new_min)
            self._put(self.root / folder / "max_freq", new_max)
        self._move_cur(f"{folder}/cur_freq", table, new_min, new_max)

    def _cpufreq(self, path: Path, folder: str, name: str, value: int) -> None:
        cpus = read_text(self.root, f"{folder}/related_cpus").split()
        cpu_dir = folder.rsplit("/", 2)[0]
        if all(read_text(self.root, f"{cpu_dir}/cpu{cpu}/online") == "0" for cpu in cpus):
            raise _error(errno.EBUSY, path)  # an inactive policy (all its CPUs offline)
        table = self._table(f"{folder}/scaling_available_frequencies")
        low = read_int(self.root, f"{folder}/cpuinfo_min_freq")
        high = read_int(self.root, f"{folder}/cpuinfo_max_freq")
        cur_min = read_int(self.root, f"{folder}/scaling_min_freq")
        cur_max = read_int(self.root, f"{folder}/scaling_max_freq")
        value = min(max(value, low), high)
        if not self.clamps:
            if name == "scaling_min_freq" and value > cur_max or \
                    name == "scaling_max_freq" and value < cur_min:
                raise _error(errno.EINVAL, path)
            self._put(path, value)
            new_min, new_max = (value, cur_max) if name == "scaling_min_freq" else (cur_min, value)
        else:
            req_min, req_max = self._requests.get(folder, (cur_min, cur_max))
            req_min, req_max = (value, req_max) if name == "scaling_min_freq" else (req_min, value)
            self._requests[folder] = (req_min, req_max)
            new_max = max([khz for khz in table if khz <= req_max] or [table[0]])
            new_min = min([khz for khz in table if khz >= min(req_min, new_max)] or [new_max])
            new_min = min(new_min, new_max)
            self._put(self.root / folder / "scaling_min_freq", new_min)
            self._put(self.root / folder / "scaling_max_freq", new_max)
        self._move_cur(f"{folder}/scaling_cur_freq", table, new_min, new_max)

    def _move_cur(self, relpath: str, table: list[int], low: int, high: int) -> None:
        try:
            cur = read_int(self.root, relpath)
        except (OSError, ValueError):
            return
        if low <= cur <= high:
            return
        inside = [freq for freq in table if low <= freq <= high]
        if not inside:  # limits between two entries: the hardware runs the entry below the cap
            inside = [max([freq for freq in table if freq <= high] or [table[0]])]
        self._put(self.root / relpath, min(inside) if cur < low else max(inside))

    def _emc_rate(self, path: Path, folder: str, value: int) -> None:
        if read_int(self.root, f"{folder}/mrq_rate_locked") != 1:
            return  # BPMP ignores a rate while the clock is not locked
        possible_path = self.root / folder / ".." / ".." / "emc" / "possible_rates"
        rates = sorted(int(word) * 1000 for word in possible_path.read_text().split())
        above = [rate for rate in rates if rate >= value]
        self._put(path, above[0] if above else rates[-1])

    def _emc_lock(self, folder: str, locked: bool) -> None:
        """Unlocking hands the rate back to the board's scaling: the fake returns to the rate it
        had before the lock (the simulator may move it from there)."""
        rate_path = self.root / folder / "rate"
        if locked:
            self._unlocked_rate.setdefault(folder, read_int(self.root, f"{folder}/rate"))
        elif folder in self._unlocked_rate:
            self._put(rate_path, self._unlocked_rate.pop(folder))

    def _mirror_delay(self, device_dir: str, value: str) -> None:
        """nvgpu's ``railgate_delay`` sets the device's runtime-PM autosuspend delay: the two
        files show one value (ASSUMPTION: power/sysfs/railgate.py)."""
        for name in ("railgate_delay", "power/autosuspend_delay_ms"):
            other = self.root / device_dir / name
            if other.is_file():
                self._put(other, value)

    def _runtime_status(self, device_dir: str, *, gated_allowed: bool) -> None:
        status = self.root / device_dir / "power" / "runtime_status"
        if status.is_file() and not gated_allowed:
            self._put(status, "active")


__all__ = ["FakeKernel"]
