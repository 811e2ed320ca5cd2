#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (device tool), in order of value:
#  1. the CuPy tests (tests/test_gpu.py: every operator case, training steps, planned and
#     split steps, all against NumPy in float64; tests/test_precision_gpu.py: f16;
#     tests/test_nccl.py: a single-rank NCCL communicator; tests/test_cudnn_frontend.py:
#     cuDNN's Python frontend and the ctypes path each loaded and checked),
#  2. issue 8's step table with --backend cupy against PyTorch on CUDA (bench_step.py),
#     with rows for cuDNN's Python frontend and the ctypes path (NETDSL_CUDNN),
#  3. `netdsl run --backend cupy`: ResNet-164 (in f32, f16 and bf16), resnet2504 unplanned
#     and planned into 12 GB (CuPy's pool limited to 12 GB), ResNet-20 split over two
#     logical devices; on a machine with two GPUs or more, ResNet-20 over two MPI ranks
#     with NCCL (`mpi`, not in the default CHECKS).
# Each check has its own time limit, so one that hangs costs only its share. Results go
# under $OUT (default ./gpu-results): gpu_check.log (everything printed), gpu-tests.log and
# .xml, bench-gpu.json, cli-runs.txt. Without a GPU it stops at once with exit status 2;
# DRY=1 lists the checks it would run instead (no GPU, no installs).
#
# Two ways to run it:
#  - on the lent machine (no package index; its python3 has CuPy, torch with CUDA, numba,
#    typer, rich, pytest): carry the wheels of what it lacks in .whl/ (lark, pydantic and
#    theirs; docs/benchmarks.md, "GPU", says how they were fetched); netdsl runs from this
#    checkout (PYTHONPATH) and PyTorch is that python3's own;
#  - elsewhere (no .whl/): a fresh .gpu-venv with netdsl[test] and CuPy from the index; the
#    PyTorch reference then comes from bench/.venvs/torch (CPU torch: the table compares
#    netdsl only with itself unless --torch-python names a CUDA torch).
# Usage: bash bench/gpu_check.sh, with these environment variables to narrow it:
#   CHECKS    the checks to run (default "tests table profile cli"; "mpi" needs 2 GPUs)
#   NETS      the table's networks (default: six of bench_step.py's)
#   BASELINE  an export of another revision (bench_step.py --baseline: a directory with its
#             netdsl/, stdlib/ and grammar/, e.g. bench/.baseline/SHA carried along): netdsl
#             as of then joins the table, so a change is measured against its base
#   VARIANTS  bench_step.py --variant entries, space-separated (graphs:NETDSL_CUDA_GRAPH=1;
#             default: cuDNN's two paths, frontend:NETDSL_CUDNN=frontend and
#             ctypes:NETDSL_CUDNN=ctypes)
#   ROUNDS    the table's rounds (default 2)
#   TORCH_TF32  1: PyTorch's convolutions on TF32 tensor cores, its default (otherwise
#             float32 arithmetic, as netdsl's: bench_step.py --torch-tf32)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
CHECKS=${CHECKS:-tests table profile cli}
NETS=${NETS:-resnet164,resnet50,vgg16,mobilenet_v2,transformer-tiny,digits-cnn}
BASE=()
[ -n "${BASELINE:-}" ] && BASE=(--baseline "$BASELINE")
for v in ${VARIANTS-frontend:NETDSL_CUDNN=frontend ctypes:NETDSL_CUDNN=ctypes}; do
  BASE+=(--variant "$v")
