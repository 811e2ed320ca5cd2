#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (device tool): installs CuPy, runs
# the CuPy tests, ResNet-164/50 training steps with --backend cupy and resnet2504 planned
# into a 12 GB pool against its unplanned run, ResNet-20 split over two logical devices on
# the GPU (data, pipeline, tensor, spatial), and writes the results under $OUT (default ./gpu-results). Usage: bash bench/gpu_check.sh
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
  # memory planning on the device (issue 6): resnet2504 at batch 16 unplanned (about 70 GB:
  # fits the H200), then planned into 12 GB with CuPy's pool limited to 12 GB; compare the
  # measured peaks (pool high-water mark) and the step times (overhead of the plan)
  netdsl run examples/resnet2504.net --steps 2 --batch 16 --backend cupy --eval-samples 0 \
      --json > "$OUT/resnet2504-unplanned.json"
  echo "run rc=$?"
  CUPY_GPU_MEMORY_LIMIT=12000000000 netdsl run examples/resnet2504.net --steps 2 --batch 16 \
      --backend cupy --mem 12GB --profile h200 --eval-samples 0 --json \
      > "$OUT/resnet2504-12GB.json"
  echo "run rc=$?"
  # splitting (issue 7): data-parallel and pipeline steps over logical devices on the one
  # GPU (one CuPy backend, byte accounting per device), against the same run on one device
  for split in data pipeline tensor spatial; do
    netdsl run examples/resnet20-cifar.net --steps 3 --batch 16 --backend cupy --devices 2 \
        --split "$split" --eval-samples 0 --json > "$OUT/split-$split-cupy.json"
    echo "run --devices 2 --split $split rc=$?"
  done
  netdsl run examples/resnet20-cifar.net --steps 3 --batch 16 --backend cupy \
      --eval-samples 0 --json > "$OUT/split-none-cupy.json"
  echo "run rc=$?"
} 2>&1 | tee "$OUT/gpu_check.log"
