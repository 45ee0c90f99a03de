"""The all-gather dispatch's expert step on one GPU: the expert MLP of one rank of an EP group
over every rank's gathered tokens, in a bound of rows (``P*T*min(K, e)``, about P times the rows
the rank's experts get), eager, on the fused kernels and on the small-call path
(:mod:`ep_moe.grouped_mm_experts`). Wall microseconds per call (the forward under ``no_grad``,
and forward + backward), the median of rounds that alternate the paths; the two paths' outputs
compared first. What sets ``GROUPED_MM_MAX_ROWS`` for bounded rows, without the collectives::

    python benchmarks/experiments/bench_bounded_rows.py --shape qwen3-30b-a3b --ep-size 4 --tokens 64,128,256,512
    TRITON_INTERPRET=1 python benchmarks/experiments/bench_bounded_rows.py --device cpu --shape tiny --tokens 4   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # repo, benchmarks/

from common import REPO, SHAPES, TINY, save_results  # noqa: E402

import ep_moe.grouped_mm_experts as small_call  # noqa: E402
from ep_moe.ep.all_gather import gathered_routing, row_bound  # noqa: E402
from ep_moe.experts import expert_mlp  # noqa: E402

PATHS = {"kernels": 0, "small": 1 << 30}
"""``GROUPED_MM_MAX_ROWS`` that sends every call to the fused kernels, or to the small-call path."""


def expert_call(shape, ep_size: int, tokens: int, device, dtype, generator):
    """A function running one rank's experts on ``ep_size * tokens`` gathered tokens (its
    forward, and with ``grad=True`` its backward), and the bound and counted rows."""
    local_experts, top_k, hidden = shape.num_experts // ep_size, shape.top_k, shape.hidden

    def param(*size):
        return (torch.randn(*size, device=device, generator=generator) * 0.02).to(dtype).requires_grad_()

    gate_up, down = param(local_experts, 2 * shape.intermediate, hidden), param(local_experts, hidden, shape.intermediate)
    gathered = ep_size * tokens
    ids = torch.rand(gathered, shape.num_experts, device=device, generator=generator).topk(top_k, dim=1).indices
    weights = torch.rand(gathered, top_k, device=device, generator=generator).to(dtype).requires_grad_()
    x = torch.randn(gathered, hidden, device=device, generator=generator).to(dtype).requires_grad_()
    dy = torch.randn(gathered, hidden, device=device, generator=generator).to(dtype)
    bound = row_bound(None, tokens, top_k, ep_size, local_experts)
    local, _ = gathered_routing(ids.to(torch.int32), 0, local_experts, bound, num_sources=ep_size, source_ends=False)

    def call(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            y = expert_mlp(x, gate_up, down, local.counts_E, activation="swiglu", gather_index=local.token_index_R,
                           row_weights=weights.reshape(-1).index_select(0, local.slot_index_R), backend="triton",
                           slot_sum=local, bounded_rows=True)
            if grad:
                y.backward(dy)
        return y.detach()

    return call, bound, int(local.counts_E.sum())


def per_call_us(call, grad: bool, calls: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        call(grad)
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {list(SHAPES)} or 'tiny'")
    parser.add_argument("--ep-size", type=int, default=4)
    parser.add_argument("--tokens", default="64,128,256,512", help="comma-separated tokens per rank")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape, device = TINY if args.shape == "tiny" else SHAPES[args.shape], torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":  # the small-call path takes CUDA bf16 calls only: let it run here
        small_call._eager_bf16_where_it_runs = lambda x: True
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        call, bound, counted = expert_call(shape, args.ep_size, tokens, device, dtype, generator)
        outputs = {}
        for path, max_rows in PATHS.items():
            small_call.GROUPED_MM_MAX_ROWS = max_rows
            call(True)  # compile, allocate
            outputs[path] = call(False).float()
        rel_err = ((outputs["small"] - outputs["kernels"]).norm() / outputs["kernels"].norm()).item()
        rounds = {(path, grad): [] for path in PATHS for grad in (False, True)}
        for r in range(args.rounds):
            for path in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
                small_call.GROUPED_MM_MAX_ROWS = PATHS[path]
                for grad in (False, True):
                    rounds[(path, grad)].append(per_call_us(call, grad, args.calls, sync))
        row = dict(tokens_per_rank=tokens, bound_rows=bound, counted_rows=counted, rel_err=rel_err,
                   **{f"{'fwd_bwd' if grad else 'fwd'}_{path}_us": statistics.median(times)
                      for (path, grad), times in rounds.items()},
                   rounds_us={f"{'fwd_bwd' if grad else 'fwd'}_{path}": times for (path, grad), times in rounds.items()})
        rows.append(row)
        print(f"{shape.name} EP={args.ep_size} T={tokens:5d} bound {bound:6d} counted {counted:6d} rel err "
              f"{rel_err:.1e}: fwd kernels {row['fwd_kernels_us']:7.0f} small {row['fwd_small_us']:7.0f} us; "
              f"fwd+bwd kernels {row['fwd_bwd_kernels_us']:7.0f} small {row['fwd_bwd_small_us']:7.0f} us", flush=True)
    out = args.out or (REPO / "benchmarks" / "experiments" / "results"
                       / f"bounded_rows_{shape.name}_ep{args.ep_size}.json")
    save_results(out, dict(benchmark="bench_bounded_rows", shape=shape.name, ep_size=args.ep_size,
                           calls=args.calls, rounds=args.rounds, results=rows))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
