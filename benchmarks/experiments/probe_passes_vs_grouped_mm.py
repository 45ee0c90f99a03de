"""Each pass of the grouped GEMM alone against ``torch._grouped_mm``, one GPU: forward
(``x @ w[e]^T``), dX (``dy @ w[e]``) and dW (``dy^T @ x``) on contiguous expert-ordered rows
of the benchmark shapes (uniform routing, 8192 tokens), ep_moe's kernels with their default
configs; and two experimental kernels beside them: a rows kernel whose A tiles come through
a device-side TMA descriptor per tile (zero fill past the expert's rows) with the weight
through a host descriptor, and a dW kernel with one zero-filled loop per tile (device-side
descriptors) instead of TMA steps and a masked tail; each with and without warp
specialization of its reduction loop.

What it showed (``benchmarks/PERFORMANCE_LOG.md``, 2026-11-30): forward and dX at par with
``_grouped_mm`` on these rows (0.91-1.02x, DeepSeek-V3's down forward the lowest), the dW
0.82-1.02x (the lever taken then); the experimental rows kernel 1.03-1.08x ours where A is
contiguous (the down projection's forward, the gate_up's dX) on all but Qwen3's down forward
(0.96x); warp specialization nothing consistent.

    python benchmarks/experiments/probe_passes_vs_grouped_mm.py [--shapes ...] [--out passes.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SHAPES, random_routing  # noqa: E402

from ep_moe.kernels import grouped_gemm as gg  # noqa: E402
from ep_moe.kernels.config import DEFAULT_CONFIGS, KernelConfig  # noqa: E402


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


@triton.jit
def _dw_exp(dy_ptr, x_ptr, dw_ptr, m_sizes_ptr, m_ends_ptr, E, N, K, stride_dym, stride_xm, stride_we, stride_wn,
            TILE_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            DESC: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_e = num_n * num_k
    for tile in range(tl.program_id(0), E * per_e, TILE_STRIDE):
        e = tile // per_e
        pid_n = (tile % per_e) // num_k
        pid_k = tile % num_k
        m_e = tl.load(m_sizes_ptr + e)
        seg = tl.load(m_ends_ptr + e) - m_e
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        if DESC:
            dy_d = tl.make_tensor_descriptor(dy_ptr + tl.cast(seg, tl.int64) * stride_dym, shape=[tl.maximum(m_e, 1), N],
                                             strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_N])
            x_d = tl.make_tensor_descriptor(x_ptr + tl.cast(seg, tl.int64) * stride_xm, shape=[tl.maximum(m_e, 1), K],
                                            strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
            for mi in tl.range(0, tl.cdiv(m_e, BLOCK_M), num_stages=STAGES, warp_specialize=WS):
                dy = dy_d.load([mi * BLOCK_M, pid_n * BLOCK_N])
                x = x_d.load([mi * BLOCK_M, pid_k * BLOCK_K])
                acc = tl.dot(tl.trans(dy), x, acc)
        else:
            rows = tl.cast(seg, tl.int64) + offs_m
            dy_p = dy_ptr + rows[:, None] * stride_dym + offs_n[None, :]
            x_p = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
            for mi in tl.range(0, tl.cdiv(m_e, BLOCK_M), num_stages=STAGES, warp_specialize=WS):
                ok = offs_m < m_e - mi * BLOCK_M
                dy = tl.load(dy_p, mask=ok[:, None], other=0.0)
                x = tl.load(x_p, mask=ok[:, None], other=0.0)
                acc = tl.dot(tl.trans(dy), x, acc)
                dy_p += BLOCK_M * stride_dym
                x_p += BLOCK_M * stride_xm
        ptrs = dw_ptr + tl.cast(e, tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
        tl.store(ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


def dw_exp(dy, x, dw, m_sizes, m_ends, bm, bn, bk, desc, ws, stages, warps):
    E, N, K = dw.shape
    tiles = E * triton.cdiv(N, bn) * triton.cdiv(K, bk)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(sms, tiles),)
    _dw_exp[grid](dy, x, dw, m_sizes, m_ends, E, N, K, dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1),
                  TILE_STRIDE=grid[0], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DESC=desc, WS=ws, STAGES=stages,
                  num_warps=warps)


# rows kernel, contiguous A (expert-ordered rows), B = w[e] (dX) or w[e]^T (forward) through a 3D host
# descriptor; A through a per-tile device descriptor (zero fill past the segment); one loop per tile
@triton.jit
def _rows_exp(a_ptr, b_desc, out_ptr, m_sizes_ptr, E, N, K, stride_am, stride_om,
              TILE_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_SIZE_M: tl.constexpr, B_T: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    before = 0
    seg = 0
    for e in range(E):
        m_e = tl.load(m_sizes_ptr + e)
        num_m = tl.cdiv(m_e, BLOCK_M)
        tiles_e = num_m * num_n
        while tile < before + tiles_e:
            a_d = tl.make_tensor_descriptor(a_ptr + tl.cast(seg, tl.int64) * stride_am, shape=[tl.maximum(m_e, 1), K],
                                            strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
            pid_m, pid_n = gg._tile_coords(tile - before, num_m, num_n, GROUP_SIZE_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES, warp_specialize=WS):
                a = a_d.load([pid_m * BLOCK_M, ki * BLOCK_K])
                if B_T:
                    b = tl.trans(tl.reshape(b_desc.load([e, pid_n * BLOCK_N, ki * BLOCK_K]), (BLOCK_N, BLOCK_K)))
                else:
                    b = tl.reshape(b_desc.load([e, ki * BLOCK_K, pid_n * BLOCK_N]), (BLOCK_K, BLOCK_N))
                acc = tl.dot(a, b, acc)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ptrs = out_ptr + (seg + offs_m.to(tl.int64))[:, None] * stride_om + offs_n[None, :]
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < m_e) & (offs_n[None, :] < N))
            tile += TILE_STRIDE
        before += tiles_e
        seg += m_e


def rows_exp(a, w, out, m_sizes, transpose_w, bm, bn, bk, ws, stages, warps, group=8):
    from triton.tools.tensor_descriptor import TensorDescriptor
    E, wn, wk = w.shape
    n_out, k_red = (wn, wk) if transpose_w else (wk, wn)
    block = [1, bn, bk] if transpose_w else [1, bk, bn]
    b_desc = TensorDescriptor.from_tensor(w, block)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = (triton.cdiv(a.shape[0], bm) + E) * triton.cdiv(n_out, bn)
    grid = (min(sms, tiles),)
    _rows_exp[grid](a, b_desc, out, m_sizes, E, n_out, k_red, a.stride(0), out.stride(0), TILE_STRIDE=grid[0],
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_SIZE_M=group, B_T=transpose_w, WS=ws, STAGES=stages,
                    num_warps=warps)


def err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b,gpt-oss-20b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("passes.json"))
    args = parser.parse_args()
    # device-side descriptors take their 128 bytes from this allocator
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    tokens, shapes = args.tokens, args.shapes.split(",")
    results = {}
    dense_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    cap = 2 * 8192**3 / bench(lambda: dense_a @ dense_a) / 1e9
    print(f"dense bf16 matmul {cap:.0f} TF/s", flush=True)
    results["dense_tflops"] = cap
    for name in shapes:
        s = SHAPES[name]
        m_sizes, _, _ = random_routing(tokens, s.num_experts, s.top_k, "cuda", torch.Generator(device="cuda").manual_seed(0))
        offs = torch.cumsum(m_sizes, 0, dtype=torch.int32)
        rows = tokens * s.top_k
        for proj in ("gate_up", "down"):
            n, k = (2 * s.intermediate, s.hidden) if proj == "gate_up" else (s.hidden, s.intermediate)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(s.num_experts, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            flops = 2 * rows * n * k
            key = f"{name} {proj}"
            res = results[key] = {}

            def rec(label, fn, ref=None, out=None):
                try:
                    fn()
                    torch.cuda.synchronize()
                    e = err(out, ref) if ref is not None else None
                    ms = bench(fn)
                    res[label] = dict(ms=ms, tflops=flops / ms / 1e9, err=e)
                    print(f"{key:24s} {label:36s} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TF/s"
                          + (f" err {e:.1e}" if e is not None else ""), flush=True)
                except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is a result
                    res[label] = dict(error=str(exc)[:300])
                    print(f"{key:24s} {label:36s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)

            # forward (x @ w[e]^T) and dX (dy @ w[e]): the rows kernel, w read transposed or as stored
            for name, a, out_cols, transpose_w in (("fwd", x, n, True), ("dx", dy, k, False)):
                ref = torch._grouped_mm(a, w.transpose(-2, -1) if transpose_w else w, offs=offs)
                rec(f"{name} grouped_mm",
                    lambda: torch._grouped_mm(a, w.transpose(-2, -1) if transpose_w else w, offs=offs))
                out = torch.empty(rows, out_cols, device="cuda", dtype=torch.bfloat16)
                config = DEFAULT_CONFIGS["forward" if transpose_w else "dx"]
                rec(f"{name} ours", lambda: gg.launch_rows(a, w, out, m_sizes, config, transpose_w=transpose_w),
                    ref, out)
                for ws in (False, True):
                    for bm, bn, bk, st, wa in ((128, 256, 64, 4, 8), (128, 128, 64, 4, 8)):
                        out2 = torch.zeros_like(out)
                        rec(f"{name} exp {bm}x{bn}x{bk} s{st} ws{int(ws)}",
                            lambda: rows_exp(a, w, out2, m_sizes, transpose_w, bm, bn, bk, ws, st, wa), ref, out2)
            # dW
            dw_ref = torch._grouped_mm(dy.t(), x, offs=offs)
            rec("dw grouped_mm", lambda: torch._grouped_mm(dy.t(), x, offs=offs))
            dw = torch.empty_like(w)
            rec("dw ours default", lambda: gg.launch_dw(dy, x, dw, m_sizes, DEFAULT_CONFIGS["dw"]), dw_ref, dw)
            for bm, bn, bk, st, wa in ((128, 256, 128, 2, 8), (64, 128, 256, 3, 8), (128, 128, 128, 3, 8)):
                cfg = KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=wa, num_stages=st, use_tma=True)
                rec(f"dw ours {cfg.short()}", lambda: gg.launch_dw(dy, x, dw, m_sizes, cfg), dw_ref, dw)
            m_ends = torch.cumsum(m_sizes, 0, dtype=torch.int32)
            for desc in (True, False):
                for ws in (False, True):
                    for bm, bn, bk, st, wa in ((64, 256, 128, 3, 8), (64, 256, 128, 4, 8), (128, 256, 128, 2, 8),
                                               (64, 128, 256, 3, 8)):
                        if ws and (bm, st) != (64, 3):
                            continue
                        dw2 = torch.zeros_like(w)
                        rec(f"dw exp desc{int(desc)} ws{int(ws)} {bm}x{bn}x{bk} s{st}",
                            lambda: dw_exp(dy, x, dw2, m_sizes, m_ends, bm, bn, bk, desc, ws, st, wa), dw_ref, dw2)
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
