"""Which image sizes a model with a dynamic height or width takes, found by running it.

A graph that declares an axis dynamic does not take every size on it: a text recognizer whose
height is folded into its channels takes only the height it was trained at, a detector whose
feature pyramid adds upsampled maps to skip connections takes only multiples of its largest
stride (32 for YOLO and DB), and a large enough frame exhausts memory. :func:`probe_sizes` finds,
for each dynamic axis, whether it is really fixed, the stride its sizes are multiples of and the
largest size up to a bound that runs, in a handful of runs an axis. It knows nothing of ONNX
Runtime or of the build: it calls a runner with a frame (``{"height": 48, "width": 320}``) that
answers None when the model ran and the reason when it did not.

Every size that ends up in the spans (smallest, deployment, largest) has been run, jointly with
the other axis's extreme, so a TensorRT profile built from them holds only sizes that run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Frame = Mapping[str, int]
Runner = Callable[[Frame], "str | None"]

# Strides beyond 64 are rare (YOLO's P6 heads use 64); a larger one reads as a fixed axis, which
# keeps the profile safe (it holds only sizes that ran), only narrower than it could be.
LARGEST_STRIDE = 64
# Runs a search for an axis's largest size may take after the bound failed: a range of 64
# strides is found exactly; a wider one to within 1/64 of it, always at a size that ran.
LARGEST_SEARCH_RUNS = 6
# How often the largest frame (both axes at their largest) is shrunk when it fails while each
# axis alone ran at its largest (memory, most often).
CORNER_SHRINKS = 3
MEMORY_WORDS = ("bad_alloc", "Failed to allocate", "out of memory", "MemoryError")


def is_memory_failure(reason: str | None) -> bool:
    """Whether a runner's failure ``reason`` is the host running out of memory (such a size is
    too large for this host, not one the model refuses)."""
    return reason is not None and any(word in reason for word in MEMORY_WORDS)


class SizeRuns:
    """The model run at frames through ``run``, each frame once: outcomes are remembered, and the
    runs counted and timed for the report."""

    def __init__(self, run: Runner) -> None:
        self._run = run
        self.outcomes: dict[tuple[tuple[str, int], ...], str | None] = {}
        self.seconds = 0.0

    @property
    def count(self) -> int:
        return len(self.outcomes)

    def reason(self, frame: Frame) -> str | None:
        """None when the model runs at ``frame``, else why not (runs it the first time)."""
        key = tuple(sorted(frame.items()))
        if key not in self.outcomes:
            started = time.perf_counter()
            self.outcomes[key] = self._run(dict(frame))
            self.seconds += time.perf_counter() - started
        return self.outcomes[key]

    def ok(self, frame: Frame) -> bool:
        return self.reason(frame) is None


@dataclass
class AxisSizes:
    """What the runs found for one dynamic axis (``height`` or ``width``) and its profile span.

    Attributes:
        stride: Sizes the axis takes are the calibrated one plus or minus multiples of it
            (multiples of it, mostly: a DeepLab takes 32n + 1); None when only the calibrated size
            ran (a fixed axis).
        failed: Sizes on this axis that did not run, with the other axes at a size that did, and
            why (the first line of the runner's reason).
        bound: The largest size the search went up to.
    """

    name: str
    calibrated: int
    stride: int | None
    smallest: int
    optimum: int
    largest: int
    bound: int
    failed: dict[int, str] = field(default_factory=dict)

    @property
    def span(self) -> list[int]:
        return [self.smallest, self.optimum, self.largest]

    def on_stride(self, size: int, rounding: str = "nearest") -> int:
        """The size the axis takes nearest ``size`` (``rounding``: ``nearest``, ``down`` or
        ``up``), at least 1: the calibrated size plus a multiple of the stride."""
        if self.stride is None:
            return self.calibrated
        steps = (size - self.calibrated) / self.stride
        whole = {"down": math.floor, "up": math.ceil}.get(rounding, round)(steps)
        result = self.calibrated + int(whole) * self.stride
        while result < 1:
            result += self.stride
        return result

    def takes(self, size: int) -> bool:
        """Whether ``size`` is one of the sizes the findings allow (not whether it ran)."""
        return self.on_stride(size) == size

    def describe(self) -> str:
        """One line for the log and the report: ``height: fixed at 48 (16, 47, 49 and 80 fail)``,
        ``width: multiples of 32 from 320 to 640``, ``height: any size from 48 to 80 (81 fails)``."""
        if self.stride is None:
            return self.describe_sizes()
        line = f"{self.describe_sizes()} from {self.smallest} to {self.largest}"
        above = sorted(size for size in self.failed if size > self.largest)
        if above:
            line += (f" ({above[0]} fails"
                     + (": not enough memory" if is_memory_failure(self.failed[above[0]]) else "")
                     + ")")
        elif self.largest == self.on_stride(self.bound, "down"):
            line += " (the largest tried)"
        return line

    def describe_sizes(self) -> str:
        """The sizes the axis takes, without the span: ``height: fixed at 48 (16, 47, 49 and 80
        fail)``, ``width: multiples of 32``, ``width: 32n + 1``, ``width: any size``."""
        if self.stride is None:
            return f"{self.name}: fixed at {self.calibrated} ({_listed(sorted(self.failed))} fail)"
        phase = self.calibrated % self.stride
        if self.stride == 1:
            return f"{self.name}: any size"
        if phase == 0:
            return f"{self.name}: multiples of {self.stride}"
        return f"{self.name}: {self.stride}n + {phase}"

    def to_report(self) -> dict[str, object]:
        return {
            "fixed": self.stride is None,
            "stride": self.stride,
            "span": self.span,
            "calibrated": self.calibrated,
            "bound": self.bound,
            "failed": {str(size): reason for size, reason in sorted(self.failed.items())},
            "found": self.describe(),
        }


@dataclass
class SizeFindings:
    """:func:`probe_sizes`'s answer: each dynamic axis's sizes, or why the probe stopped.

    Attributes:
        base_failure: Why the model did not run at the calibrated frame (nothing else was tried).
        deployed_failure: Why the model did not run at the deployment frame: a size a fixed axis or
            a stride does not allow, or the runner's reason (the axes' spans are then unset).
        notes: What else was shrunk and why (the largest or smallest frame failing as a whole).
    """

    axes: dict[str, AxisSizes]
    runs: int = 0
    seconds: float = 0.0
    base_failure: str | None = None
    deployed_failure: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.base_failure is None and self.deployed_failure is None

    def lines(self) -> list[str]:
        return [axis.describe() for axis in self.axes.values()] + self.notes


def probe_sizes(runs: SizeRuns, calibrated: Frame, deployed: Frame, bound: Frame) -> SizeFindings:
    """Find the sizes each axis of ``calibrated`` takes, and the profile spans around ``deployed``.

    Each axis's stride is found around its calibrated size (the other axes calibrated), and its
    largest size by running it from the deployment size up to ``bound`` (the other axes at their
    deployment sizes). The smallest is the smaller of the calibrated and deployment sizes. The
    largest frame (every axis at its largest) and the smallest are then run as a whole; a
    largest frame that fails (memory, most often) is shrunk towards the deployment frame.

    Args:
        runs: The model's runner.
        calibrated: A frame the model was calibrated at (it should run: if it does not, nothing
            else is tried).
        deployed: The deployment frame: the spans' optimum.
        bound: Per axis, the largest size worth trying (at least the deployment size).
    """
    findings = SizeFindings(axes={})
    base = dict(calibrated)
    findings.base_failure = runs.reason(base)
    if findings.base_failure is None:
        for name, size in calibrated.items():
            failed: dict[int, str] = {}
            stride = find_stride(
                lambda candidate: _ran({**base, name: candidate}, runs, failed, name), size)
            findings.axes[name] = AxisSizes(name, size, stride, size, size, size,
                                            bound=max(bound[name], deployed[name]), failed=failed)
        findings.deployed_failure = _deployment_failure(findings.axes, deployed) or runs.reason(
            deployed)
        if findings.deployed_failure is None:
            _find_spans(runs, findings, deployed)
    findings.runs, findings.seconds = runs.count, runs.seconds
    return findings


def find_stride(runs_at: Callable[[int], bool], size: int) -> int | None:
    """The stride an axis's sizes are multiples of, found around ``size`` (which runs); None
    when no other size nearby runs (the axis is fixed).

    With a power of two ``s``, ``size + s`` is ``size`` plus a multiple of the stride (a power of
    two too) exactly when ``s`` is at least the stride: so once one ``s`` runs in a direction (up
    or down), every smaller one in that direction is within the axis's limits, only the stride
    decides, and the smallest that runs is found by bisecting the exponents: three runs for the
    seven candidates 1..64, after the one or two that pick the direction. An axis whose
    neighbours at the largest candidate fail in both directions gets one more chance at
    ``size +- 1`` (a narrow range of any size), before it counts as fixed.
    """
    top = min(LARGEST_STRIDE, 1 << (size.bit_length() - 1))  # the largest power of two <= size
    for step in (top, -top):
        if size + step >= 1 and runs_at(size + step):
            direction = 1 if step > 0 else -1
            break
    else:
        if runs_at(size + 1) or (size > 1 and runs_at(size - 1)):
            return 1
        return None
    low, high = 0, top.bit_length() - 1  # exponents; 2**high runs
    while low < high:
        middle = (low + high) // 2
        if runs_at(size + direction * (1 << middle)):
            high = middle
        else:
            low = middle + 1
    return 1 << low


def find_largest(runs_at: Callable[[int], bool], known: int, bound: int, stride: int) -> int:
    """The largest of ``known`` (which runs) plus a multiple of ``stride`` up to ``bound`` that
    runs: the bound itself when it runs (one run), else bisected between the two for at most
    :data:`LARGEST_SEARCH_RUNS` runs, so the answer is always a size that ran."""
    high = known + (bound - known) // stride * stride
    if high <= known or runs_at(high):
        return max(known, high)
    low = known
    for _ in range(LARGEST_SEARCH_RUNS):
        if high - low <= stride:
            break
        middle = low + (high - low) // stride // 2 * stride
        if runs_at(middle):
            low = middle
        else:
            high = middle
    return low


def nearest_frame(runs: SizeRuns, findings: SizeFindings, wanted: Frame) -> dict[str, int]:
    """A frame that runs, near ``wanted`` (one that does not): a fixed axis at its size, others
    at the size on their stride nearest ``wanted``, or, above the calibrated size, the largest
    up to it that runs; shrunk towards the calibrated frame when that frame as a whole fails.
    For an error's way out, after :func:`probe_sizes` found the axes' strides."""
    calibrated = {name: axis.calibrated for name, axis in findings.axes.items()}
    nearest = {}
    for name, axis in findings.axes.items():
        if axis.stride is None:
            nearest[name] = axis.calibrated
            continue
        size = axis.on_stride(wanted[name])
        if size > axis.calibrated:
            size = find_largest(lambda candidate: _ran({**calibrated, name: candidate}, runs,
                                                       axis.failed, name),
                                axis.calibrated, size, axis.stride)
        elif not runs.ok({**calibrated, name: size}):
            size = axis.calibrated
        nearest[name] = size
    return _shrunk_until_it_runs(runs, findings, nearest, calibrated)


def _ran(frame: Frame, runs: SizeRuns, failed: dict[int, str], axis: str) -> bool:
    """Whether ``frame`` runs; a failure is noted in ``failed`` under its size on ``axis`` (the
    one axis the frame changes)."""
    reason = runs.reason(frame)
    if reason is not None:
        failed.setdefault(frame[axis], reason)
    return reason is None


def _deployment_failure(axes: Mapping[str, AxisSizes], deployed: Frame) -> str | None:
    """Why the deployment frame cannot be one the model takes, seen from the axes' findings
    alone (a fixed axis at another size, a size off the stride), or None."""
    for name, axis in axes.items():
        size = deployed[name]
        if axis.stride is None and size != axis.calibrated:
            return f"its {name} is fixed at {axis.calibrated}, not {size}"
        if axis.stride is not None and not axis.takes(size):
            phase = axis.calibrated % axis.stride
            rule = f"a multiple of {axis.stride}" if phase == 0 else f"{axis.stride}n + {phase}"
            return f"its {name} must be {rule}, not {size}"
    return None


def _find_spans(runs: SizeRuns, findings: SizeFindings, deployed: Frame) -> None:
    """Each axis's span from the deployment frame, which runs: the largest is the bound when the
    model runs with every axis at its bound (one run, the costliest, settles most models), else
    each axis's own largest (the other axes at their deployment sizes), shrunk as a whole when
    the frame of all of them fails. The smallest frame is run last."""
    axes = findings.axes
    for name, axis in axes.items():
        axis.optimum = deployed[name]
        axis.smallest = min(axis.calibrated, axis.optimum)
        axis.largest = max(axis.optimum, axis.on_stride(axis.bound, "down"))
    if not runs.ok({name: axis.largest for name, axis in axes.items()}):
        for name, axis in axes.items():
            if axis.stride is not None:
                axis.largest = find_largest(
                    lambda size: _ran({**deployed, name: size}, runs, axis.failed, name),
                    axis.optimum, axis.bound, axis.stride)
        _shrink_largest(runs, findings, deployed)
    smallest = {name: axis.smallest for name, axis in axes.items()}
    reason = runs.reason(smallest)
    if reason is not None:
        findings.notes.append(f"the smallest frame {_frame_text(smallest)} failed ({reason}): "
                              "the smallest sizes are the deployment frame's")
        for axis in axes.values():
            axis.smallest = axis.optimum


def _shrink_largest(runs: SizeRuns, findings: SizeFindings, deployed: Frame) -> None:
    """Each axis alone runs at its largest; when all of them at once do not (memory, most often),
    shrink that frame towards the deployment frame."""
    axes = findings.axes
    largest = _shrunk_until_it_runs(runs, findings, {name: axis.largest
                                                     for name, axis in axes.items()}, deployed)
    for name, size in largest.items():
        axes[name].largest = size


def _shrunk_until_it_runs(runs: SizeRuns, findings: SizeFindings, frame: Frame, base: Frame
                          ) -> dict[str, int]:
    """``frame``, or, while it fails, each axis's distance from ``base`` (a frame that runs)
    halved on its stride, a few times; ``base`` when it still fails. Failures become notes."""
    current = dict(frame)
    for _ in range(CORNER_SHRINKS):
        reason = runs.reason(current)
        if reason is None:
            return current
        findings.notes.append(f"the frame {_frame_text(current)} failed ({reason}): shrunk "
                              f"towards {_frame_text(base)}")
        step = {name: findings.axes[name].stride or 1 for name in current}
        current = {name: base[name] + (size - base[name]) // 2 // step[name] * step[name]
                   for name, size in current.items()}
    return current if runs.ok(current) else dict(base)


def _frame_text(frame: Frame) -> str:
    return " x ".join(f"{name} {size}" for name, size in frame.items())


def _listed(sizes: list[int]) -> str:
    texts = [str(size) for size in sizes]
    return texts[0] if len(texts) == 1 else ", ".join(texts[:-1]) + " and " + texts[-1]
