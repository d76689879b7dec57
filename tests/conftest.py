"""Shared fixtures.

Tests that need the host extra (torch, ONNX tooling) call ``pytest.importorskip`` so that the device
pass on Python 3.10 (installed without torch) skips them. ``EDGE_AGENT_REQUIRE_HOST=1`` (set by the
main CI pass) stops the run before it starts when a host module is missing, so a broken host install
cannot pass as a run of skips.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HOST_MODULES = ("torch", "torch_pruning", "onnx", "onnxruntime", "onnxslim", "sklearn", "tqdm")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("EDGE_AGENT_REQUIRE_HOST") != "1":
        return
    missing = [name for name in HOST_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(
            "EDGE_AGENT_REQUIRE_HOST=1 but the host extra is incomplete: missing " + ", ".join(missing)
        )


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep tests away from the user's checkpoint cache unless they opt in."""
    if "EDGE_AGENT_TEST_CACHE" in os.environ:
        monkeypatch.setenv("EDGE_AGENT_CACHE", os.environ["EDGE_AGENT_TEST_CACHE"])
    else:
        monkeypatch.setenv("EDGE_AGENT_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
