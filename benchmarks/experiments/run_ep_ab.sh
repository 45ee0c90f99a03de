#!/usr/bin/env bash
# Same-machine A/B of the EP layer: an old tree against this one, runs alternating, so that
# host and machine noise (10 to 20% run to run at qwen3's size) falls on both sides alike.
# Each side runs its OWN benchmarks/bench_ep.py and ep_moe (cd into the tree, PYTHONPATH=tree),
# with --variants in that tree's syntax; the summary pairs the layers that run the same config.
#
# Old tree: a folder INSIDE this repo (only the working tree travels to a GPU machine; the
# device tool takes an ignored folder named in its `carry`). Prepare it here, e.g. for the
# last commit with MoEConfig.transport / overlap_chunks (the parent of the one that removed them):
#   base=$(git log -1 --format=%H -S "overlap_chunks: int = 1" -- ep_moe/layer.py)~1
#   rm -rf .baseline && mkdir .baseline && git archive "$base" | tar -x -C .baseline
#   x=$(git rev-parse --git-path info/exclude); grep -qxF /.baseline/ "$x" 2>/dev/null || echo /.baseline/ >> "$x"
# then on a 4-GPU machine (device tool: kind nvidia-h100-x4, carry [".baseline"], timeout_s 540;
# four bench_ep runs of about a minute each; results in /tmp, as the tool's $OUT takes 8 files):
#   ROUNDS=2 ITERS=10 WARMUP=3 BENCH_CAP_S=180 OUT=/tmp/ep_ab bash benchmarks/experiments/run_ep_ab.sh; rc=$?
#   tar -czf "$OUT/ep_ab.tgz" -C /tmp ep_ab; exit $rc
# and afterwards `rm -rf .baseline` here. Old and new variants, paired (the defaults below):
#   old tree ($base)   bench_ep --variants nccl:1,ag:1,agce:1 -> layers ep_moe, ep_moe_ag_c1, ep_moe_agce_c1
#   this tree          bench_ep --variants nccl,ag,agce       -> layers ep_moe, ep_moe_ag,    ep_moe_agce
#   (MoEConfig dispatch all_to_all / all_gather / all_gather_copy_engine; old: transport="nccl",
#   dispatch="all_gather" transport="nccl", dispatch="all_gather" transport="copy_engine", all
#   with overlap_chunks=1). The summary drops the old names' "_c1" (one chunk) to pair them.
# Environment (defaults in brackets):
#   BASE [.baseline]  EP [all GPUs]  ROUNDS [2]  SHAPES [all]  ITERS [20]  WARMUP [5]
#   OLD_VARIANTS [nccl:1,ag:1,agce:1], NEW_VARIANTS [nccl,ag,agce]: bench_ep --variants of each
#     side (each tree's own syntax)
#   EP1 [0]: 1 also times this tree at EP=1 on the same machine (the EP=P / EP=1 ratio)
#   EP1_RANKS [1]: GPUs of that EP=1 run; more run data-parallel replicas at once (bench_ep
#     --ep-size 1), every GPU busy as at EP=P, the slowest one reported
#   GRAPH [0]: 1 passes --graph (both sides and EP=1): the sync-free layers also run captured
#     in CUDA graphs, as <layer>+graph, each compared with EP=1 graphed
#   BENCH_CAP_S [300]: the most seconds one bench_ep run may take
#   DEVICE [cuda]: cpu runs the same on gloo (a smoke test, e.g. DEVICE=cpu SHAPES=tiny EP=2
#     OLD_VARIANTS=nccl:1,ag:1 NEW_VARIANTS=nccl,ag: the copy engines need CUDA)
#   OUT [/tmp/ep_ab]: results folder
# Each round runs benchmarks/bench_ep.py --impls ep_moe of the old tree, then of this one;
# the summary (and $OUT/ep_ab.json) gives every run's ms and the medians per side.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BASE=$(cd "${BASE:-.baseline}" && pwd) || { echo "no old tree at ${BASE:-.baseline}: see the header" >&2; exit 2; }
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then EP=${EP:-2}; else EP=${EP:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}; fi
[ "$EP" -ge 1 ] 2>/dev/null || { echo "EP=$EP: need at least one rank (no GPU here? DEVICE=cpu runs on gloo)" >&2; exit 2; }
RESULTS=${OUT:-/tmp/ep_ab}
mkdir -p "$RESULTS"
rm -f "$RESULTS"/ep"$EP"_*_r*.json* "$RESULTS"/ep1_new.json*
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

