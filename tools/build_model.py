#!/usr/bin/env python3
"""Host-side build script: the same as ``edge-agent build`` (see ``--help``).

    python tools/build_model.py --model resnet18-digits --prune 0.5 --out out/
    python tools/build_model.py --onnx model.onnx --calib-dir calib/ --key signing.key --out out/
"""

import sys

from agent.cli import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
