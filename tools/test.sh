#!/usr/bin/env bash
# Set up and run the whole test suite: the README's test command, and what CI runs.
#
#   tools/test.sh [extra pytest arguments]
#
# 1. Python 3.11 (host + device + dev extras, torch 2.13 CPU): the full default suite.
# 2. Python 3.10 (JetPack 6's Python), when one is found: device + dev extras only (no torch), so
#    the device-side code (agent/, power/, bundle verification, engine builder) is tested there;
#    host-only tests skip themselves for lack of torch.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stubs="tensorrt-stubs==10.13.0.35.1"  # type stubs only; --no-deps, it would pull TensorRT itself

setup_venv() {  # setup_venv DIR PYTHON EXTRAS
  local dir=$1 py=$2 extras=$3
  [ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$dir/bin/python" -m pip install -q -e ".[$extras]"
  "$dir/bin/python" -m pip install -q --no-deps "$stubs"
}

find_python310() {
  local candidate
  for candidate in python3.10 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.10*/bin/python3.10; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

echo "== Python 3.11: full suite (host, device, dev)"
setup_venv .venv "$python" host,device,dev
EDGE_AGENT_REQUIRE_HOST=1 .venv/bin/python -m pytest "$@"

if py310=$(find_python310); then
  echo "== Python 3.10 ($py310): device-side suite (no torch)"
  setup_venv .venv310 "$py310" device,dev
  .venv310/bin/python -m pytest "$@"
else
  echo "== Python 3.10 not found: skipping the device-side pass"
fi
