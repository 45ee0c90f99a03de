#!/usr/bin/env bash
# The DeepSpeed engine (ZeRO 2, bf16) training one GPT-style MoE model with DeepSpeed's MoE layer and with
# ep_moe's drop-in (benchmarks/bench_deepspeed_train.py, gpu preset) on every GPU of the machine:
#   1. both layers, dropless and with drop_tokens, the drop-in on its default dispatch
#      -> deepspeed_train.json (loss curves compared, step times side by side);
#   2. the drop-in alone with drop_tokens on each dispatch of DISPATCHES [all_gather]
#      -> deepspeed_train_drop_<dispatch>.json, for an A/B against step 1's drop run.
# Every run profiles PROFILE_STEPS [1] more steps (rank 0's top ops and host syncs per step, printed and in the
# JSON). Each step has its own timeout (STEP_S [240]): the results are written before the processes tear down.
# DeepSpeed is not in every GPU image: when `import deepspeed` fails, the wheels in WHEELS [.whl] (deepspeed,
# hjson, pydantic, pydantic-core, annotated-types, typing-inspection) are installed into a private directory.
# Files land in $OUT (or /tmp/deepspeed_gpu).
#   bash benchmarks/run_deepspeed_gpu.sh      # DISPATCHES="all_gather all_to_all" PROFILE_STEPS=1 STEP_S=240
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/deepspeed_gpu}
DISPATCHES=${DISPATCHES:-all_gather}
STEP_S=${STEP_S:-240}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EP_MOE_DISABLE_AUTOTUNE=${EP_MOE_DISABLE_AUTOTUNE:-1}
if ! python3 -c 'import deepspeed' 2>/dev/null; then
  site=/tmp/deepspeed_site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "${WHEELS:-.whl}"/*.whl || { echo "no DeepSpeed and no wheels to install it from"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:$site
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L
bench() {  # $1: results file, then bench_deepspeed_train's arguments
  local out=$1
  shift
  timeout -k 10 "$STEP_S" python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    benchmarks/bench_deepspeed_train.py --profile-steps "${PROFILE_STEPS:-1}" --out "$OUTDIR/$out" "$@" \
    2>&1 | grep -v "Warning\|warn(\|profiler_st"
  echo "$out: rc=${PIPESTATUS[0]}"
}
bench deepspeed_train.json
for dispatch in $DISPATCHES; do
  bench "deepspeed_train_drop_$dispatch.json" --impls ep_moe --modes drop --dispatch "$dispatch" --no-check
done
