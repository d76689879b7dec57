"""Shared fixtures.

Tests that need the host extra (torch, ONNX tooling) call ``pytest.importorskip`` so that the device
pass on Python 3.10 (installed without torch) skips them. ``EDGE_AGENT_REQUIRE_HOST=1`` (set by the
main CI pass) turns such a skip into a failure, so a broken host install cannot pass silently.
"""

from __future__ import annotations

import os

import pytest


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if os.environ.get("EDGE_AGENT_REQUIRE_HOST") != "1" or not report.skipped:
        return
    reason = str(report.longrepr)
    if "could not import" in reason:
        report.outcome = "failed"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep tests away from the user's checkpoint cache unless they opt in."""
    if "EDGE_AGENT_TEST_CACHE" in os.environ:
        monkeypatch.setenv("EDGE_AGENT_CACHE", os.environ["EDGE_AGENT_TEST_CACHE"])
    else:
        monkeypatch.setenv("EDGE_AGENT_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
