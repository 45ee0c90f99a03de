"""Where EP>1 spends time besides the all-to-all: the EP>1 code path run on one GPU.

With no EP group the dispatch functions return their input, so running the layer's
expert-parallel path (rank routing, token permute, local routing of the arrived rows,
their slot sum, the per-token sum of returned rows, the pipeline) on one GPU measures
everything EP>1 adds except the communication. Side by side with the EP=1 path (gather/scatter fused in the GEMMs),
forward+backward of the whole layer, CUDA-event medians, then the top CUDA kernels of
each path from torch.profiler.

    python benchmarks/experiments/profile_ep_path.py [--shapes qwen3-30b-a3b,deepseek-v3-ep8] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SHAPES, bench_ms  # noqa: E402

from ep_moe import MoEConfig, MoELayer  # noqa: E402
from ep_moe.ep.all_to_all import AllToAllDispatcher  # noqa: E402


def layer_for(shape, path: str) -> MoELayer:
    """One-GPU layer that takes the EP=1 (``"local"``) or the EP>1 (``"parallel"``) path."""
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_experts=shape.num_experts, top_k=shape.top_k, aux_loss_coef=0.0, backend="triton")
    layer = MoELayer(config, device="cuda", dtype=torch.bfloat16)
    if path == "parallel":
        layer.dispatcher = AllToAllDispatcher(layer.config, None, 0, 1, layer.num_local_experts)  # group None: no collective runs
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    args = parser.parse_args()
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        x = torch.randn(args.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        times = {}
        for path in ("local", "parallel"):
            layer = layer_for(shape, path)

            def step():
                layer(x).backward(dy)

            times[path] = bench_ms(step)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(f"--- {name} {path}: {times[path]:.3f} ms fwd+bwd", flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top), flush=True)
            del layer
            torch.cuda.empty_cache()
        print(f"=== {name}: EP=1 path {times['local']:.3f} ms, EP>1 path without comm {times['parallel']:.3f} ms "
              f"({times['parallel'] / times['local']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
