#!/usr/bin/env bash
# Create the PyTriton environment that tools/pytriton_bench.py runs in, and write its loader path.
#
#   tools/pytriton_setup.sh            # once; then:
#   source .venv-pytriton/env.sh       # sets LD_LIBRARY_PATH for the venv's Python
#   .venv-pytriton/bin/python tools/pytriton_bench.py MODEL.onnx ...
#
# PyTriton (nvidia-pytriton on PyPI) bundles a tritonserver binary and runs the Python model through
# Triton's Python backend stub (pytriton/tritonserver/python_backend_stubs/3.12/). That stub links
# libpython3.12.so.1.0 dynamically, and a pyenv-built Python keeps that library in its own lib folder,
# which is not on the loader's path: without LD_LIBRARY_PATH the stub fails with
# "error while loading shared libraries: libpython3.12.so.1.0". The venv is ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
venv=${PYTRITON_VENV:-.venv-pytriton}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
# numpy and httptools are all agent/tooling/loadgen/ needs, so the load generator runs in this venv too.
"$venv/bin/python" -m pip install -q nvidia-pytriton onnxruntime numpy httptools

libdir=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
cat >"$venv/env.sh" <<EOF
# Source this before running PyTriton from $venv (written by tools/pytriton_setup.sh).
export LD_LIBRARY_PATH="$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF

stub=$("$venv/bin/python" -c 'import pathlib, pytriton; print(pathlib.Path(pytriton.__file__).parent)')/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub
if LD_LIBRARY_PATH="$libdir" ldd "$stub" | grep -q "not found"; then
  echo "the Python backend stub still misses libraries:" >&2
  LD_LIBRARY_PATH="$libdir" ldd "$stub" | grep "not found" >&2
  exit 1
fi
echo "PyTriton ready in $venv; before running it: source $venv/env.sh (LD_LIBRARY_PATH=$libdir)"
