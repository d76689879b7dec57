"""The engine builder and the TensorRT backend type-check against the TensorRT stubs (no TensorRT
can run here).

mypy runs with the repaired ``tensorrt-stubs`` (tools/trt_stubs.py) on its path, so every
``trt.*`` call in models/engine/ and agent/backends/tensorrt/ (with its buffers,
agent/backends/cuda_buffers.py) is checked for names, argument types and returns. A
second run on a deliberately wrong call proves the stubs were really in use (an unresolved
``tensorrt`` would make everything ``Any`` and pass silently).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.trt_stubs import repaired_stubs_or_skip, stubs_tool

pytest.importorskip("mypy")

REPO = Path(__file__).resolve().parents[1]


def _mypy(config: Path, *targets: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--no-incremental",
            "--cache-dir",
            str(config.parent / ".mypy_cache"),
            *map(str, targets),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def mypy_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stubs = repaired_stubs_or_skip(tmp_path_factory.mktemp("trt-stubs"))
    config: Path = stubs_tool().write_mypy_config(stubs, project_root=REPO)
    return config


@pytest.fixture(scope="module")
def every_package(mypy_config: Path) -> subprocess.CompletedProcess[str]:
    """One mypy run over agent, models, power and pruning (with the TensorRT stubs), which the
    tests below read: the narrower checks look at their own files' errors in it, instead of
    running mypy again on a part of the same code."""
    return _mypy(mypy_config, *(REPO / package for package in ("agent", "models", "power",
                                                                 "pruning")))


def _errors_in(result: subprocess.CompletedProcess[str], *paths: str) -> list[str]:
    return [line for line in result.stdout.splitlines()
            if ": error:" in line and line.startswith(paths)]


def test_builder_type_checks_against_the_stubs(
        every_package: subprocess.CompletedProcess[str]) -> None:
    assert (REPO / "models" / "engine" / "builder.py").is_file()  # still where the run looks
    assert _errors_in(every_package, "models/engine/") == [], every_package.stdout


def test_backend_type_checks_against_the_stubs(
        every_package: subprocess.CompletedProcess[str]) -> None:
    assert (REPO / "agent" / "backends" / "tensorrt" / "backend.py").is_file()
    assert _errors_in(every_package, "agent/backends/tensorrt/",
                      "agent/backends/cuda_buffers.py") == [], every_package.stdout


def test_every_package_type_checks(every_package: subprocess.CompletedProcess[str]) -> None:
    """agent, models, power and pruning are clean under mypy (with the TensorRT stubs)."""
    assert every_package.returncode == 0, every_package.stdout + every_package.stderr


def test_the_stubs_are_really_used(mypy_config: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong_trt_use.py"
    wrong.write_text(
        "import tensorrt as trt\n"
        "config = trt.Builder(trt.Logger()).create_builder_config()\n"
        "config.set_flag(1)\n"
        "config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, size=1)\n"
        "context = trt.Runtime(trt.Logger()).deserialize_cuda_engine(b'').create_execution_context()\n"
        "context.set_tensor_address('images', 'not an address')\n"
    )
    result = _mypy(mypy_config, wrong)
    assert result.returncode == 1, result.stdout + result.stderr
    assert '"set_flag" of "IBuilderConfig" has incompatible type "int"' in result.stdout
    assert 'Unexpected keyword argument "size"' in result.stdout
    assert '"set_tensor_address" of "IExecutionContext" has incompatible type "str"' in result.stdout
