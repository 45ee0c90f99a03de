#!/usr/bin/env bash
# Fill this node's ep_moe kernel cache before training jobs start.
#
#   launch/warmup_node.sh --model NAME_OR_FILE --ep-size N --tokens T [other `ep-moe autotune` options]
#
# --model is a preset of ep_moe/configs/models/ (e.g. qwen3-30b-a3b) or a JSON shape file; --ep-size
# and --tokens (tokens per rank per step) should match the training job, since the cache
# keys on the local expert count and the row bucket. With several GPUs the script runs
# `ep-moe autotune` under torchrun over all of them: rank 0 tunes and writes the cache, the
# others receive its configs (the run every job start does). With one GPU it runs one
# process; on a machine without a CUDA GPU `ep-moe autotune` says that tuning needs one and
# exits 1. A second run finds everything in the cache and returns in seconds; pass --force
# to retune.
#
# Environment:
#   NPROC             processes to start (default: the GPUs of CUDA_VISIBLE_DEVICES, else the
#                     count from `nvidia-smi -L`, at least 1)
#   EP_MOE_CACHE_DIR  cache directory (default ~/.cache/ep_moe/autotune; keep it node-local
#                     or on a shared file system: writes are atomic under a file lock)
#   TORCHRUN, EP_MOE  launcher and autotune command, split on spaces (default: `torchrun` and
#                     `ep-moe` from PATH; e.g. EP_MOE="python3 -m ep_moe.cli" without the script)
#
# SLURM, one task per node (each node tunes or reads its own cache in parallel):
#   srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 \
#        launch/warmup_node.sh --model qwen3-30b-a3b --ep-size 8 --tokens 8192
#
# A plain host list, over ssh (same checkout path and Python environment on every host):
#   for host in $(cat hosts.txt); do
#     ssh "$host" "cd $PWD && source .venv/bin/activate && \
#         launch/warmup_node.sh --model qwen3-30b-a3b --ep-size 8 --tokens 8192" &
#   done; wait
set -euo pipefail

if [[ $# -eq 0 || " $* " == *" -h "* || " $* " == *" --help "* ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit $(( $# == 0 ? 2 : 0 ))
fi

if [[ -z "${NPROC:-}" && -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then  # the GPUs this job may use
    IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
    NPROC=${#visible[@]}
elif [[ -z "${NPROC:-}" ]]; then
    NPROC=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
fi
(( NPROC >= 1 )) || NPROC=1
read -ra torchrun <<< "${TORCHRUN:-torchrun}"
read -ra ep_moe <<< "${EP_MOE:-ep-moe}"

echo "warmup_node: $(hostname): ${NPROC} process(es): ${ep_moe[*]} autotune $*" >&2
start=$SECONDS
if (( NPROC > 1 )); then
    "${torchrun[@]}" --standalone --nproc-per-node "$NPROC" --no-python "${ep_moe[@]}" autotune "$@"
else
    "${ep_moe[@]}" autotune "$@"
fi
echo "warmup_node: $(hostname): done in $(( SECONDS - start ))s" >&2