done
[ "${TORCH_TF32:-0}" = 1 ] && BASE+=(--torch-tf32)
has() { [[ " $CHECKS " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
# the NumPy reference kernels, not the Numba ones: a cold Numba compile takes minutes, and
# the tests compare CuPy with NumPy's reference code anyway
export NETDSL_FUSED_KERNELS=0
T0=$(date +%s)
DRY=${DRY:-0}
if [ "$DRY" != 1 ] && ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu_check.sh: no NVIDIA GPU answers here (nvidia-smi -L failed); run it on a GPU" \
       "machine, or with DRY=1 to list the checks it would run" >&2
  exit 2
fi

step() {  # step SECONDS COMMAND...: one check under its own limit; its status and time logged
  local limit=$1 t rc
  shift
  # (on fd 3, gpu_check.log's stream: a check's own output may go to a file of its own)
  echo "== $* (limit ${limit} s, at $(($(date +%s) - T0)) s)" >&3
  [ "$DRY" = 1 ] && return 0
  t=$(date +%s)
  timeout "$limit" "$@"
  rc=$?
  echo "== rc=$rc after $(($(date +%s) - t)) s" >&3
  return 0
}

{
  exec 3>&1
  [ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
      --format=csv || true
  if [ "$DRY" = 1 ]; then
    PY=python3
    TORCH=()
  elif [ -d .whl ]; then
    PY=python3
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD:$PWD/cli:/tmp/site"
    TORCH=(--torch-python "$(command -v python3)")
  else
    python3 -m venv .gpu-venv && . .gpu-venv/bin/activate
    pip install -q -e '.[test,gpu]' || exit 1
    PY=python
    TORCH=()
  fi
  [ "$DRY" = 1 ] || $PY - <<'EOF'
import cupy, numpy, netdsl
print("cupy", cupy.__version__, "numpy", numpy.__version__, "CUDA runtime",
      cupy.cuda.runtime.runtimeGetVersion(), "devices", cupy.cuda.runtime.getDeviceCount())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
          "cudnn", torch.backends.cudnn.version())
except ImportError as e:
    print("no torch:", e)
from netdsl.backends import cudnn, get_backend
print("cuDNN candidates:", cudnn.candidates()[:4])
be = get_backend("cupy", 0)
be.cudnn  # loaded and checked against the definitions (netdsl.backends.cudnn)
print("netdsl's convolutions:", be.cudnn_status)
try:
    be.nccl()
    from cupy.cuda import nccl
    print("NCCL", nccl.get_version())
except Exception as e:  # DeviceError: collectives over MPI would go through the host
    print("no NCCL:", e)
EOF
  XDIST=()
  $PY -c "import xdist, pytest_timeout" 2>/dev/null && XDIST=(-n 8 --timeout 150)
  if has tests; then
    step 200 $PY -m pytest -q -m gpu tests/test_gpu.py tests/test_precision_gpu.py \
        tests/test_nccl.py tests/test_cudnn_frontend.py \
        -p no:cacheprovider "${XDIST[@]}" \
        --tb=short -rfE --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" 2> /dev/null | tail -n 60
  fi
  if has table; then
    step 300 $PY bench/bench_step.py --backend cupy "${TORCH[@]}" "${BASE[@]}" --nets "$NETS" \
        --steps 5 --warmup 2 --rounds "${ROUNDS:-2}" --json-out "$OUT/bench-gpu.json"
  fi
  # where a GPU step's time goes: each op timed with the device synchronised around it,
  # and the host's own time (cProfile), for a deep narrow net and a wide one
  for f in resnet164-cifar resnet50; do
    has profile || break
    step 60 $PY bench/refs/netdsl_step.py --backend cupy --file "examples/$f.net" --batch 16 \
        --steps 3 --warmup 2 --profile --top 15 > "$OUT/profile-$f.json"
    [ "$DRY" = 1 ] || $PY - "$OUT/profile-$f.json" <<'EOF'
import json, sys
r = json.loads(next(line for line in open(sys.argv[1]) if line.startswith("{")))
print(sys.argv[1], "median", r["median_s"], "cpu", r["cpu_times"])
for op, calls, sec in r["op_times"][:15]:
    print(f"  {op:28s} {calls:5d} {1000 * sec:8.2f} ms {1e6 * sec / calls:8.1f} us/call")
EOF
  done
  # two ranks on two GPUs, collectives on NCCL (the run's warnings say if it fell back to
  # host MPI); its comm_bytes are the ring's
  if has mpi; then
    step 120 mpiexec -n 2 $PY -m netdsl_cli run examples/resnet20-cifar.net --steps 3 \
        --batch 16 --distributed --backend cupy --eval-samples 0 --json \
        > "$OUT/mpi-nccl.json"
    [ "$DRY" = 1 ] || { tail -c 800 "$OUT/mpi-nccl.json"; echo; }
  fi
  if ! has cli; then echo "== done at $(($(date +%s) - T0)) s"; exit 0; fi

  cli() {  # cli NAME LIMIT ARGS...: one `netdsl run` whose --json report goes to cli-runs.txt
    local name=$1 limit=$2
    shift 2
    echo "## $name" >> "$OUT/cli-runs.txt"
    step "$limit" $PY -m netdsl_cli run "$@" --backend cupy --eval-samples 0 --json \
        >> "$OUT/cli-runs.txt"
    [ "$DRY" = 1 ] || { tail -c 600 "$OUT/cli-runs.txt"; echo; }
  }
  cli resnet164 60 examples/resnet164-cifar.net --steps 5 --batch 16
  # mixed precision (never run on a GPU before: f16 on cuBLAS and cuDNN; bf16 where this
  # CuPy has bfloat16 arrays, else refused by name)
  for p in f16 bf16; do
    cli "resnet164 --precision $p" 60 examples/resnet164-cifar.net --steps 5 --batch 16 \
        --precision "$p"
  done
  NETDSL_CUDA_GRAPH=1 cli "resnet164, CUDA graphs" 60 examples/resnet164-cifar.net --steps 5 \
      --batch 16
  # gradient accumulation and clipping on the device (untested there so far), and a
  # checkpoint evaluated with `netdsl eval --backend cupy` against the run's own figures
  cli "resnet20 --microbatches 4 --clip-grad-norm 1" 45 examples/resnet20-cifar.net \
      --steps 3 --batch 32 --microbatches 4 --clip-grad-norm 1
  echo "## digits-cnn run then eval" >> "$OUT/cli-runs.txt"
  step 60 $PY -m netdsl_cli run examples/digits-cnn.net --steps 20 --backend cupy \
      --checkpoint "$OUT/ck" --overwrite --json >> "$OUT/cli-runs.txt"
  step 30 $PY -m netdsl_cli eval examples/digits-cnn.net --checkpoint "$OUT/ck" \
      --backend cupy --json >> "$OUT/cli-runs.txt"
  rm -rf "$OUT/ck"
  for split in data pipeline tensor; do
    cli "resnet20 --devices 2 --split $split" 45 examples/resnet20-cifar.net --steps 3 \
        --batch 16 --devices 2 --split "$split"
  done
  # memory planning on the device (issue 6): resnet2504 at batch 16 planned into 12 GB with
  # CuPy's pool limited to 12 GB, then unplanned (about 42 GB: fits the H200); compare the
  # measured peaks (pool high-water mark), the losses and the step times (the plan's cost)
  CUPY_GPU_MEMORY_LIMIT=12000000000 cli "resnet2504 --mem 12GB" 90 examples/resnet2504.net \
      --steps 2 --batch 16 --mem 12GB --profile h200
  cli "resnet2504 unplanned" 90 examples/resnet2504.net --steps 2 --batch 16
  echo "== all done at $(($(date +%s) - T0)) s"
} 2>&1 | tee "$OUT/gpu_check.log"
