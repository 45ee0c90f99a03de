#!/usr/bin/env bash
# Host time per eager call (benchmarks/bench_host.py) on a GPU machine, in about 3 minutes:
#   1. where the host time goes: bench_host --profile at PROFILE_TOKENS [64] on GPU 0 (cProfile's
#      top functions, the torch ops per call, the profiler's host time by op) -> host_profile.txt;
#   2. EP=1 on GPU 0: ep_moe (no aux loss, the plain layer's work), ep_moe+aux and the plain
#      torch._grouped_mm layer at 1-256 tokens, rounds rotated -> host_ep1.json;
#   3. EP = every GPU (2 or more): the same at EP=P, ep_moe's auto dispatch and the all-to-all
#      -> host_ep<P>.json.
# BASELINE=<dir of another checkout>: step 2 runs there too, right after (-> host_ep1_baseline.json),
# for a before/after comparison on one machine. Each step has its own timeout; files land in $OUT
# (or /tmp/host_gpu).
#   bash benchmarks/run_host_gpu.sh      # SHAPE=qwen3-30b-a3b ROUNDS=15 CALLS=20 PROFILE_TOKENS=64
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPE=${SHAPE:-qwen3-30b-a3b}
ROUNDS=${ROUNDS:-15}
CALLS=${CALLS:-20}
OUTDIR=${OUT:-/tmp/host_gpu}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EP_MOE_DISABLE_AUTOTUNE=${EP_MOE_DISABLE_AUTOTUNE:-1}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L

timeout -k 5 120 python3 benchmarks/bench_host.py --shape "$SHAPE" --ep-size 1 --profile "${PROFILE_TOKENS:-64}" \
  --calls 100 > "$OUTDIR/host_profile.txt" 2>&1
echo "profile: rc=$?"
run_ep1() {  # $1: checkout, $2: results file
  (cd "$1" && PYTHONPATH=$1 timeout -k 5 150 python3 benchmarks/bench_host.py --shape "$SHAPE" --ep-size 1 \
    --calls "$CALLS" --rounds "$ROUNDS" --out "$2")
}
run_ep1 "$PWD" "$OUTDIR/host_ep1.json"
echo "EP=1: rc=$?"
if [ -n "${BASELINE:-}" ]; then
  run_ep1 "$BASELINE" "$OUTDIR/host_ep1_baseline.json"
  echo "EP=1 baseline: rc=$?"
fi
if [ "$NGPU" -ge 2 ]; then
  timeout -k 5 200 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" benchmarks/bench_host.py \
    --shape "$SHAPE" --calls "$CALLS" --rounds "$ROUNDS" --out "$OUTDIR/host_ep$NGPU.json"
  echo "EP=$NGPU: rc=$?"
fi
