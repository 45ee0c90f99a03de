#!/usr/bin/env bash
# Same-machine A/B of the EP layer: an old tree against this one, runs alternating, so that
# host and machine noise (10 to 20% run to run at qwen3's size) falls on both sides alike.
#
# Prepare the old tree here (it travels with `carry`), then run on a GPU machine:
#   git archive <old-rev> | (rm -rf .baseline && mkdir .baseline && tar -x -C .baseline)
#   echo /.baseline/ >> "$(git rev-parse --git-dir)/info/exclude"
#   bash benchmarks/run_ep_ab.sh   # env: BASE=.baseline EP=<all GPUs> ROUNDS=2 SHAPES=all
#                                  #      ITERS=20 WARMUP=5 OUT=<results folder>
# Each round runs benchmarks/bench_ep.py --impls ep_moe of the old tree, then of this one;
# the summary (and $OUT/ep_ab.json) gives every run's ms and the medians per side.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=$(cd "${BASE:-.baseline}" && pwd) || { echo "no old tree at ${BASE:-.baseline}: see the header" >&2; exit 2; }
EP=${EP:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
RESULTS=${OUT:-/tmp/ep_ab}
mkdir -p "$RESULTS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

for round in $(seq "${ROUNDS:-2}"); do
  for side in old new; do
    dir=$ROOT; [ "$side" = old ] && dir=$BASE
    (cd "$dir" && PYTHONPATH=$dir timeout 300 python3 -m torch.distributed.run --nproc-per-node "$EP" \
      benchmarks/bench_ep.py --impls ep_moe --iters "${ITERS:-20}" --warmup "${WARMUP:-5}" --shapes "${SHAPES:-all}" \
      --out "$RESULTS/ep${EP}_${side}_r$round.json" 2>&1 | grep "fwd+bwd" | sed "s/^/$side r$round /")
  done
done

python3 - "$RESULTS" "$EP" <<'EOF'
"""Per shape: every run's ms (slowest rank) and the median of each side."""
import json, statistics, sys
from pathlib import Path

folder, ep = Path(sys.argv[1]), sys.argv[2]
runs, environment = {}, None
for path in sorted(folder.glob(f"ep{ep}_*_r*.json")):
    side = path.stem.split("_")[1]
    data = json.loads(path.read_text())
    environment = data["environment"]
    for row in data["results"]:
        runs.setdefault(row["shape"], {"old": [], "new": []})[side].append(row["ms"])
if not runs:
    sys.exit("no results")
summary = {"ep_size": int(ep), "environment": environment, "results": [
    dict(shape=shape, old_ms=ms["old"], new_ms=ms["new"], old_median=statistics.median(ms["old"]),
         new_median=statistics.median(ms["new"])) for shape, ms in runs.items() if ms["old"] and ms["new"]]}
(folder / "ep_ab.json").write_text(json.dumps(summary, indent=1))
print(f"\n== EP={ep} on {environment['device']}: ms fwd+bwd per GPU, old -> new (median of each side) ==")
for r in summary["results"]:
    print(f"{r['shape']:16s} {r['old_median']:8.2f} -> {r['new_median']:8.2f}  ({r['new_median'] / r['old_median']:.3f}x)"
          f"  old {r['old_ms']}  new {r['new_ms']}")
EOF
