"""Can the EP all-to-all hide behind the expert GEMMs? NCCL against copy-engine transfers.

    torchrun --nproc-per-node 4 benchmarks/bench_a2a_overlap.py [--shapes qwen3-30b-a3b,mixtral-8x7b]

For each shape, the rows one EP layer's dispatch moves (uniform top-k routing of
``--tokens`` tokens per rank, one row per token and destination rank, as ep_moe sends)
go from every rank to every rank in two ways:

- ``nccl``: ``all_to_all_single`` with uneven splits (NCCL kernels, which need SMs);
- ``ce``: :class:`ep_moe.copy_engine.CopyEngineExchange`, the layer's copy-engine
  transport: rows staged in a symmetric-memory workspace, pulled by every receiver with
  ``copy_`` (cudaMemcpy over NVLink: the copy engines), stream-memory-operation flags
  instead of barriers, so no SM anywhere.

Each is timed alone (ce with its staging copy), then started just before the local experts'
forward (Triton grouped GEMMs on the rows received, SwiGLU) and timed together with it,
with the GEMMs on every SM and with ``reserve_sms`` SMs left free. ``hidden`` is the
share of the transfer that overlapped: (compute + a2a - together) / a2a.
CUDA-event medians over ``--iters``; the table shows the slowest rank's median.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, fixed_median_ms, save_results  # noqa: E402

from ep_moe.copy_engine import CopyEngineExchange, SymmetricWorkspace  # noqa: E402
from ep_moe.dispatch import SplitSizes, start_dispatch  # noqa: E402
from ep_moe.kernels.grouped_gemm import reserve_sms  # noqa: E402
from ep_moe.layer import expert_mlp  # noqa: E402
from ep_moe.routing import rank_counts  # noqa: E402


def median_ms(fn, iters: int) -> float:
    dist.barrier()
    return fixed_median_ms(fn, iters)


def slowest(value: float) -> float:
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_shape(shape, args, group) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_experts = shape.num_experts // world
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    scores = torch.rand(args.tokens, shape.num_experts, device="cuda", generator=gen)
    ids_TK = scores.topk(shape.top_k, dim=1).indices
    _, counts_P2 = rank_counts(ids_TK, None, local_experts, world)
    send_counts = counts_P2[:, 0].contiguous()
    matrix_t = torch.empty(world, world, dtype=send_counts.dtype, device="cuda")
    dist.all_gather_into_tensor(matrix_t, send_counts, group=group)
    matrix = matrix_t.tolist()
    splits = SplitSizes(send=matrix[rank], recv=[matrix[q][rank] for q in range(world)])
    dtype = torch.bfloat16
    send_UH = torch.randn(sum(splits.send), shape.hidden, device="cuda", dtype=dtype)
    recv_SH = torch.empty(splits.num_recv, shape.hidden, device="cuda", dtype=dtype)
    workspace = SymmetricWorkspace.for_group(group, torch.device("cuda", torch.cuda.current_device()))
    ce = CopyEngineExchange(workspace, [matrix], {"rows": shape.hidden * send_UH.element_size()})

    def ce_run():
        ce.begin()
        return ce.dispatch(send_UH, 0, "rows")

    # correctness of the copy-engine path against NCCL
    got = ce_run().wait()
    expect = start_dispatch(send_UH, splits, group).wait()
    torch.cuda.synchronize()
    ce_ok = bool(torch.equal(got, expect))

    # the local experts' forward on what arrived: uniform over local experts, mean slots per row
    slots = args.tokens * shape.top_k  # slots one rank serves on average
    m_sizes = torch.full((local_experts,), slots // local_experts, dtype=torch.int32, device="cuda")
    gather = torch.randint(0, splits.num_recv, (int(m_sizes.sum()),), device="cuda", dtype=torch.int32)
    gate_up = torch.randn(local_experts, 2 * shape.intermediate, shape.hidden, device="cuda", dtype=dtype) * 0.02
    down = torch.randn(local_experts, shape.hidden, shape.intermediate, device="cuda", dtype=dtype) * 0.02

    def compute(reserve: int = 0):
        with reserve_sms(reserve):
            expert_mlp(recv_SH, gate_up, down, m_sizes, activation="swiglu", gather_index=gather,
                       backend="triton")

    def nccl_start():
        work = dist.all_to_all_single(expect, send_UH, splits.recv, splits.send, group=group, async_op=True)
        return work.wait

    def ce_start():
        return ce_run().wait

    def together(start, reserve: int):
        def fn():
            finish = start()
            compute(reserve)
            finish()
        return fn

    out = {"shape": shape.name, "rows_sent": sum(splits.send), "rows_recv": splits.num_recv,
           "bytes_sent_remote": (sum(splits.send) - matrix[rank][rank]) * shape.hidden * 2,
           "ce_matches_nccl": ce_ok}
    out["compute_ms"] = slowest(median_ms(compute, args.iters))
    for reserve in args.reserve:
        out[f"compute_r{reserve}_ms"] = slowest(median_ms(lambda: compute(reserve), args.iters))
    for name, start in (("nccl", nccl_start), ("ce", ce_start)):
        alone = slowest(median_ms(lambda: start()(), args.iters))
        out[f"{name}_ms"] = alone
        out[f"{name}_GBps"] = out["bytes_sent_remote"] / alone / 1e6
        for reserve in [0] + list(args.reserve):
            both = slowest(median_ms(together(start, reserve), args.iters))
            out[f"{name}+compute_r{reserve}_ms"] = both
            out[f"{name}_hidden_r{reserve}"] = (out["compute_ms"] + alone - both) / alone
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reserve", type=lambda s: [int(v) for v in s.split(",") if v], default=[16, 32],
                        help="SM counts the GEMMs leave free in the overlapped runs (besides 0)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    local_rank = dist.get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(local_rank)
    group = dist.group.WORLD
    results = []
    for name in args.shapes.split(","):
        row = bench_shape(SHAPES[name], args, group)
        results.append(row)
        if dist.get_rank() == 0:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    if dist.get_rank() == 0 and args.out is not None:
        save_results(args.out, {"ranks": dist.get_world_size(), "tokens_per_rank": args.tokens, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
