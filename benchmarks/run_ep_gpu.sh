#!/usr/bin/env bash
# GPU check and EP benchmark in one go, for a 2- or 4-GPU machine. The benchmarks take about 3.5 minutes
# on a warm 4x H200 (EP1_RANKS=4; results/ep_NVIDIA_H200_x4_ep*.json); the whole GPU suite takes longer than its TESTS_CAP_S, as
# tests/gpu/test_ep_nccl.py runs every dispatch (about 3.5 minutes on a fresh 4x H200, its fixture 111 s):
# pick with EP_MOE_TEST_DISPATCHES (e.g. all_to_all,all_gather) or TESTS, or skip (TESTS="--co -q tests/gpu").
#   1. installs the wheels in .whl/ (deepspeed and the dependencies the image lacks) into /tmp/site;
#   2. runs the GPU tests (tests/gpu, tests/kernels; -x; over 8 workers, a file per worker, when pytest-xdist is there);
#   3. runs benchmarks/bench_ep.py at EP = 1, 2, 4 (as many as there are GPUs) on all four shapes,
#      with the ep_moe variants (dispatches) in $VARIANTS at EP>1 (and, with GRAPH=1, the sync-free ones
#      captured in CUDA graphs: bench_ep --graph), kernel configs from $EP_MOE_CACHE_DIR (a
#      cache benchmarks/run_autotune_gpu.sh filled, when run first on this machine) or shipped;
#   4. copies the results JSON and the logs into $OUT (if set) and prints a summary table.
#   ROUTING [uniform] / ZIPF_S [1.0]: bench_ep --routing/--zipf-s; ROUTING=zipf skews expert popularity
#   (results ..._zipf<s>.json, the summary says which routing).
#   EP1_RANKS [1]: GPUs of the EP=1 run; more run data-parallel replicas at once (bench_ep
#   --ep-size 1), every GPU busy as at EP>1, the slowest one reported.
# Every step has its own timeout (the tests TESTS_CAP_S [240], SIGINT so pytest still reports; a bench BENCH_CAP_S [150]), cut to what is left of a BUDGET_S [530] s budget. Run from anywhere:
#   bash benchmarks/run_ep_gpu.sh   # defaults: ITERS=10 WARMUP=3 ROUNDS=3 TOKENS=8192 VARIANTS=nccl,ag,agce GRAPH=1
#                                   # IMPLS=ep_moe,plain,deepspeed EP_SIZES="1 2 4" TESTS="tests/gpu tests/kernels"
set -uo pipefail
cd "$(dirname "$0")/.."
ITERS=${ITERS:-10}
WARMUP=${WARMUP:-3}
ROUNDS=${ROUNDS:-3}  # every layer timed ROUNDS times, order rotated (bench_ep --rounds)
TOKENS=${TOKENS:-8192}
VARIANTS=${VARIANTS:-nccl,ag,agce}  # bench_ep --variants: the all-to-all, the all-gather on NCCL and on the copy engines
GRAPH=${GRAPH:-1}
IMPLS=${IMPLS:-ep_moe,plain,deepspeed}
EP_SIZES=${EP_SIZES:-1 2 4}
ROUTING=${ROUTING:-uniform}  # bench_ep --routing: uniform or zipf (with --zipf-s $ZIPF_S)
ZIPF_S=${ZIPF_S:-1.0}
TESTS=${TESTS:-tests/gpu tests/kernels}
export EP_MOE_CACHE_DIR=${EP_MOE_CACHE_DIR:-/tmp/ep_moe_cache}
BUDGET_END=$((SECONDS + ${BUDGET_S:-530}))
LOGS=${OUT:-/tmp/ep_gpu}/logs
RESULTS=${OUT:-/tmp/ep_gpu}/results
mkdir -p "$LOGS" "$RESULTS"
STARTED=$(mktemp)  # results newer than this file are this run's
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off on these machines (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

left() {  # seconds a step may take: its cap, or what is left of the budget
  local rest=$((BUDGET_END - SECONDS))
  echo $(( rest < $1 ? (rest > 10 ? rest : 10) : $1 ))
}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH || echo "wheel install failed: deepspeed comparisons will be skipped"
else
  echo "no .whl/ wheels: deepspeed comparisons will be skipped"
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
nvidia-smi -L

# loadfile: a module's tests on one worker, so test_ep_nccl.py's 4-GPU fixture runs once, not once per worker
XDIST=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8 --dist loadfile")
timeout -s INT "$(left "${TESTS_CAP_S:-240}")" python3 -m pytest -x -q -p no:cacheprovider $XDIST $TESTS 2>&1 \
  | grep -v DEBUG | tee "$LOGS/tests.log"
TESTS_RC=${PIPESTATUS[0]}

BENCH_RC=()
for P in $EP_SIZES; do
  [ "$P" -le "$NGPU" ] || continue
  RANKS=$([ "$P" = 1 ] && echo "${EP1_RANKS:-1}" || echo "$P")
  [ "$RANKS" -le "$NGPU" ] || { echo "EP=$P on $RANKS ranks: only $NGPU GPUs; skipped" >&2; continue; }
  timeout "$(left "${BENCH_CAP_S:-150}")" python3 -m torch.distributed.run --nproc-per-node "$RANKS" benchmarks/bench_ep.py \
    --ep-size "$P" --tokens "$TOKENS" --iters "$ITERS" --warmup "$WARMUP" --rounds "$ROUNDS" --variants "$VARIANTS" \
    --impls "$IMPLS" --routing "$ROUTING" --zipf-s "$ZIPF_S" $([ "$GRAPH" = 1 ] && echo --graph) 2>&1 | tee "$LOGS/bench_ep$P.log"
  BENCH_RC+=("EP=$P:${PIPESTATUS[0]}")
done
find benchmarks/results -name 'ep_*_ep*.json' -newer "$STARTED" -exec cp {} "$RESULTS/" \;

python3 - "$RESULTS" <<'EOF'
"""Summary: slowest-rank fwd+bwd ms per shape and layer at each EP size, the forward
all-to-all at the largest EP, the plain layer's time over this one's there, and this
one's per-GPU time there over EP=1's (ep_moe's EP=1 for its variants)."""
import json, sys
from pathlib import Path

runs = {}
for path in sorted(Path(sys.argv[1]).glob("ep_*_ep*.json")):
    data = json.loads(path.read_text())
    runs[data["ep_size"]] = data
if not runs:
    sys.exit("no results")
sizes = sorted(runs)
device = runs[sizes[-1]]["environment"]["device"]
routing = runs[sizes[-1]].get("routing", "uniform")
if routing == "zipf":
    routing += f" s={runs[sizes[-1]]['zipf_s']:g}"
print(f"\n== {device}, fwd+bwd ms per GPU (slowest rank), {runs[sizes[-1]]['tokens_per_rank']} tokens/GPU, "
      f"routing {routing} ==")
rows = {}
for ep, data in runs.items():
    for r in data["results"]:
        rows.setdefault((r["shape"], r["impl"]), {})[ep] = r
print(f"{'shape':16s} {'layer':12s} " + " ".join(f"{'EP=' + str(ep):>8s}" for ep in sizes)
      + f" {'a2a@EP' + str(sizes[-1]):>10s} {'plain/this':>11s} {'EP' + str(sizes[-1]) + '/EP1':>9s}")
for (shape, impl), by_ep in rows.items():
    top = by_ep.get(sizes[-1])
    plain = rows.get((shape, "plain"), {}).get(sizes[-1])
    ratio = plain["ms"] / top["ms"] if top and plain and top["valid"] else float("nan")
    ep1 = rows.get((shape, "ep_moe" if impl.startswith("ep_moe") else impl), {}).get(1)
    scaling = top["ms"] / ep1["ms"] if top and ep1 and top["valid"] else float("nan")
    cells = " ".join(f"{by_ep[ep]['ms']:8.2f}" if ep in by_ep else f"{'-':>8s}" for ep in sizes)
    a2a = f"{top['a2a_ms']:10.2f}" if top else f"{'-':>10s}"
    flag = "" if all(r["valid"] for r in by_ep.values()) else "  INVALID"
    print(f"{shape:16s} {impl:12s} {cells} {a2a} {ratio:11.2f} {scaling:9.2f}{flag}")
EOF
echo "tests rc=$TESTS_RC; bench ${BENCH_RC[*]}; logs in $LOGS, results in $RESULTS; ${SECONDS}s"
