#!/usr/bin/env bash
# CI's wheel job: the wheel is the product. Build it, install it into a fresh venv outside the
# checkout, and there (from a folder outside the checkout, nothing of it on the path) run what a
# user of the installed package runs:
#   1. the trainer on 2 CPU processes (gloo), on the tiny preset the wheel ships;
#   2. `ep-moe autotune --dry-run` on a model preset the wheel ships;
#   3. one example that needs no extra, copied out of the checkout.
# The venv gets the torch version of the Python that runs this (CI's CPU build) before the wheel,
# so that pip does not fetch a CUDA build. About 1-2 minutes.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ep_moe_wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
step() { echo "wheel check: $*"; }

# The wheel, built from a copy of what it packs (no build/ or egg-info left in the checkout).
mkdir -p "$WORK/src"
cp -r "$REPO/ep_moe" "$REPO/pyproject.toml" "$REPO/README.md" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/ep_moe-*.whl)
step "built $(basename "$WHEEL")"

TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
"$PYTHON" -m venv "$WORK/venv"
BIN=$WORK/venv/bin
"$BIN/python" -m pip install -q "torch==$TORCH"
"$BIN/python" -m pip install -q "$WHEEL"
step "installed with torch $TORCH into a fresh venv"

mkdir -p "$WORK/run"
cd "$WORK/run"
unset PYTHONPATH
export OMP_NUM_THREADS=1 EP_MOE_CACHE_DIR="$WORK/cache"
"$BIN/python" - <<'EOF'
import ep_moe
assert "site-packages" in ep_moe.__file__, f"ep_moe imported from {ep_moe.__file__}, not the installed wheel"
EOF

# 1. The main job: torchrun -m ep_moe.train, the shipped tiny preset (the default), 2 gloo ranks.
"$BIN/torchrun" --nproc-per-node 2 --standalone -m ep_moe.train --steps 20 \
  --set logging.progress_bar=false --checkpoint-dir ckpt --metrics-file metrics.jsonl > train.log 2>&1 \
  || { tail -40 train.log; echo "wheel check: the trainer failed" >&2; exit 1; }
"$BIN/python" - <<'EOF'
import json
records = [json.loads(line) for line in open("metrics.jsonl")]
losses = [r["loss"] for r in records if "loss" in r]
assert records[-1]["step"] == 20 and losses[-1] < losses[0], records
print(f"wheel check: torchrun -m ep_moe.train, 20 steps on 2 processes, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
EOF

# 2. A model preset from the package data.
"$BIN/ep-moe" autotune --model qwen3-30b-a3b --ep-size 8 --tokens 8192 --dry-run | tee autotune.txt
grep -q "^gate_up e16 n1536 k2048 top8 bfloat16" autotune.txt

# 3. An example outside the checkout (Triton's interpreter on a CPU).
cp "$REPO/examples/grouped_gemm.py" .
"$BIN/python" grouped_gemm.py | tee example.txt
grep -q "^grouped_gemm:" example.txt
step "passed"
