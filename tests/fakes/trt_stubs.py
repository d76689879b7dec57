"""Repaired ``tensorrt-stubs`` files for the tests, through tools/trt_stubs.py (a script, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "trt_stubs.py"


def stubs_tool() -> ModuleType:
    """tools/trt_stubs.py as a module."""
    name = "_edge_agent_tools_trt_stubs"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOL)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {TOOL}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def repaired_stubs_or_skip(dest: Path) -> Path:
    """Write the repaired stubs to ``dest``; skip the calling test if tensorrt-stubs is absent."""
    tool = stubs_tool()
    try:
        tool.installed_stub_files()
    except tool.StubsError as exc:
        pytest.skip(f"tensorrt-stubs is not installed here ({exc})")
    result: Path = tool.repaired_stubs(dest)
    return result
