"""The dW kernel's variants, one GPU: the (n, k) tile order grouped GROUP N tiles at a time
(L2 reuse of dy's and x's columns), a TMA store epilogue, warp specialization of the
persistent loop (``tl.range(warp_specialize=True)``), and device-side TMA descriptors per
tile (one zero-filled loop over a segment instead of TMA steps plus a masked tail); against
ep_moe's dW kernel with its default config and ``torch._grouped_mm(dy.t(), x, offs)``, on
contiguous expert-ordered rows of the benchmark shapes (uniform routing, 8192 tokens).

What it decided (``benchmarks/PERFORMANCE_LOG.md``, 2026-11-30): the grouped order and the
TMA store went into ``_grouped_dw_kernel``; warp specialization and device descriptors gained
nothing consistent and stayed here.

    python benchmarks/experiments/probe_dw_variants.py [--shapes qwen3-30b-a3b,...] [--out dw_variants.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SHAPES, random_routing  # noqa: E402

from ep_moe.kernels import grouped_gemm as gg  # noqa: E402
from ep_moe.kernels.config import DEFAULT_CONFIGS  # noqa: E402


@triton.jit
def _dw2(dy_ptr, x_ptr, dy_desc, x_desc, dw_ptr, dw_desc, m_sizes_ptr, m_ends_ptr, E, N, K, stride_dym, stride_xm,
         stride_we, stride_wn,
         TILE_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         GROUP: tl.constexpr, DEV_DESC: tl.constexpr, STORE_TMA: tl.constexpr, WS: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_e = num_n * num_k
    for tile in tl.range(tl.program_id(0), E * per_e, TILE_STRIDE, warp_specialize=WS):
        e = tile // per_e
        pid_n, pid_k = gg._tile_coords(tile % per_e, num_n, num_k, GROUP)
        m_e = tl.load(m_sizes_ptr + e)
        seg = tl.load(m_ends_ptr + e) - m_e
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        if DEV_DESC:
            dy_d = tl.make_tensor_descriptor(dy_ptr + tl.cast(seg, tl.int64) * stride_dym, shape=[tl.maximum(m_e, 1), N],
                                             strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_N])
            x_d = tl.make_tensor_descriptor(x_ptr + tl.cast(seg, tl.int64) * stride_xm, shape=[tl.maximum(m_e, 1), K],
                                            strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
            for mi in range(tl.cdiv(m_e, BLOCK_M)):
                dy = dy_d.load([mi * BLOCK_M, pid_n * BLOCK_N])
                x = x_d.load([mi * BLOCK_M, pid_k * BLOCK_K])
                acc = tl.dot(tl.trans(dy), x, acc)
        else:
            num_full = m_e // BLOCK_M
            for mi in range(num_full):
                dy = dy_desc.load([seg + mi * BLOCK_M, pid_n * BLOCK_N])
                x = x_desc.load([seg + mi * BLOCK_M, pid_k * BLOCK_K])
                acc = tl.dot(tl.trans(dy), x, acc)
            tail = m_e - num_full * BLOCK_M
            offs_m = tl.arange(0, BLOCK_M)
            rows = tl.cast(seg + num_full * BLOCK_M, tl.int64) + offs_m
            if tail > 0:
                ok = offs_m < tail
                dy = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_n[None, :], mask=ok[:, None], other=0.0)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=ok[:, None], other=0.0)
                acc = tl.dot(tl.trans(dy), x, acc)
        if STORE_TMA:
            dw_desc.store([e, pid_n * BLOCK_N, pid_k * BLOCK_K], tl.reshape(acc.to(dw_desc.dtype), (1, BLOCK_N, BLOCK_K)))
        else:
            ptrs = dw_ptr + tl.cast(e, tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
            tl.store(ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


def dw2(dy, x, dw, m_sizes, m_ends, bm, bn, bk, st, wa, group, dev_desc, store_tma, ws):
    E, N, K = dw.shape
    tiles = E * triton.cdiv(N, bn) * triton.cdiv(K, bk)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(sms, tiles),)
    dyd = TensorDescriptor.from_tensor(dy, [bm, bn])
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    dwd = TensorDescriptor.from_tensor(dw, [1, bn, bk])
    _dw2[grid](dy, x, dyd, xd, dw, dwd, m_sizes, m_ends, E, N, K, dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1),
               TILE_STRIDE=grid[0], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=group, DEV_DESC=dev_desc,
               STORE_TMA=store_tma, WS=ws, num_warps=wa, num_stages=st)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b,gpt-oss-20b")
    parser.add_argument("--out", type=Path, default=Path("dw_variants.json"))
    args = parser.parse_args()
    # device-side descriptors take their 128 bytes from this allocator
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    tokens = 8192
    out = {}
    for name in args.shapes.split(","):
        s = SHAPES[name]
        m_sizes, _, _ = random_routing(tokens, s.num_experts, s.top_k, "cuda", torch.Generator(device="cuda").manual_seed(0))
        offs = torch.cumsum(m_sizes, 0, dtype=torch.int32)
        rows = tokens * s.top_k
        for proj in ("gate_up", "down"):
            n, k = (2 * s.intermediate, s.hidden) if proj == "gate_up" else (s.hidden, s.intermediate)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * n * k
            key = f"{name} {proj}"
            res = out[key] = {}
            ref = torch._grouped_mm(dy.t(), x, offs=offs)

            def rec(label, fn, o=None):
                try:
                    fn(); torch.cuda.synchronize()
                    e = None if o is None else ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                    ms = bench(fn)
                    res[label] = dict(ms=ms, err=e)
                    print(f"{key:24s} {label:40s} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TF/s" + ("" if e is None else f" err {e:.1e}"), flush=True)
                except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is a result
                    res[label] = dict(error=str(exc)[:200])
                    print(f"{key:24s} {label:40s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)

            rec("grouped_mm", lambda: torch._grouped_mm(dy.t(), x, offs=offs))
            dw = torch.empty(s.num_experts, n, k, device="cuda", dtype=torch.bfloat16)
            rec("ours default", lambda: gg.launch_dw(dy, x, dw, m_sizes, DEFAULT_CONFIGS["dw"]), dw)
            m_ends = torch.cumsum(m_sizes, 0, dtype=torch.int32)
            variants = []
            for (bm, bn, bk, st, wa) in ((64, 256, 128, 3, 8), (64, 128, 256, 3, 8)):
                for group in (1, 8):
                    for dev_desc, store_tma, ws in ((0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 1), (0, 1, 1), (1, 1, 1)):
                        if group == 1 and (store_tma or ws):
                            continue
                        variants.append((bm, bn, bk, st, wa, group, dev_desc, store_tma, ws))
            variants += [(64, 256, 128, 4, 8, 8, 1, 1, 0), (64, 256, 128, 3, 8, 4, 0, 1, 0), (64, 256, 128, 3, 8, 16, 0, 1, 0),
                         (64, 256, 256, 2, 8, 8, 0, 1, 0), (128, 256, 128, 2, 8, 8, 0, 1, 0), (32, 256, 128, 5, 8, 8, 0, 1, 0)]
            for v in variants:
                bm, bn, bk, st, wa, group, dev_desc, store_tma, ws = v
                dw2_ = torch.zeros_like(dw)
                rec(f"{bm}x{bn}x{bk} s{st} w{wa} g{group} dev{dev_desc} tmastore{store_tma} ws{ws}",
                    lambda: dw2(dy, x, dw2_, m_sizes, m_ends, bm, bn, bk, st, wa, group, bool(dev_desc), bool(store_tma), bool(ws)), dw2_)
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
