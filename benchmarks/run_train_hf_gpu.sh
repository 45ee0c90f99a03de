#!/usr/bin/env bash
# The trainer on a Hugging Face model: ep_moe's experts against transformers' own grouped_mm in the
# same training loop (ep_moe/train/trainer.py's step, timed by benchmarks/bench_train.py).
#   NPROC [1] = 1   both precision regimes, ep_moe against grouped_mm, eager and (pure bf16) compiled, then
#                   200-step loss curves of the two, of a second ep_moe seed and of ep_moe compiled
#   NPROC = N > 1   pure bf16: ep_moe at EP=N, ep_moe and grouped_mm at DP=N (every GPU all experts),
#                   ep_moe at EP=N compiled, transformers' own EP at EP=N (bench_train --experts hf_ep; eager
#                   only: its model is transformers', not the trainer's) and ep_moe at EP=N with FSDP,
#                   then 200-step loss curves of EP=N and DP=N (EP=1), the same global batch
#   model   Qwen3-30B-A3B's widths at LAYERS [4] layers, a 32k BPE (benchmarks/hf_train_fixture.py: generated
#           English text, MEGABYTES [48], the tokenizer trained on it; no weights, so the model starts from its init)
#   regimes pure bf16 (training.param_dtype = dtype = 'bfloat16': parameters and fused AdamW state in bf16),
#           and fp32 master weights under bf16 autocast (training.dtype = 'bfloat16'); compiled: training.compile
#           (each decoder layer one graph; COMPILE [1], 0 leaves the compiled runs out)
#   batch   BATCH [8] x SEQ [1024] tokens a step; WARMUP [5] untimed, STEPS [20] timed, PROFILE_STEPS [3] profiled
# Results (every run in one hf_train_<device>_x<NPROC>.json, and one log) go to $OUT (the device tool) or $WORK/results.
#   bash benchmarks/run_train_hf_gpu.sh      # NPROC=2 bash benchmarks/run_train_hf_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-1}
LAYERS=${LAYERS:-4}
MEGABYTES=${MEGABYTES:-48}
BATCH=${BATCH:-8}
SEQ=${SEQ:-1024}
WARMUP=${WARMUP:-5}
STEPS=${STEPS:-20}
PROFILE_STEPS=${PROFILE_STEPS:-3}
COMPILE=${COMPILE:-1}
case $COMPILE in 0|1) ;; *) echo "COMPILE must be 0 or 1, not '$COMPILE'" >&2; exit 2;; esac
CURVE_STEPS=${CURVE_STEPS:-200}
WORK=${WORK:-/tmp/train_hf_bench}
RESULTS=${OUT:-$WORK/results}
LOG=$RESULTS/run_train_hf_gpu.log
mkdir -p "$RESULTS" && : > "$LOG"
python3 benchmarks/hf_train_fixture.py --out "$WORK" --layers "$LAYERS" --megabytes "$MEGABYTES" 2>&1 | tail -n 2 | tee -a "$LOG"
TAG=qwen3-30b-a3b-${LAYERS}l
BF16=(--set "training.dtype='bfloat16'" --set "training.param_dtype='bfloat16'")
MASTER=(--set "training.dtype='bfloat16'")
COMPILED=(--set training.compile=true --warmup $((WARMUP + 3)))  # the compiles in the first steps, untimed
bench() {  # bench NAME ARGS...: one bench_train.py run, its summary line in the log
  local name=$1; shift
  timeout 300 python3 -m torch.distributed.run --nproc-per-node "$NPROC" --standalone benchmarks/bench_train.py \
    --hf-model "$WORK/model" --data "$WORK/text" --set training.batch_size="$BATCH" --set training.seq_len="$SEQ" \
    --set training.lr=3e-4 --set training.warmup_steps=20 --label "$TAG" --out "$RESULTS/train_hf_$name.json" "$@" \
    > "$WORK/$name.out" 2>&1
  echo "== $name (exit $?)" | tee -a "$LOG"
  grep -E "^train |Error|error:" "$WORK/$name.out" | tail -n 5 | tee -a "$LOG"
}
if [ "$NPROC" = 1 ]; then
  for regime in bf16 master; do
    if [ $regime = bf16 ]; then args=("${BF16[@]}"); else args=("${MASTER[@]}"); fi
    for experts in ep_moe grouped_mm; do
      bench "${regime}_${experts}" "${args[@]}" --experts $experts --warmup "$WARMUP" --steps "$STEPS" \
        --profile-steps "$PROFILE_STEPS"
    done
  done
  if [ "$COMPILE" = 1 ]; then
    for experts in ep_moe grouped_mm; do
      bench "bf16_compile_${experts}" "${BF16[@]}" --experts $experts "${COMPILED[@]}" --steps "$STEPS" \
        --profile-steps "$PROFILE_STEPS"
    done
  fi
  for experts in ep_moe grouped_mm; do  # the loss curves: every step timed and its loss kept
    bench "curve_bf16_${experts}" "${BF16[@]}" --experts $experts --warmup 0 --steps "$CURVE_STEPS" --profile-steps 0
  done
  bench "curve_bf16_ep_moe_seed1" "${BF16[@]}" --set training.seed=1 --warmup 0 --steps "$CURVE_STEPS" --profile-steps 0
  if [ "$COMPILE" = 1 ]; then
    bench "curve_bf16_compile_ep_moe" "${BF16[@]}" --set training.compile=true --warmup 0 --steps "$CURVE_STEPS" \
      --profile-steps 0
  fi
