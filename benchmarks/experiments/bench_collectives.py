"""The all-gather dispatch's collectives alone: an all-gather of [T, H] rows per rank and
the reduce-scatter back, at the layer's sizes, under whatever NCCL_* settings the
environment gives (each setting needs a fresh process: NCCL reads them once).

    torchrun --nproc-per-node 4 benchmarks/experiments/bench_collectives.py [--hidden 2048,2880,4096,7168]
    NCCL_MIN_CTAS=32 torchrun --nproc-per-node 4 benchmarks/experiments/bench_collectives.py --tag ctas32

Rank 0 prints, per hidden size, the CUDA-event median of ``--iters`` calls (each after a
barrier) and the bandwidth into each GPU ((P-1) * T * H * 2 bytes over that time).
A run of each setting on 4x H200 is in ``benchmarks/PERFORMANCE_LOG.md`` (its JSON is in the
git history).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from ep_moe.distributed import all_gather_single, reduce_scatter_single  # the names of the torch at hand


def time_ms(fn, iters: int, warmup: int = 5) -> float:
    """Median of ``iters`` CUDA-event timings of ``fn``, each started after a barrier."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="rows per rank")
    parser.add_argument("--hidden", default="2048,2880,4096,7168", help="comma-separated row widths")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tag", default="default", help="label of this run's NCCL settings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_collectives.py times NCCL collectives: it needs GPUs (run it under torchrun)")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, size = dist.get_rank(), dist.get_world_size()
    for hidden in (int(h) for h in args.hidden.split(",")):
        mine = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        every = torch.empty(size * args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        arriving_gb = (size - 1) * mine.numel() * mine.element_size() / 1e9
        gather_ms = time_ms(lambda: all_gather_single(every, mine), args.iters)
        scatter_ms = time_ms(lambda: reduce_scatter_single(mine, every), args.iters)
        if rank == 0:
            print(f"{args.tag:24s} H={hidden:5d} all_gather {gather_ms:.3f} ms {arriving_gb / gather_ms * 1e3:4.0f} GB/s"
                  f"  reduce_scatter {scatter_ms:.3f} ms {arriving_gb / scatter_ms * 1e3:4.0f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
