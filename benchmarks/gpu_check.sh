#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (issue 13): build the CUDA extension, run every
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
# Wheels carried in `.whl` (benchmarks/gpu_wheels.sh: ModelOpt and its needs, which the
# image lacks): without them the quantized tests skip.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$RESULTS/wheels.log" 2>&1 \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  echo "wheels: $(ls .whl | wc -l) carried, PYTHONPATH=${PYTHONPATH:-}" >>"$RESULTS/summary.txt"
fi
# GPU_CHECK_SKIP_BUILD=1: use the installed build (a dry run of the other steps on a CPU).
if [ "${GPU_CHECK_SKIP_BUILD:-0}" != 1 ]; then
  step build 420 env DISTRIBUTED_EXT_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . \
    || { echo "build failed: see $RESULTS/build.log"; exit 1; }
fi
"$PY" -c "import distributed_ext as dx; print(dx.build_info())" >>"$RESULTS/summary.txt" 2>&1
step cuda_tests 420 "$PY" -m pytest -q -m cuda -p no:cacheprovider -rA \
  --junitxml="$RESULTS/cuda_tests.xml"
step bench_device 300 "$PY" benchmarks/bench_device.py --size 4GiB
# Ours against gather_object at NCCL world 1 (one process: NCCL refuses two ranks on a GPU),
# with the main job's measurement (first call, warm median and spread).
NCCL1='
import tempfile, torch, torch.distributed as dist
from distributed_ext import bench
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl", init_method="file://" + tempfile.mktemp(),
                        rank=0, world_size=1)
rows = [bench.Result(**bench.measure("bytes", m, 2**30, 3, False, fresh_ranks=False))
        for m in ("distributed_ext", "torch gather_object")]
print(bench.format_table(rows))
dist.destroy_process_group()
'
step bench_nccl_world1 300 "$PY" -c "$NCCL1"
# Export of GPU-resident FSDP2 shards at NCCL world 1 (issue 12): ours against torch's two
# routes, a 1 GiB model, first call beside the warm median.
EXPORT1='
import tempfile, torch, torch.distributed as dist
from distributed_ext import bench
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(), rank=0,
                        world_size=1)
rows = [bench.Result(**bench.measure("export", m, 2**30, 2, False, fresh_ranks=False,
                                     device="cuda"))
        for m in bench.resolve_methods("export", True, "nccl")]
print(bench.format_table(rows))
for line in bench.check_targets(rows):
    print("  " + line)
dist.destroy_process_group()
'
step bench_export_nccl_world1 300 "$PY" -c "$EXPORT1"
echo "failed steps: $failed" | tee -a "$RESULTS/summary.txt"
exit $failed
