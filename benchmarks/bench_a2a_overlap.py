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

Each is timed alone (ce with its staging copy), then started just before some expert work
and timed together with it. The work (``--compute``): ``fwd`` the local experts' forward
(Triton grouped GEMMs on the rows received, SwiGLU), ``dw`` the two weight-gradient GEMMs
of the backward (what runs after the row gradients are known). The GEMMs launch
``persistent`` (one program per SM) or one program per ``tiles`` (``--grids``), and NCCL runs on groups with normal or high-priority streams and with
NCCL's default or a capped number of CTAs (``--nccl``). ``hidden`` is the share of the
transfer that overlapped: (compute + a2a - together) / a2a.
CUDA-event medians over ``--iters``; the table shows the slowest rank's median.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, fixed_median_ms, save_results  # noqa: E402

from ep_moe.copy_engine import CopyEngineExchange, SymmetricWorkspace  # noqa: E402
from ep_moe.dispatch import SplitSizes, all_gather_single, start_dispatch  # noqa: E402
from ep_moe.kernels.config import GemmConfigs  # noqa: E402
from ep_moe.kernels.grouped_gemm import launch_dw, one_program_per_tile, smem_limit_for  # noqa: E402
from ep_moe.layer import expert_mlp  # noqa: E402
from ep_moe.routing import rank_counts  # noqa: E402


def median_ms(fn, iters: int) -> float:
    dist.barrier()
    return fixed_median_ms(fn, iters)


def slowest(value: float) -> float:
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def nccl_group(world: int, high_priority: bool, max_ctas: int):
    """A group over every rank whose NCCL streams have that priority and CTA cap (0: NCCL's)."""
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = high_priority
    if max_ctas:
        options.config.max_ctas = max_ctas
    return dist.new_group(list(range(world)), backend="nccl", pg_options=options)


