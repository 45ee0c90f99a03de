#!/usr/bin/env bash
# Trainer throughput matrix (benchmarks/bench_train.py) on a 4-GPU machine, in about 8 minutes:
#   models          the trainer's presets qwen3_ep (2.63B params, 0.29B active) and gpu (0.83B, 0.12B)
#   configurations  1 GPU; EP=4; EP=2 x DP=2; DP=4 (--ep-size 1), as world:ep in CONFIGS
# one torchrun per (configuration, model), in that order (both models' one-GPU ceiling first), each
# WARMUP [5] untimed + STEPS [10] timed + PROFILE_STEPS [3] profiled (+2 delimiting) steps; then the plot
# benchmarks/results/train_scaling_<device>.png and all runs in one JSON, benchmarks/results/train_<device>_x<N>.json.
#
# Time: a run costs its start (imports, NCCL, ~10 s), the model built on the host (qwen3_ep at EP=1 draws
# 2.4B expert weights on the CPU, ~15 s; a quarter at EP=4), the Triton JIT of the grouped kernels on the
# first runs (~20-40 s; later runs read ~/.triton/cache), 20 steps (0.1-0.5 s each) and the trace export and
# analysis (~5 s): 30-60 s, so 8 runs take 5-7 minutes. Runs stop when BUDGET_S [480] is spent (each is
# capped at RUN_CAP_S [150], and one is not started with less than MIN_RUN_S [45] left); skipped runs are
# named. These are estimates made without a GPU: the first real run's "setup" lines say what it took.
#
# Kernel configs: EP_MOE_DISABLE_AUTOTUNE=1 (the default here) uses the shipped configs
# (ep_moe/autotune/shipped/<device>/: qwen3_ep's shapes at EP 1, 2, 4 on H200) and the shape heuristic
# for the rest (gpu.toml's shapes); tuning those takes about a minute per problem, too long for this
# budget. AUTOTUNE=1 tunes them (cached in $EP_MOE_CACHE_DIR, so a second run is a cache hit).
#
# MFU is against each GPU's measured bf16 matmul rate unless PEAK_TFLOPS is set (e.g. 989 for the H100 SXM
# datasheet figure); every result records both. EXTRA is passed to every run (e.g. EXTRA="--set training.cuda_graphs='off'").
# DISPATCHES [auto]: at EP>1, one run per moe.dispatch named (e.g. "auto all_gather_copy_engine all_to_all"); a run
# with another dispatch than auto is labelled <model>[<dispatch>] in the results and the plot.
# With $OUT set (the device tool), copies the PNG, the combined JSON and one log file there (3 files).
#   bash benchmarks/run_train_gpu.sh     # MODELS="..." CONFIGS="1:1 4:4 4:2 4:1" WARMUP=5 STEPS=10 PROFILE_STEPS=3
set -uo pipefail
cd "$(dirname "$0")/.."
MODELS=${MODELS:-qwen3_ep gpu}
CONFIGS=${CONFIGS:-1:1 4:4 4:2 4:1}
DISPATCHES=${DISPATCHES:-auto}
WARMUP=${WARMUP:-5}
STEPS=${STEPS:-10}
PROFILE_STEPS=${PROFILE_STEPS:-3}
BUDGET_END=$((SECONDS + ${BUDGET_S:-480}))
WORK=${WORK:-/tmp/train_bench}
RESULTS=$WORK/results
LOG=$WORK/run_train_gpu.log
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
: > "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off on these machines (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ "${AUTOTUNE:-0}" = 1 ] || export EP_MOE_DISABLE_AUTOTUNE=1
export EP_MOE_CACHE_DIR=${EP_MOE_CACHE_DIR:-/tmp/ep_moe_cache}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
NCPU=$(nproc)
DEVICE=$(python3 -c 'import re, torch; print(re.sub(r"[^A-Za-z0-9.]+", "_", torch.cuda.get_device_name(0)).strip("_"))')
{ nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 | tee -a "$LOG"

RCS=()
for CONF in $CONFIGS; do
  W=${CONF%%:*}; P=${CONF##*:}
  if [ "$W" -gt "$NGPU" ]; then echo "world $W, EP $P: only $NGPU GPUs; skipped" | tee -a "$LOG"; continue; fi
  for MODEL in $MODELS; do
    for DISPATCH in $([ "$P" -gt 1 ] && echo "$DISPATCHES" || echo auto); do
    NAME=$(basename "$MODEL" .toml)
    LABEL=$NAME; SETD=()
    if [ "$DISPATCH" != auto ]; then LABEL="$NAME[$DISPATCH]"; SETD=(--set "moe.dispatch='$DISPATCH'"); fi
    REST=$((BUDGET_END - SECONDS))
    if [ "$REST" -lt "${MIN_RUN_S:-45}" ]; then
      echo "$LABEL world $W EP $P: skipped, ${REST}s of the budget left" | tee -a "$LOG"; RCS+=("$LABEL:w$W:ep$P:skipped"); continue
    fi
    CAP=${RUN_CAP_S:-150}; [ "$REST" -lt "$CAP" ] && CAP=$REST
    THREADS=$((NCPU / W)); [ "$THREADS" -gt 16 ] && THREADS=16; [ "$THREADS" -lt 1 ] && THREADS=1
    echo "=== $LABEL world $W EP $P (cap ${CAP}s, ${SECONDS}s elapsed)" | tee -a "$LOG"
    START=$SECONDS
    OMP_NUM_THREADS=$THREADS timeout -k 10 "$CAP" python3 -m torch.distributed.run --standalone --nproc-per-node "$W" \
      benchmarks/bench_train.py --config "$MODEL" --ep-size "$P" --warmup "$WARMUP" --steps "$STEPS" \
      --profile-steps "$PROFILE_STEPS" ${PEAK_TFLOPS:+--peak-tflops "$PEAK_TFLOPS"} ${EXTRA:-} "${SETD[@]}" \
      --label "$LABEL" --out "$RESULTS/train_${NAME}_${DISPATCH}_w${W}_ep${P}.json" 2>&1 \
      | grep -v -e '^USDT' -e ' INFO config: ' | tee -a "$LOG"
    RC=${PIPESTATUS[0]}
    echo "--- $LABEL world $W EP $P: rc=$RC in $((SECONDS - START))s" | tee -a "$LOG"
    RCS+=("$LABEL:w$W:ep$P:$RC")
    done
  done
done

PNG=benchmarks/results/train_scaling_${DEVICE}.png
COMBINED=benchmarks/results/train_${DEVICE}_x${NGPU}.json
if compgen -G "$RESULTS/*.json" >/dev/null; then
  python3 benchmarks/bench_train.py --plot "$RESULTS"/*.json --plot-out "$PNG" --combined-out "$COMBINED" 2>&1 | tee -a "$LOG"
else
  echo "no results to plot" | tee -a "$LOG"
fi
echo "summary:" | tee -a "$LOG"
grep '^train ' "$LOG" | sed 's/^/  /'
echo "runs: ${RCS[*]}; ${SECONDS}s" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$LOG" "$OUT/" 2>/dev/null
  [ -f "$PNG" ] && cp "$PNG" "$OUT/"
  [ -f "$COMBINED" ] && cp "$COMBINED" "$OUT/"
fi