bench() {  # bench <tree> <ranks> <variants> <out json> <label> [bench_ep args]; full output in <out json>.log
  (cd "$1" && PYTHONPATH=$1 timeout "${BENCH_CAP_S:-300}" python3 -m torch.distributed.run --nproc-per-node "$2" \
    benchmarks/bench_ep.py --device "$DEVICE" --impls ep_moe --variants "$3" --iters "${ITERS:-20}" \
    --warmup "${WARMUP:-5}" --shapes "${SHAPES:-all}" --out "$4" $([ "${GRAPH:-0}" = 1 ] && echo --graph) \
    ${6:-} > "$4.log" 2>&1)
  local rc=$?
  grep "fwd+bwd" "$4.log" | sed "s/^/$5 /"
  [ $rc = 0 ] || echo "$5: bench_ep exited with $rc; see $4.log" >&2
}

for round in $(seq "${ROUNDS:-2}"); do
  bench "$BASE" "$EP" "${OLD_VARIANTS:-nccl:1,ag:1,agce:1}" "$RESULTS/ep${EP}_old_r$round.json" "old r$round"
  bench "$ROOT" "$EP" "${NEW_VARIANTS:-nccl,ag,agce}" "$RESULTS/ep${EP}_new_r$round.json" "new r$round"
done
if [ "${EP1:-0}" = 1 ]; then
  bench "$ROOT" "${EP1_RANKS:-1}" nccl "$RESULTS/ep1_new.json" "new EP=1" "--ep-size 1"
fi

python3 - "$RESULTS" "$EP" <<'EOF'
"""Per (shape, layer): every run's ms (slowest rank) and the median of each side; with an
EP=1 run, each side's median over this tree's EP=1 time. Layers pair by name, an old tree's
"_c1" (one chunk, before MoEConfig.overlap_chunks was removed) dropped: ep_moe_ag_c1 is ep_moe_ag."""
import json, re, statistics, sys
from pathlib import Path


def layer(impl):
    return re.sub(r"_c1(?=\+|$)", "", impl)


folder, ep = Path(sys.argv[1]), sys.argv[2]
runs, environment = {}, None
for path in sorted(folder.glob(f"ep{ep}_*_r*.json")):
    side = path.stem.split("_")[1]
    data = json.loads(path.read_text())
    environment = data["environment"]
    for row in data["results"]:
        runs.setdefault((row["shape"], layer(row["impl"])), {"old": [], "new": []})[side].append(row["ms"])
if not runs:
    sys.exit("no results")
ep1_path = folder / "ep1_new.json"
ep1 = {(row["shape"], row["impl"].endswith("+graph")): row["ms"]  # eager and graphed
       for row in json.loads(ep1_path.read_text())["results"]} if ep1_path.exists() else {}
results = []
for (shape, impl), ms in runs.items():
    row = dict(shape=shape, impl=impl, old_ms=ms["old"], new_ms=ms["new"],
               old_median=statistics.median(ms["old"]) if ms["old"] else None,
               new_median=statistics.median(ms["new"]) if ms["new"] else None,
               ep1_ms=ep1.get((shape, impl.endswith("+graph"))))
    results.append(row)
(folder / "ep_ab.json").write_text(json.dumps({"ep_size": int(ep), "environment": environment,
                                               "results": results}, indent=1))
print(f"\n== EP={ep} on {environment['device']}: ms fwd+bwd per GPU, old -> new (median of each side) ==")


def fmt(value):
    return "   -    " if value is None else f"{value:8.2f}"


for r in results:
    ratio = "" if r["ep1_ms"] is None else "  vs EP=1: " + " / ".join(
        "-" if m is None else f"{m / r['ep1_ms']:.3f}" for m in (r["old_median"], r["new_median"]))
    print(f"{r['shape']:16s} {r['impl']:18s} {fmt(r['old_median'])} -> {fmt(r['new_median'])}{ratio}"
          f"  old {r['old_ms']}  new {r['new_ms']}")
EOF