def bench_shape(shape, args, groups) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    local_experts = shape.num_experts // world
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    scores = torch.rand(args.tokens, shape.num_experts, device="cuda", generator=gen)
    ids_TK = scores.topk(shape.top_k, dim=1).indices
    _, counts_P2 = rank_counts(ids_TK, None, local_experts, world)
    send_counts = counts_P2[:, 0].contiguous()
    matrix_t = torch.empty(world, world, dtype=send_counts.dtype, device="cuda")
    all_gather_single(matrix_t, send_counts, group=group)
    matrix = matrix_t.tolist()
    splits = SplitSizes(send=matrix[rank], recv=[matrix[q][rank] for q in range(world)])
    dtype = torch.bfloat16
    send_UH = torch.randn(sum(splits.send), shape.hidden, device="cuda", dtype=dtype)
    recv_SH = torch.empty(splits.num_recv, shape.hidden, device="cuda", dtype=dtype)
    workspace = SymmetricWorkspace.for_group(group, torch.device("cuda", torch.cuda.current_device()),
                                               "all_to_all")
    ce = CopyEngineExchange(workspace, [matrix], {"rows": shape.hidden * send_UH.element_size()})

    def ce_run():
        ce.begin()
        return ce.dispatch(send_UH, 0, "rows")

    # correctness of the copy-engine path against NCCL
    got = ce_run().wait()
    expect = start_dispatch(send_UH, splits, group).wait()
    torch.cuda.synchronize()
    ce_ok = bool(torch.equal(got, expect))

    # the local experts on what arrived: uniform over local experts, mean slots per row
    slots = args.tokens * shape.top_k  # slots one rank serves on average
    m_sizes = torch.full((local_experts,), slots // local_experts, dtype=torch.int32, device="cuda")
    num_slots = int(m_sizes.sum())
    gather = torch.randint(0, splits.num_recv, (num_slots,), device="cuda", dtype=torch.int32)
    gate_up = torch.randn(local_experts, 2 * shape.intermediate, shape.hidden, device="cuda", dtype=dtype) * 0.02
    down = torch.randn(local_experts, shape.hidden, shape.intermediate, device="cuda", dtype=dtype) * 0.02
    dw_config = GemmConfigs.defaults(recv_SH.element_size(), smem_limit_for(recv_SH.device)).dw
    x_MH = torch.randn(num_slots, shape.hidden, device="cuda", dtype=dtype)
    a_MI = torch.randn(num_slots, shape.intermediate, device="cuda", dtype=dtype)
    dh_MF = torch.randn(num_slots, 2 * shape.intermediate, device="cuda", dtype=dtype)
    dy_MH = torch.randn(num_slots, shape.hidden, device="cuda", dtype=dtype)
    dgate_up, ddown = torch.empty_like(gate_up), torch.empty_like(down)

    def forward():
        expert_mlp(recv_SH, gate_up, down, m_sizes, activation="swiglu", gather_index=gather, backend="triton")

    def weight_grads():
        launch_dw(dh_MF, x_MH, dgate_up, m_sizes, dw_config)
        launch_dw(dy_MH, a_MI, ddown, m_sizes, dw_config)

    works = {"fwd": forward, "dw": weight_grads}

    def compute(work: str, grid: str):
        with one_program_per_tile() if grid == "tiles" else contextlib.nullcontext():
            works[work]()

    def nccl_start(g):
        def start():
            work = dist.all_to_all_single(expect, send_UH, splits.recv, splits.send, group=g, async_op=True)
            return work.wait
        return start

    def ce_start():
        return ce_run().wait

    def together(start, work: str, grid: str):
        def fn():
            finish = start()
            compute(work, grid)
            finish()
        return fn

    out = {"shape": shape.name, "rows_sent": sum(splits.send), "rows_recv": splits.num_recv,
           "bytes_sent_remote": (sum(splits.send) - matrix[rank][rank]) * shape.hidden * 2,
           "ce_matches_nccl": ce_ok}
    for work in args.compute:
        for grid in args.grids:
            out[f"{work}_{grid}_ms"] = slowest(median_ms(lambda: compute(work, grid), args.iters))
    starts = {f"nccl_{name}": nccl_start(g) for name, g in groups.items()}
    starts["ce"] = ce_start
    for name, start in starts.items():
        alone = slowest(median_ms(lambda: start()(), args.iters))
        out[f"{name}_ms"] = alone
        out[f"{name}_GBps"] = out["bytes_sent_remote"] / alone / 1e6
        for work in args.compute:
            for grid in args.grids:
                both = slowest(median_ms(together(start, work, grid), args.iters))
                out[f"{name}+{work}_{grid}_ms"] = both
                out[f"{name}+{work}_{grid}_hidden"] = (out[f"{work}_{grid}_ms"] + alone - both) / alone
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compute", type=lambda s: s.split(","), default=["fwd", "dw"],
                        help="expert work to overlap: fwd (GEMMs + SwiGLU forward), dw (weight grads)")
    parser.add_argument("--grids", type=lambda s: s.split(","), default=["persistent", "tiles"],
                        help="GEMM launch: persistent (one program per SM) or tiles (one per tile)")
    parser.add_argument("--nccl", type=lambda s: s.split(","), default=["normal", "high", "high-ctas16"],
                        help="NCCL groups: normal or high-priority streams, -ctasN caps NCCL's CTAs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    local_rank = dist.get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(local_rank)
    groups = {}
    for name in args.nccl:
        priority, _, ctas = name.partition("-ctas")
        if priority not in ("normal", "high") or not (ctas == "" or ctas.isdigit()):
            raise SystemExit(f"--nccl {name!r}: use normal or high, optionally with -ctasN")
        groups[name] = nccl_group(dist.get_world_size(), priority == "high", int(ctas or 0))
    results = []
    for name in args.shapes.split(","):
        row = bench_shape(SHAPES[name], args, groups)
        results.append(row)
        if dist.get_rank() == 0:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    if dist.get_rank() == 0 and args.out is not None:
        save_results(args.out, {"ranks": dist.get_world_size(), "tokens_per_rank": args.tokens, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
