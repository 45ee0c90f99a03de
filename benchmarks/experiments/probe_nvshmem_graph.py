"""Can the EP exchange run without a host sync, inside a CUDA graph? A probe of PyTorch's
NVSHMEM ``all_to_all_vdev`` (split sizes on the device) on the layer's dispatch sizes.

    torchrun --nproc-per-node 2 benchmarks/experiments/probe_nvshmem_graph.py [--shape qwen3-30b-a3b]

One step here is the EP layer's exchange without its experts: the (token, rank) pairs of
a top-k routing, built on the device; the rows gathered in destination order; a vdev
dispatch; a vdev combine that sends every arrived row back to its source. The script

1. checks the step's arrived and returned rows against ``all_to_all_single`` with host
   split sizes (bit-equal), eagerly;
2. times one eager call's host cost, vdev against ``all_to_all_single``;
3. captures the step in a CUDA graph, replays it on fresh routings (other split sizes,
   written on the device only) and checks each replay as in 1;
4. times replay against the eager step (GPU ms and host us, medians).

Needs a PyTorch with NVSHMEM (``symm_mem.is_nvshmem_available()``) and its newer vdev
schema ``(input, out, in_splits, out_splits_offsets, group_name)``; exits with a message
otherwise. Writes ``benchmarks/experiments/results/nvshmem_graph_<device>_x<P>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import REPO, SHAPES, save_results  # noqa: E402

TOKENS = 8192


def host_us(fn, iters: int = 50) -> float:
    """Median host time of ``fn()`` in us (the GPU work it queues is not waited for)."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def timed(fn, iters: int = 20) -> tuple[float, float]:
    """(GPU ms, host us) medians of ``fn()`` started on an idle GPU, ranks aligned."""
    gpu, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        began = time.perf_counter()
        fn()
        host.append((time.perf_counter() - began) * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: benchmarks/experiments/results/)")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    import torch.distributed._symmetric_memory as symm_mem

    if not getattr(symm_mem, "is_nvshmem_available", lambda: False)():
        sys.exit(f"this PyTorch ({torch.__version__}) has no NVSHMEM: nothing to probe")
    vdev = torch.ops.symm_mem.all_to_all_vdev
    if "out_splits_offsets" not in str(vdev.default._schema):
        sys.exit(f"all_to_all_vdev has the older schema {vdev.default._schema}: not handled")
    symm_mem.set_backend("NVSHMEM")
    group_name = dist.group.WORLD.group_name
    shape = SHAPES[args.shape]
    rows_max, hidden, experts_per_rank = TOKENS * ranks, shape.hidden, shape.num_experts // ranks

    def symmetric(*size, dtype):
        tensor = symm_mem.empty(size, dtype=dtype, device=device)
        symm_mem.rendezvous(tensor, group_name)
        return tensor

    send_RH, arrived_RH, returned_RH = (symmetric(rows_max, hidden, dtype=torch.bfloat16) for _ in range(3))
    send_splits, back_splits = symmetric(ranks, dtype=torch.int64), symmetric(ranks, dtype=torch.int64)
    arrived_at, returned_at = symmetric(2, ranks, dtype=torch.int64), symmetric(2, ranks, dtype=torch.int64)
    ids_TK = torch.empty(TOKENS, shape.top_k, dtype=torch.int64, device=device)  # the graph's inputs
    x_TH = torch.empty(TOKENS, hidden, dtype=torch.bfloat16, device=device)

    def sends() -> torch.Tensor:
        sends_TP = torch.zeros(TOKENS, ranks, dtype=torch.bool, device=device)
        return sends_TP.scatter_(1, ids_TK // experts_per_rank, True)

    def step() -> None:
        """Routing -> rows in destination order -> dispatch -> every arrived row sent back."""
        sends_TP = sends()
        # the (rank, token) pairs that are sent come first, rank-major; the rest is never read
        order = torch.sort(sends_TP.t().flatten().logical_not().to(torch.int8), stable=True).indices
        send_splits.copy_(sends_TP.sum(0))
        send_RH.copy_(x_TH.index_select(0, order % TOKENS))
        vdev(send_RH, arrived_RH, send_splits, arrived_at, group_name)
        back_splits.copy_(arrived_at[0])
        vdev(arrived_RH, returned_RH, back_splits, returned_at, group_name)

    def fresh_routing(seed: int) -> None:
        generator = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
        scores = torch.rand(TOKENS, shape.num_experts, device=device, generator=generator)
        scores[:, :experts_per_rank] += 0.3 * seed  # skew toward rank 0's experts, more each seed
        ids_TK.copy_(scores.topk(shape.top_k, dim=1).indices)
        x_TH.copy_(torch.randn(TOKENS, hidden, device=device, generator=generator).to(torch.bfloat16))

    def check(label: str) -> dict:
        sends_TP = sends()
        send = sends_TP.sum(0)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send, recv = send.tolist(), recv.tolist()
        rows = torch.cat([x_TH[sends_TP[:, p]] for p in range(ranks)])
        want = torch.empty(sum(recv), hidden, dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(want, rows, recv, send)
        starts = arrived_at[1].tolist()
        arrived = torch.cat([arrived_RH[s: s + n] for s, n in zip(starts, recv)])
        result = {"case": label, "sent": sum(send), "arrived": sum(recv),
                  "dispatch_equal": arrived_at[0].tolist() == recv and torch.equal(arrived, want),
                  "round_trip_equal": torch.equal(returned_RH[: sum(send)], rows)}
        flags = torch.tensor([result["dispatch_equal"], result["round_trip_equal"]], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        result["all_ranks_equal"] = bool(flags.all())
        return result

    fresh_routing(0)
    step()
    torch.cuda.synchronize()
    checks = [check("eager")]
    single_out = torch.empty_like(arrived_RH)
    even = [rows_max // ranks // 2] * ranks
    cost = {"all_to_all_vdev_host_us": host_us(lambda: vdev(send_RH, arrived_RH, send_splits, arrived_at, group_name)),
            "all_to_all_single_host_us": host_us(lambda: dist.all_to_all_single(
                single_out[: sum(even)], send_RH[: sum(even)], even, even, async_op=True))}
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graph asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        fresh_routing(seed)
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        checks.append(check(f"graph replay, routing {seed}"))
    cost["graph_replay_gpu_ms"], cost["graph_replay_host_us"] = timed(graph.replay)
    cost["eager_step_gpu_ms"], cost["eager_step_host_us"] = timed(step)
    if rank == 0:
        for c in checks:
            print(f"{c['case']:26s} rows sent {c['sent']:6d} arrived {c['arrived']:6d}  "
                  f"equal on every rank: {c['all_ranks_equal']}", flush=True)
        print(", ".join(f"{k} {v:.3f}" for k, v in cost.items()), flush=True)
        device_name = torch.cuda.get_device_name(device).replace(" ", "_")
        out = args.out or REPO / "benchmarks" / "experiments" / "results" / f"nvshmem_graph_{device_name}_x{ranks}.json"
        save_results(out, {"shape": args.shape, "tokens_per_rank": TOKENS, "ranks": ranks,
                           "checks_rank0": checks, "cost_rank0": cost})
        print(f"wrote {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