else
  bench "bf16_ep_moe_ep$NPROC" "${BF16[@]}" --ep-size "$NPROC" --warmup "$WARMUP" --steps "$STEPS" --profile-steps "$PROFILE_STEPS"
  if [ "$COMPILE" = 1 ]; then
    bench "bf16_compile_ep_moe_ep$NPROC" "${BF16[@]}" --ep-size "$NPROC" "${COMPILED[@]}" --steps "$STEPS" \
      --profile-steps "$PROFILE_STEPS"
  fi
  for experts in ep_moe grouped_mm; do
    bench "bf16_${experts}_dp$NPROC" "${BF16[@]}" --experts $experts --ep-size 1 --warmup "$WARMUP" --steps "$STEPS" \
      --profile-steps "$PROFILE_STEPS"
  done
  # transformers' own EP (FSDP2 over every rank, transformers 5.21+ and accelerate) against ep_moe's EP with FSDP
  bench "bf16_hf_ep_ep$NPROC" "${BF16[@]}" --experts hf_ep --ep-size "$NPROC" --warmup "$WARMUP" --steps "$STEPS" \
    --profile-steps "$PROFILE_STEPS"
  bench "bf16_ep_moe_ep${NPROC}_fsdp" "${BF16[@]}" --set parallel.fsdp=true --ep-size "$NPROC" --warmup "$WARMUP" \
    --steps "$STEPS" --profile-steps "$PROFILE_STEPS"
  for ep in "$NPROC" 1; do
    bench "curve_bf16_ep_moe_ep$ep" "${BF16[@]}" --ep-size "$ep" --warmup 0 --steps "$CURVE_STEPS" --profile-steps 0
  done
fi
# every run in one file, hf_train_<device>_x<NPROC>.json (what benchmarks/plot.py's train_hf.png reads)
python3 - "$RESULTS" "$NPROC" <<'PY'
import json, sys
from pathlib import Path
results = Path(sys.argv[1])
runs = [json.loads(p.read_text()) for p in sorted(results.glob("train_hf_*.json"))]
if runs:
    device = runs[0]["device"].replace(" ", "_")
    (results / f"hf_train_{device}_x{sys.argv[2]}.json").write_text(json.dumps(runs, indent=1) + "\n")
    for p in results.glob("train_hf_*.json"):
        p.unlink()
PY
