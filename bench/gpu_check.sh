#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (device tool): installs CuPy, runs
# the CuPy tests and a ResNet-164 training step with --backend cupy, and writes the
# results under $OUT (default ./gpu-results). Usage: bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
{
  nvidia-smi || true
  python3 -m venv .gpu-venv && . .gpu-venv/bin/activate
  pip install -q -e '.[test,gpu]'
  python -c "import cupy; print('cupy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), 'device(s)')"
  pytest -q -m gpu tests/test_gpu.py
  echo "pytest rc=$?"
  netdsl run examples/resnet164-cifar.net --steps 5 --batch 16 --backend cupy --json \
      > "$OUT/resnet164-cupy.json"
  echo "run rc=$?"
  netdsl run examples/resnet50.net --steps 3 --batch 16 --backend cupy --json \
      > "$OUT/resnet50-cupy.json"
  echo "run rc=$?"
} 2>&1 | tee "$OUT/gpu_check.log"
