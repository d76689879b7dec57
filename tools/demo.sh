#!/usr/bin/env bash
# Set up and run the main job on the embedded defaults: train the example ResNet-18 on the digits
# set (cached after the first run), prune it, quantize it to INT8 with mixed precision, and pack a
# signed bundle; then verify and inspect the bundle.
#
#   tools/demo.sh [OUT_DIR]      (default: out/demo)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/demo}

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[host,device,dev]"

.venv/bin/edge-agent build --model resnet18-digits --prune 0.5 --out "$out"
bundle=$(ls -t "$out"/resnet18-digits-*.bundle | head -n 1)
.venv/bin/edge-agent bundle verify "$bundle" --pubkey "$out/signing.key.pub"
.venv/bin/edge-agent bundle inspect "$bundle" --pubkey "$out/signing.key.pub"
