#!/usr/bin/env bash
# Autotune and training checks in one go, for a machine of 2 or more GPUs (within $BUDGET_S):
#   1. benchmarks/bench_autotune.py under torchrun over every GPU (split tuning) for the four
#      ANCHORS.md shapes at E, E/2 and E/4 local experts, --ship: the tuned files land in
#      ep_moe/autotune/shipped/<device>/ (and in $CACHE, which later runs on this machine read);
#   2. launch/warmup_node.sh on 2 GPUs, twice, into a fresh cache: the first run tunes once
#      (rank 0's node splits the problems), the second must be a cache hit in seconds;
#   3. the trainer on 2 GPUs, EP=2, Triton kernels, bf16 (the gpu preset).
# Steps 2 and 3 run first; step 1 gets what is left of the budget (a cut run keeps every
# problem it finished: split tuning writes each one to the cache as it ends).
# Logs, the tuned files (a tarball of $CACHE) and the results JSON go to $OUT (if set).
#   bash benchmarks/run_autotune_gpu.sh          # SHAPES=... STEPS=80 CACHE=/tmp/ep_moe_cache
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPES=${SHAPES:-mixtral-8x7b:1,mixtral-8x7b:2,mixtral-8x7b:4,qwen3-30b-a3b:1,qwen3-30b-a3b:2,qwen3-30b-a3b:4,gpt-oss-20b:1,gpt-oss-20b:2,gpt-oss-20b:4,deepseek-v3:8,deepseek-v3:16,deepseek-v3:32}
STEPS=${STEPS:-80}
CACHE=${CACHE:-/tmp/ep_moe_cache}
BUDGET_S=${BUDGET_S:-560}
LOGS=${OUT:-/tmp/ep_tune}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L

WARM_CACHE=$(mktemp -d)
for run in first second; do
  start=$SECONDS
  EP_MOE_CACHE_DIR=$WARM_CACHE EP_MOE_SHIPPED_DIR=/nonexistent NPROC=2 EP_MOE="python3 -m ep_moe.cli" \
    timeout 120 bash launch/warmup_node.sh --model qwen3-30b-a3b --ep-size 2 --tokens 8192 2>&1 \
    | grep -v '^autotune ' | tail -8 | tee "$LOGS/warmup_$run.log"
  echo "warmup_node $run run: $((SECONDS - start)) s, $(ls "$WARM_CACHE" | wc -l) cache files"
done

EP_MOE_CACHE_DIR=$(mktemp -d) timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  launch/train.py --config gpu --ep-size 2 --steps "$STEPS" \
  --metrics-file "$LOGS/train_ep2.jsonl" 2>&1 | grep -v Warning | tail -14 | tee "$LOGS/train_ep2.log"
timeout "$((BUDGET_S - SECONDS > 60 ? BUDGET_S - SECONDS : 60))" python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
  benchmarks/bench_autotune.py --shapes "$SHAPES" --ship --cache-dir "$CACHE" 2>&1 \
  | grep -v '^autotune ' | tee "$LOGS/autotune.log"
echo "autotune rc=${PIPESTATUS[0]}"
# The cache files are the shipped files (also when a timeout stopped the run before --ship).
tar czf "$LOGS/tuned_cache.tgz" -C "$CACHE" . && echo "$(ls "$CACHE" | grep -c json) tuned files"
cp benchmarks/results/autotune_*.json "$LOGS/" 2>/dev/null

echo "done in ${SECONDS}s"
