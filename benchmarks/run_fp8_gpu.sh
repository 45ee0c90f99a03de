#!/usr/bin/env bash
# FP8 experts (MoEConfig(expert_precision="fp8")) on GPUs with FP8 tensor cores, in parts that each fit
# one 10-minute device call:
#   PART=tests   the FP8 kernels' and layer's tests in bf16 on the GPU (tests/kernels/test_fp8.py, the rows on
#                the wire (tests/ep/test_fp8_wire.py), tests/gpu/test_fp8_layer_cuda.py; its EP=2 test over NCCL
#                where 2 GPUs are visible), verbose,
#                into fp8_tests.log (about 5 minutes: compiles)
#   PART=sweep   bench_grouped_gemm.py --fp8 --sweep: a grid of configs for the FP8 forward and dX (and bf16's)
#                per projection, the best five of each in grouped_gemm_fp8_sweep_<device>_x1.json
#   PART=ep      benchmarks/bench_ep.py --fp8 at EP=NPROC [2]: the EP layer with bf16 and with FP8 experts, the
#                all-to-all and the all-gather dispatch, every shape (ep_<device>_ep<NPROC>_fp8.json)
#   PART=bench   benchmarks/bench_grouped_gemm.py --fp8: each shape's projections, FP8 (quantization included)
#                against bf16 torch._grouped_mm and torch._scaled_grouped_mm (about 2 minutes)
#   PART=parity  the trainer, STEPS [1000] steps of each preset in CONFIGS ["gpu qwen3_ep"] with bf16 and then
#                FP8 experts, same seed, fp32 master weights under bf16 autocast (the presets' regime), val loss
#                every 250 steps; all runs in fp8_parity_<device>_x1.json, what benchmarks/plot.py draws as
#                fp8_parity.png (gpu: about 2 x 2.5 minutes, qwen3_ep about 2 x 3.5, the bf16 runs' autotuning
#                included; run CONFIGS=gpu and CONFIGS=qwen3_ep in separate calls); PRECISIONS=fp8 reruns only
#                the FP8 side when the bf16 path is unchanged (plot.py pairs it with the newest bf16 run)
# Results go to $OUT (the device tool) or $WORK/results.
#   PART=parity CONFIGS=gpu bash benchmarks/run_fp8_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${PART:-tests}
STEPS=${STEPS:-1000}
CONFIGS=${CONFIGS:-gpu qwen3_ep}
PRECISIONS=${PRECISIONS:-bf16 fp8}
WORK=${WORK:-/tmp/fp8_gpu}
RESULTS=${OUT:-$WORK/results}
mkdir -p "$RESULTS" "$WORK"
case $PART in
tests)
  python3 -m pytest -q -p no:cacheprovider -v -rfE --tb=short tests/kernels/test_fp8.py tests/ep/test_fp8_wire.py \
    tests/gpu/test_fp8_layer_cuda.py \
    > "$RESULTS/fp8_tests.log" 2>&1
  echo "tests exit $?"; grep -E "passed|failed" "$RESULTS/fp8_tests.log" | tail -n 1
  ;;
bench)
  device=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')
  python3 benchmarks/bench_grouped_gemm.py --fp8 --out "$RESULTS/grouped_gemm_fp8_${device}_x1.json" \
    2>&1 | tee "$RESULTS/fp8_bench.log" | grep -E "FP8|saved"
  ;;
sweep)
  device=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')
  python3 benchmarks/bench_grouped_gemm.py --fp8 --sweep --sweep-passes forward,dx \
    --out "$RESULTS/grouped_gemm_fp8_sweep_${device}_x1.json" 2>&1 | tee "$RESULTS/fp8_sweep.log" | grep -E "sweep|saved"
  ;;
ep)
  device=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')
  python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" benchmarks/bench_ep.py --fp8 \
    --variants nccl,ag --impls ep_moe,plain --out "$RESULTS/ep_${device}_ep${NPROC:-2}_fp8.json" \
    2>&1 | tee "$RESULTS/fp8_ep.log" | grep -E "fwd\+bwd|skipped|saved"
  ;;
parity)
  for config in $CONFIGS; do
    for precision in $PRECISIONS; do
      name=${config}_${precision}
      rm -rf "$WORK/ck_$name"
      python3 -m torch.distributed.run --nproc-per-node 1 --standalone -m ep_moe.train --config "$config" \
        --set training.steps="$STEPS" --set "moe.expert_precision='$precision'" --set logging.eval_interval=250 \
        --set "logging.metrics_file='$WORK/$name.jsonl'" --set "checkpoint.dir='$WORK/ck_$name'" \
        --set checkpoint.interval=100000 > "$WORK/$name.out" 2>&1
      echo "$name exit $?: $(grep -E 'run done' "$WORK/$name.out" | cut -c1-160)"
    done
  done
  # this call's runs added to fp8_parity_<device>_x1.json (plot.py draws the newest run per config and precision)
  python3 - "$WORK" "$RESULTS" "$PRECISIONS" $CONFIGS <<'PY'
import json, statistics, subprocess, sys
from pathlib import Path
import torch, triton
work, results, precisions, configs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(), sys.argv[4:]
device = torch.cuda.get_device_name()
out = results / f"fp8_parity_{device.replace(' ', '_')}_x1.json"
held = out if out.exists() else Path("benchmarks/results") / out.name  # earlier calls' runs are kept
data = json.loads(held.read_text()) if held.exists() else {
    "what": "the trainer (torchrun -m ep_moe.train --config CONFIG --set training.steps=N --set "
            "moe.expert_precision=P), 1 GPU, fp32 master weights under bf16 autocast, same seed; loss every "
            "10 steps, val loss every 250",
    "device": device, "torch": torch.__version__, "triton": triton.__version__, "runs": []}
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
for config in configs:
    for precision in precisions:
        path = work / f"{config}_{precision}.jsonl"
        if not path.exists():
            print(f"{config} {precision}: no metrics (the run failed: see its .out)")
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        train = [r for r in rows if "loss" in r]
        val = {str(r["step"]): r["val_loss"] for r in rows if "val_loss" in r}
        if not train or not val:
            print(f"{config} {precision}: no val loss (the run stopped early)")
            continue
        data["runs"].append({
            "config": config, "expert_precision": precision, "commit": commit or "unknown", "steps": train[-1]["step"],
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in train if r["step"] >= 100)),
            "val_loss": val, "final_val_loss": val[max(val, key=int)],
            "loss": [[r["step"], r["loss"]] for r in train], "note": ""})
        print(f"{config} {precision}: final val loss {data['runs'][-1]['final_val_loss']:.5f}, "
              f"{data['runs'][-1]['median_tokens_per_s']} tokens/s")
out.write_text(json.dumps(data, indent=1) + "\n")
print(f"saved {out}")
PY
  ;;
*)
  echo "PART must be tests, bench, sweep, ep or parity, not '$PART'" >&2
  exit 2
  ;;
esac
