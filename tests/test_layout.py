"""The layering that agent/__init__.py describes, and the device side's weight, checked on the
code itself: a stray import that would tie the host pipeline to the daemon, or load torch on a
board, fails here."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE_LAYER = {"agent", "agent.errors", "agent.deps", "agent.fsutil", "agent.log"}
HEAVY_HOST_MODULES = ("torch", "torch_pruning", "sklearn", "PIL", "tqdm")


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """Every module ``path`` imports (at any depth, lazily or not), with its line."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "agent":  # from agent import deps, __version__
                for alias in node.names:
                    yield node.lineno, "agent" if alias.name == "__version__" \
                        else f"agent.{alias.name}"
            else:
                yield node.lineno, node.module


def sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (REPO / folder).rglob("*.py"))


def test_models_pruning_and_power_import_only_the_base_layer_of_agent() -> None:
    offending = [f"{path.relative_to(REPO)}:{line}: {module}"
                 for path in sources("models", "pruning", "power")
                 for line, module in imported_modules(path)
                 if (module == "agent" or module.startswith("agent.")) and module not in BASE_LAYER]
    assert offending == []


def test_the_base_layer_imports_nothing_else_of_the_project() -> None:
    base = [REPO / "agent" / f"{name}.py" for name in ("errors", "deps", "fsutil", "log")]
    offending = [f"{path.relative_to(REPO)}:{line}: {module}" for path in base
                 for line, module in imported_modules(path)
                 if module.split(".")[0] in {"agent", "models", "pruning", "power"}
                 and module not in BASE_LAYER]
    assert offending == []


def test_the_daemon_never_imports_the_tooling_or_the_cli() -> None:
    daemon = [path for path in sources("agent")
              if path.relative_to(REPO).parts[1] not in ("tooling", "cli", "__main__.py")]
    offending = [f"{path.relative_to(REPO)}:{line}: {module}" for path in daemon
                 for line, module in imported_modules(path)
                 if module.startswith(("agent.tooling", "agent.cli"))]
    assert offending == []


def test_the_daemon_and_every_backend_load_none_of_the_host_libraries() -> None:
    pytest.importorskip("onnxruntime")
    backends = [f"agent.backends.{path.stem}" for path in (REPO / "agent" / "backends").glob("*.py")
                if path.stem != "__init__"]
    modules = ["agent.daemon", "agent.run", "agent.cli.serve", *backends]
    probe = ("import importlib, json, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             f"print(json.dumps(sorted(m for m in {HEAVY_HOST_MODULES!r} if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=REPO, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert len(backends) >= 3  # onnxruntime, tensorrt, cuda_buffers, base: a rename would hide one
