#!/usr/bin/env bash
# Set up and run the main job on the embedded defaults: `edge-agent demo`.
#
# The first run builds the example bundle (train ResNet-18 on the digits set, cached; prune; INT8
# with mixed precision; sign) into OUT_DIR; every run installs it into a fresh model store, starts
# the daemon on a free loopback port, sends it the held-out digit images (HTTP and shared memory),
# prints predictions, latency and metrics, and shuts it down by draining.
#
#   tools/demo.sh [OUT_DIR]      (default: out/demo)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/demo}

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[host,device,dev]"

.venv/bin/edge-agent demo --out "$out"
