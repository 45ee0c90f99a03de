"""Where the backward time goes: each piece of the grouped GEMM backward timed alone, with
the compiled IR's pipelining markers, on one projection of one shape."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SHAPES, bench_ms, random_routing  # noqa: E402

from ep_moe.kernels.config import DEFAULT_CONFIGS  # noqa: E402
from ep_moe.kernels import grouped_gemm as gg  # noqa: E402
from ep_moe.kernels.permute import launch_gather_rows  # noqa: E402


def ir_markers(compiled) -> dict:
    ttgir = compiled.asm.get("ttgir", "")
    return {m: ttgir.count(m) for m in ("async_copy_global_to_local", "warp_group_dot", "ttng.tc_gen5_mma",
                                         "tt.dot ", "async_wait", "descriptor_load", "scf.while")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ir-dir", default=None)
    args = ap.parse_args()
    s = SHAPES[args.shape]
    m_sizes, g, sc = random_routing(args.tokens, s.num_experts, s.top_k, "cuda")
    n, k = 2 * s.intermediate, s.hidden
    rows = args.tokens * s.top_k
    x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(s.num_experts, n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    x_sorted = x[g.long()]
    dw = torch.empty_like(w)
    buf = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * n * k
    pieces = {
        "gather rows": lambda: launch_gather_rows(x, g),
        "dw contiguous": lambda: gg.launch_dw(dy, x_sorted, dw, m_sizes, DEFAULT_CONFIGS["dw"]),
        "dx rows": lambda: gg.launch_rows(dy, w, buf, m_sizes, DEFAULT_CONFIGS["dx"], transpose_w=False),
        "dx rows + store idx": lambda: gg.launch_rows(dy, w, buf, m_sizes, DEFAULT_CONFIGS["dx"],
                                                      transpose_w=False, store_idx=sc),
        "argsort": lambda: torch.argsort(g, stable=True),
    }
    counts = torch.bincount(g.long(), minlength=args.tokens)
    offsets = torch.zeros(args.tokens + 1, device="cuda", dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    out = torch.empty_like(x)
    pieces["segment sum"] = lambda: gg.launch_segment_sum(buf, offsets, out)
    for name, fn in pieces.items():
        ms = bench_ms(fn)
        print(f"{args.shape} {name:22s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s-equiv", flush=True)
    for kern in (gg._grouped_dw_kernel, gg._grouped_rows_kernel):
        try:
            for dev_cache in kern.device_caches.values():
                for i, compiled in enumerate(dev_cache[0].values()):
                    print(kern.fn.__name__, ir_markers(compiled), flush=True)
                    if args.ir_dir:
                        Path(args.ir_dir, f"{kern.fn.__name__}_{i}.ttgir").write_text(compiled.asm["ttgir"])
        except Exception as exc:  # the cache layout differs across Triton versions
            print("no IR:", repr(exc))


if __name__ == "__main__":
    main()
