#!/usr/bin/env bash
# The one prepared script for a GPU session (issue 13): build the CUDA extension, run every
# `cuda`-marked test, then the device benchmarks; everything lands in one results folder.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]      (default: $OUT, else ./gpu-results)
#
# Meant for the lent H200 (torch 2.11+cu130, Python 3.12, nvcc, no network): it installs
# nothing from the network (--no-build-isolation --no-deps against the preinstalled torch) and
# keeps going after a failing step, so one run yields every figure it can. Exit status: the
# number of failed steps (0 = all passed).
set -u
RESULTS="${1:-${OUT:-$PWD/gpu-results}}"
mkdir -p "$RESULTS"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=lo
PY="${PYTHON:-python3}"
failed=0
step() {  # step NAME TIMEOUT_S CMD...: run, log to RESULTS/NAME.log, record the status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$RESULTS/summary.txt"
  [ $rc -eq 0 ] || failed=$((failed + 1))
  return $rc
}
{
  echo "# gpu_check $(date -Is)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  nvcc --version 2>&1 | tail -1
} >"$RESULTS/summary.txt"
step build 420 env DISTRIBUTED_EXT_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . \
  || { echo "build failed: see $RESULTS/build.log"; exit 1; }
"$PY" -c "import distributed_ext as dx; print(dx.build_info())" >>"$RESULTS/summary.txt" 2>&1
step cuda_tests 420 "$PY" -m pytest -q -m cuda -p no:cacheprovider -rA \
  --junitxml="$RESULTS/cuda_tests.xml"
step bench_device 300 "$PY" benchmarks/bench_device.py --size 4GiB
# The main job at NCCL world 1 under torchrun (distributed_run binds cuda:0).
step bench_main_nccl1 300 "$PY" -m torch.distributed.run --nproc-per-node 1 \
  -m distributed_ext.bench --size 1GiB --repeat 3 --quiet --json "$RESULTS/bench_nccl1.json"
echo "failed steps: $failed" | tee -a "$RESULTS/summary.txt"
exit $failed
