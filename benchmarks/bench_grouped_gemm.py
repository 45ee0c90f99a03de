"""Grouped GEMM benchmark: ep_moe's fused Triton kernels against torch._grouped_mm and a
per-expert loop, on the MoE shapes of ANCHORS.md, in one run on one GPU.

For each shape, both expert projections at T tokens (M = T*k routed rows):
  gate_up  [M, H] -> [M, 2I]: ours gathers token rows in the kernel; _grouped_mm reads a
           pre-permuted copy (timed without and with the permutation copy).
  down     [M, I] -> [M, H]: ours scatters to token-slot order and multiplies the top-k
           weight in the epilogue; _grouped_mm is followed by the unpermute and the multiply.
FLOPs: forward 2*M*N*K; forward+backward 3x that. Everything is validated against
_grouped_mm before it is timed. Forward+backward returns the gradients (``torch.autograd.grad``)
as a training step's first backward after ``zero_grad`` does: no add into a held ``.grad``.
Each cell is the median of --rounds rounds over the variants in turn (every round's time kept in
the results): whole runs of this script on one GPU differed by up to 18% on a cell as the clocks
moved, where a ratio within one interleaved run holds.

--bias also times ours with a per-expert bias (nn.Linear's: added in the forward's
epilogue; its gradient in the dW kernel's pass, its share of the top-k weights' gradient
in the dX kernel's) against ours without, on the same inputs, interleaved (A B A B), each
forward+backward with a top-k weight gradient as in training; the two runs of each give
the noise to read the ratio against.

--fp8 also times the FP8 (e4m3) path (``ep_moe.kernels.fp8.grouped_gemm_fp8``: the rows quantized
in the gather, forward and dX on FP8 tensor cores, dW bf16) against bf16 ``_grouped_mm`` and against
``torch._scaled_grouped_mm`` (rowwise e4m3, fast accumulation) with the rows quantized in separate
eager passes; weights are quantized once outside the timing for both (once per optimizer step);
and against torchao's FP8 MoE training GEMM where torchao imports (its own quantization, weights
included, in every call; groups padded to 16 rows as it requires).
The down projection runs on sorted rows there (no scatter or top-k weight).

    python benchmarks/bench_grouped_gemm.py [--tokens 8192] [--shapes all] [--rounds 3] [--sweep] [--bias] [--fp8]
    python benchmarks/bench_grouped_gemm.py --fp8 --sweep --sweep-passes forward,dx   # FP8 configs too
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SHAPES, bench_ms, environment, random_routing, save_results  # noqa: E402

from ep_moe import GemmConfigs, KernelConfig, grouped_gemm  # noqa: E402
from ep_moe.kernels.grouped_gemm import launch_dw, launch_rows  # noqa: E402
from ep_moe.kernels.permute import launch_gather_rows  # noqa: E402


def matmul_ceiling() -> float:
    """Measured dense bf16 matmul rate (TFLOP/s), 8192^3 on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench_ms(lambda: a @ b) / 1e9


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def grouped_mm(x, w, offsets):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def projection_problem(shape, projection, tokens, dtype=torch.bfloat16):
    """Inputs of one projection: x, w [E, N, K], m_sizes, offsets, gather, scatter, rw."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    m_sizes, gather, scatter = random_routing(tokens, shape.num_experts, shape.top_k, "cuda", gen)
    h, i = shape.hidden, shape.intermediate
    n, k = (2 * i, h) if projection == "gate_up" else (h, i)
    rows_x = tokens if projection == "gate_up" else tokens * shape.top_k
    x = torch.randn(rows_x, k, device="cuda", dtype=dtype)
    w = torch.randn(shape.num_experts, n, k, device="cuda", dtype=dtype) / k**0.5
    rw = torch.rand(tokens * shape.top_k, device="cuda", dtype=torch.float32)
    bias = torch.randn(shape.num_experts, n, device="cuda", dtype=dtype) * 0.1
    offsets = torch.cumsum(m_sizes, 0, dtype=torch.int32)
    return dict(x=x, w=w, m_sizes=m_sizes, offsets=offsets, gather=gather, scatter=scatter, rw=rw, bias=bias,
                n=n, k=k, rows=tokens * shape.top_k)


def time_projection(p, projection, configs, num_rounds: int = 3):
    """({variant: ms}, {variant: [ms of each round]}, error against ``_grouped_mm``) for forward
    and forward+backward of one projection: ``num_rounds`` rounds over the variants in turn,
    the median of each variant's rounds."""
    x, w, m_sizes, offsets = p["x"], p["w"], p["m_sizes"], p["offsets"]
    g, s, rw = p["gather"], p["scatter"], p["rw"]
    if projection == "gate_up":
        ours_kw = dict(gather_index=g)
        x_sorted = x[g.long()]

        def baseline(xx, ww, permute):
            return grouped_mm(xx[g.long()] if permute else xx, ww, offsets)
    else:
        ours_kw = dict(scatter_index=s, row_weights=rw)
        x_sorted = x
        unpermute = torch.empty_like(s, dtype=torch.long)
        unpermute[s.long()] = torch.arange(s.numel(), device="cuda")

        def baseline(xx, ww, permute):
            y = grouped_mm(xx, ww, offsets)
            return (y[unpermute] * rw[:, None]).to(y.dtype) if permute else y

    def ours(xx, ww):
        return grouped_gemm(xx, ww, m_sizes, configs=configs, **ours_kw)

    # Validate before timing.
    ref = baseline(x_sorted if projection == "gate_up" else x, w, permute=projection == "down")
    err = rel_err(ours(x, w), ref)
    assert err < 2e-2, f"{projection}: ours differs from _grouped_mm by {err:.2e}"

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    xsg = x_sorted.clone().requires_grad_()
    dy = torch.randn(p["rows"], p["n"], device="cuda", dtype=x.dtype)

    def fwd_bwd(fn, leaves):
        def run():
            torch.autograd.grad(fn(), leaves, dy)
        return run

    loop_sizes = m_sizes.tolist()
    loop_x = torch.split(x_sorted, loop_sizes)
    variants = {
        "ours_fwd": lambda: ours(x, w),
        "gmm_fwd": lambda: baseline(x_sorted, w, permute=False),
        "gmm_perm_fwd": lambda: baseline(x, w, permute=True),
        "loop_fwd": lambda: [xe @ we.t() for xe, we in zip(loop_x, w)],
        "ours_fwdbwd": fwd_bwd(lambda: ours(xg, wg), (xg, wg)),
        "gmm_fwdbwd": fwd_bwd(lambda: baseline(xsg, wg, permute=False), (xsg, wg)),
        "gmm_perm_fwdbwd": fwd_bwd(lambda: baseline(xg, wg, permute=True), (xg, wg)),
    }
    rounds = {name: [] for name in variants}
    for _ in range(num_rounds):  # interleaved: a drift of the GPU's clocks hits every variant alike
        for name, fn in variants.items():
            rounds[name].append(bench_ms(fn))
    return {name: statistics.median(times) for name, times in rounds.items()}, rounds, err


def time_bias(p, projection, configs):
    """{variant: ms}: ours without and with a bias, forward and forward+backward (x, w, the
    bias and, for down, the top-k weights get gradients), each timed twice, interleaved."""
    x, w, m_sizes, bias = p["x"], p["w"], p["m_sizes"], p["bias"]
    down = projection == "down"
    kw = dict(scatter_index=p["scatter"], row_weights=p["rw"]) if down else dict(gather_index=p["gather"])
    # Validate before timing: the bias of each routed row's expert, added before the top-k weight.
    rows_expert = torch.repeat_interleave(torch.arange(w.shape[0], device="cuda"), m_sizes.long())
    plain = grouped_gemm(x, w, m_sizes, configs=configs, **{k: v for k, v in kw.items() if k != "row_weights"})
    if down:
        want = torch.empty_like(plain, dtype=torch.float32)
        want[p["scatter"].long()] = bias.float()[rows_expert]
        want = (plain.float() + want) * p["rw"][:, None]
    else:
        want = plain.float() + bias.float()[rows_expert]
    err = rel_err(grouped_gemm(x, w, m_sizes, bias=bias, configs=configs, **kw), want)
    assert err < 2e-2, f"{projection} with bias: differs from ours without plus the bias by {err:.2e}"

    leaves = dict(x=x.clone().requires_grad_(), w=w.clone().requires_grad_(), bias=bias.clone().requires_grad_())
    grad_kw = dict(kw, row_weights=p["rw"].clone().requires_grad_()) if down else kw
    dy = torch.randn(p["rows"], p["n"], device="cuda", dtype=x.dtype)

    def fwdbwd(with_bias):
        def run():
            y = grouped_gemm(leaves["x"], leaves["w"], m_sizes, bias=leaves["bias"] if with_bias else None,
                             configs=configs, **grad_kw)
            wanted = [leaves["x"], leaves["w"]] + ([leaves["bias"]] if with_bias else [])
            torch.autograd.grad(y, wanted + ([grad_kw["row_weights"]] if down else []), dy)
        return run

    variants = {
        "ours_fwd": lambda: grouped_gemm(x, w, m_sizes, configs=configs, **kw),
        "ours_bias_fwd": lambda: grouped_gemm(x, w, m_sizes, bias=bias, configs=configs, **kw),
        "ours_fwdbwd": fwdbwd(False),
        "ours_bias_fwdbwd": fwdbwd(True),
    }
    runs = {name: [] for name in variants}
    for _ in range(2):  # A B A B: drift hits both alike, and the repeat is the noise
        for name, fn in variants.items():
            runs[name].append(bench_ms(fn))
    return {name: sum(ms) / 2 for name, ms in runs.items()}, {name: ms for name, ms in runs.items()}


SWEEP_ROWS = [
    KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_SIZE_M=8, num_warps=w, num_stages=st, use_tma=tma)
    for (bm, bn, bk, w, st), tma in itertools.product(
        [(128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
         (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 4, 4)],
        [False, True])
]
SWEEP_DW = [
    KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, use_tma=tma)
    for (bm, bn, bk, w, st), tma in itertools.product(
        [(64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (32, 128, 128, 4, 4), (64, 128, 256, 8, 3),
         (128, 128, 128, 8, 3), (64, 256, 128, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4),
         (64, 256, 128, 8, 4), (128, 256, 128, 8, 3), (64, 256, 256, 8, 3)],
        [False, True])
]


def time_fp8(p, projection):
    """{variant: ms} of the FP8 path and the peers, and its error against bf16 _grouped_mm."""
    from ep_moe.kernels.e4m3 import quantize_rows_reference
    from ep_moe.kernels.fp8 import grouped_gemm_fp8, quantized_weight

    x, w, m_sizes, offsets, g = p["x"], p["w"], p["m_sizes"], p["offsets"], p["gather"]
    gather = g if projection == "gate_up" else None
    x_sorted = x[g.long()] if projection == "gate_up" else x
    quantized_weight(w)  # once per step, as in training

    def ours():
        return grouped_gemm_fp8(x, w, m_sizes, gather_index=gather)

    w_q, w_scale = quantize_rows_reference(w)
    w_q_t = w_q.transpose(-2, -1)  # [E, K, N] column-major, as _scaled_grouped_mm takes it

    def scaled_gmm(a_q, a_scale):
        return torch._scaled_grouped_mm(a_q, w_q_t, a_scale, w_scale, offs=offsets, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    def peer_with_quantization():  # the permutation copy, then a rowwise quantization in eager ops
        return scaled_gmm(*quantize_rows_reference(x[g.long()] if projection == "gate_up" else x))

    ref = grouped_mm(x_sorted, w, offsets)
    err = rel_err(ours(), ref)
    assert err < 6e-2, f"{projection}: FP8 differs from bf16 _grouped_mm by {err:.2e}"
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    quantized_weight(wg)
    dy = torch.randn(p["rows"], p["n"], device="cuda", dtype=x.dtype)
    ms = {"fp8_fwd": bench_ms(ours),
          "fp8_fwdbwd": bench_ms(lambda: torch.autograd.grad(grouped_gemm_fp8(xg, wg, m_sizes, gather_index=gather),
                                                             (xg, wg), dy))}
    a_q, a_scale = quantize_rows_reference(x_sorted)
    try:
        peer_err = rel_err(scaled_gmm(a_q, a_scale), ref)
        ms["scaled_gmm_fwd"] = bench_ms(lambda: scaled_gmm(a_q, a_scale))
        ms["scaled_gmm_quant_fwd"] = bench_ms(peer_with_quantization)
    except (RuntimeError, TypeError) as exc:  # not in every torch build
        print(f"  torch._scaled_grouped_mm unavailable: {exc}", flush=True)
        peer_err = None
    ms.update(time_torchao_fp8(p, x_sorted, dy))
    return ms, err, peer_err


def time_torchao_fp8(p, x_sorted, dy) -> dict[str, float]:
    """torchao's FP8 MoE training GEMM (``torchao.prototype.moe_training``: rowwise e4m3 in the
    forward and dX, per (group, column) scales in the dW, each call quantizing both operands,
    the weight included), forward and forward+backward, where torchao imports; {} otherwise. It
    takes groups of a multiple of 16 rows, so each expert's rows are padded up to one (up to 15
    more rows per expert than ours run)."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as peer
    except Exception as exc:  # not installed, or built for another torch
        print(f"  torchao's FP8 grouped GEMM unavailable: {type(exc).__name__}: {exc}", flush=True)
        return {}
    m_sizes = p["m_sizes"]
    padded = (m_sizes + 15) // 16 * 16
    ends = torch.cumsum(m_sizes, 0)
    rows = torch.cat([torch.arange(e - m, e + pm - m, device="cuda").clamp_max(e - 1) if m else
                      torch.zeros(0, dtype=torch.long, device="cuda")
                      for m, pm, e in zip(m_sizes.tolist(), padded.tolist(), ends.tolist())])
    a = x_sorted[rows].clone().requires_grad_()  # each group's last row repeated into its padding
    w = p["w"].clone().requires_grad_()
    offs = torch.cumsum(padded, 0, dtype=torch.int32)
    dy_padded = dy[rows]

    def forward():
        return peer(a, w.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False)

    try:
        return {"torchao_fwd": bench_ms(forward),
                "torchao_fwdbwd": bench_ms(lambda: torch.autograd.grad(forward(), (a, w), dy_padded))}
    except Exception as exc:  # a prototype: an API that moved is reported, not fatal
        print(f"  torchao's FP8 grouped GEMM failed: {type(exc).__name__}: {exc}", flush=True)
        return {}


SWEEP_FP8 = [
    KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_SIZE_M=8, num_warps=w, num_stages=st, use_tma=True)
    for bm, bn, bk, w, st in [(128, 256, 128, 8, 3), (128, 128, 128, 4, 4), (128, 128, 128, 8, 4),
                              (128, 128, 256, 8, 3), (64, 128, 128, 4, 5), (64, 256, 128, 4, 4),
                              (128, 256, 64, 8, 4), (128, 128, 64, 4, 5), (256, 128, 128, 8, 3)]
]
"""FP8 forward and dX candidates (one e4m3 byte per value: a 128-wide K step reads 128-byte rows)."""


def time_candidates(name: str, run, candidates, same_result=None) -> list:
    """[(ms, cfg)], fastest first, of ``run(cfg)`` for each candidate; one that fails to build or
    launch (out of resources, a compile failure), or whose ``same_result(cfg)`` is false, is
    skipped and said so."""
    timings = []
    for cfg in candidates:
        try:
            if same_result is not None and not same_result(cfg):
                print(f"  skip {name} {cfg.short()}: its result differs", flush=True)
                continue
            timings.append((bench_ms(lambda: run(cfg), warmup_ms=10, rep_ms=40), cfg))
        except Exception as exc:
            print(f"  skip {name} {cfg.short()}: {type(exc).__name__}", flush=True)
    return sorted(timings, key=lambda t: t[0])


def sweep_fp8(p, projection, which):
    """Each FP8 candidate as the forward's config (forward timed, the row quantization
    included) and as the dX's (forward+backward timed, the other passes at their defaults);
    validated against the default configs' output first. {pass: [(ms, cfg)]}."""
    from ep_moe.kernels.fp8 import fp8_gemm_configs, grouped_gemm_fp8, quantized_weight

    x, w, m_sizes = p["x"], p["w"], p["m_sizes"]
    kw = dict(gather_index=p["gather"]) if projection == "gate_up" else dict(scatter_index=p["scatter"],
                                                                               row_weights=p["rw"])
    default = fp8_gemm_configs(x.device, x.dtype)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    quantized_weight(w), quantized_weight(wg)
    dy = torch.randn(p["rows"], p["n"], device=x.device, dtype=x.dtype)
    runs = {"forward": lambda c: grouped_gemm_fp8(x, w, m_sizes, configs=(c, default.dx, default.dw), **kw),
            "dx": lambda c: torch.autograd.grad(grouped_gemm_fp8(xg, wg, m_sizes, configs=(default.forward, c,
                                                                                           default.dw), **kw),
                                                (xg, wg), dy)}
    results = {}
    for name, run in runs.items():
        if name not in which:
            continue
        first = (lambda out: out if name == "forward" else out[0])  # the output, or dX
        ref = first(run(default.forward if name == "forward" else default.dx))
        # the same FP8 operands: a candidate differs by its accumulation order only
        results[name] = time_candidates(f"fp8 {name}", run, SWEEP_FP8,
                                        lambda cfg: rel_err(first(run(cfg)), ref) <= 1e-2)
    return results


def fp8_default_ms(timings, which: str, like: torch.Tensor) -> str:
    """The default FP8 config's time among ``timings`` ([(ms, cfg)]), or where it is not one."""
    from ep_moe.kernels.fp8 import fp8_gemm_configs

    default = getattr(fp8_gemm_configs(like.device, like.dtype), which)
    return next((f"{ms:.3f} ms" for ms, c in timings if c == default), f"{default.short()} not in the grid")


def sweep(p, projection, which):
    """Time every sweep candidate for each pass of one projection; {pass: [(ms, cfg)]}."""
    x, w, m_sizes = p["x"], p["w"], p["m_sizes"]
    g, s, rw = p["gather"], p["scatter"], p["rw"]
    rows, n, k = p["rows"], p["n"], p["k"]
    out = torch.empty(rows, n, device="cuda", dtype=x.dtype)
    dy = torch.randn(rows, n, device="cuda", dtype=x.dtype)
    dx = torch.empty(rows, k, device="cuda", dtype=x.dtype)
    dw = torch.empty_like(w)
    x_rows = launch_gather_rows(x, g) if projection == "gate_up" else x
    dy_rows = launch_gather_rows(dy, s, rw)
    if projection == "gate_up":
        position = torch.randperm(rows, device="cuda").to(torch.int32)
        passes = {
            "forward": lambda c: launch_rows(x, w, out, m_sizes, c, transpose_w=True, load_idx=g),
            "dx": lambda c: launch_rows(dy, w, dx, m_sizes, c, transpose_w=False, store_idx=position),
            "dw": lambda c: launch_dw(dy, x_rows, dw, m_sizes, c),
        }
    else:
        passes = {
            "forward": lambda c: launch_rows(x, w, out, m_sizes, c, transpose_w=True, store_idx=s, scale=rw),
            "dx": lambda c: launch_rows(dy, w, dx, m_sizes, c, transpose_w=False, load_idx=s, scale=rw,
                                        scale_by_load_row=True, dot_with=x),
            "dw": lambda c: launch_dw(dy_rows, x, dw, m_sizes, c),
        }
    return {name: time_candidates(name, run, SWEEP_DW if name == "dw" else SWEEP_ROWS)
            for name, run in passes.items() if name in which}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shapes", default="all", help="comma-separated names, or 'all'")
    parser.add_argument("--projections", default="gate_up,down")
    parser.add_argument("--sweep", action="store_true",
                        help="time a grid of configs per pass (with --fp8: the FP8 forward's and dX's too)")
    parser.add_argument("--sweep-passes", default="forward,dx,dw")
    parser.add_argument("--bias", action="store_true", help="also time ours with a per-expert bias against without")
    parser.add_argument("--fp8", action="store_true", help="also time the FP8 path and torch._scaled_grouped_mm")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over the variants in turn, the median of each (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    env = environment()
    ceiling = matmul_ceiling()
    print(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}; "
          f"dense bf16 matmul {ceiling:.0f} TFLOP/s", flush=True)
    configs = GemmConfigs()
    rows, sweeps = [], {}
    for name in names:
        shape = SHAPES[name]
        for projection in args.projections.split(","):
            p = projection_problem(shape, projection, args.tokens)
            flops = 2 * p["rows"] * p["n"] * p["k"]
            if args.sweep:
                res = sweep(p, projection, args.sweep_passes.split(","))
                sweeps[f"{name}/{projection}"] = {
                    k: [(round(ms, 4), c.short()) for ms, c in v[:5]] for k, v in res.items()}
                for k, v in res.items():
                    best = v[0]
                    print(f"  sweep {name:16s} {projection:7s} {k:7s} best {best[0]:.3f} ms "
                          f"{flops / best[0] / 1e9:.0f} TFLOP/s  {best[1].short()}", flush=True)
                if args.fp8:
                    res = sweep_fp8(p, projection, args.sweep_passes.split(","))
                    sweeps[f"{name}/{projection}/fp8"] = {
                        k: [(round(ms, 4), c.short()) for ms, c in v[:5]] for k, v in res.items()}
                    for k, v in res.items():
                        print(f"  sweep {name:16s} {projection:7s} fp8 {k:7s} best {v[0][0]:.3f} ms  "
                              f"{v[0][1].short()} (of {len(v)}; the default "
                              f"{fp8_default_ms(v, k, p['x'])})" if v else f"  sweep fp8 {k}: no candidate ran",
                              flush=True)
            ms, ms_rounds, err = time_projection(p, projection, configs, args.rounds)
            row = dict(shape=name, projection=projection, rows=p["rows"], n=p["n"], k=p["k"],
                       flops_fwd=flops, err_vs_grouped_mm=err, ms=ms, ms_rounds=ms_rounds)
            if args.bias:
                bias_ms, repeats = time_bias(p, projection, configs)
                row["bias_ms"], row["bias_repeats_ms"] = bias_ms, repeats
                noise = max(abs(a - b) / min(a, b) for a, b in repeats.values())
                print(f"{name:16s} {projection:7s} bias/no bias: fwd {bias_ms['ours_bias_fwd']:.3f} / "
                      f"{bias_ms['ours_fwd']:.3f} ms = {bias_ms['ours_bias_fwd'] / bias_ms['ours_fwd']:.3f}x, "
                      f"fwd+bwd {bias_ms['ours_bias_fwdbwd']:.3f} / {bias_ms['ours_fwdbwd']:.3f} ms = "
                      f"{bias_ms['ours_bias_fwdbwd'] / bias_ms['ours_fwdbwd']:.3f}x (repeat noise up to "
                      f"{noise:.1%})", flush=True)
            if args.fp8:
                fp8_ms, fp8_err, peer_err = time_fp8(p, projection)
                row.update(fp8_ms=fp8_ms, fp8_err_vs_grouped_mm=fp8_err, scaled_gmm_err_vs_grouped_mm=peer_err)
                peer = (f" | scaled_gmm {fp8_ms['scaled_gmm_fwd']:.3f} ms alone, "
                        f"{fp8_ms['scaled_gmm_quant_fwd']:.3f} with its quantization" if peer_err is not None else "")
                if "torchao_fwd" in fp8_ms:
                    peer += (f" | torchao fwd {fp8_ms['torchao_fwd']:.3f} fwd+bwd {fp8_ms['torchao_fwdbwd']:.3f} ms "
                             "(groups padded to 16)")
                print(f"{name:16s} {projection:7s} FP8 fwd {fp8_ms['fp8_fwd']:.3f} ms "
                      f"({flops / fp8_ms['fp8_fwd'] / 1e9:.0f} TF/s, {ms['gmm_fwd'] / fp8_ms['fp8_fwd']:.2f}x bf16 gmm) "
                      f"fwd+bwd {fp8_ms['fp8_fwdbwd']:.3f} ms ({ms['gmm_fwdbwd'] / fp8_ms['fp8_fwdbwd']:.2f}x) "
                      f"err {fp8_err:.2e}{peer}", flush=True)
            rows.append(row)
            print(f"{name:16s} {projection:7s} fwd ours {ms['ours_fwd']:.3f} ms "
                  f"({flops / ms['ours_fwd'] / 1e9:.0f} TF/s) gmm {ms['gmm_fwd']:.3f} "
                  f"(+perm {ms['gmm_perm_fwd']:.3f}) loop {ms['loop_fwd']:.3f} | fwd+bwd ours "
                  f"{ms['ours_fwdbwd']:.3f} ({3 * flops / ms['ours_fwdbwd'] / 1e9:.0f} TF/s) gmm "
                  f"{ms['gmm_fwdbwd']:.3f} (+perm {ms['gmm_perm_fwdbwd']:.3f}) | "
                  f"ratio fwd {ms['gmm_fwd'] / ms['ours_fwd']:.2f} fwdbwd "
                  f"{ms['gmm_fwdbwd'] / ms['ours_fwdbwd']:.2f}", flush=True)
            del p
            torch.cuda.empty_cache()
    out = args.out or REPO / "benchmarks" / "results" / (
        f"grouped_gemm{'_bias' if args.bias else ''}{'_fp8' if args.fp8 else ''}_{env['device'].replace(' ', '_')}_x1.json")
    save_results(out, {"tokens": args.tokens, "matmul_tflops": ceiling, "bias": args.bias, "fp8": args.fp8,
                       "rounds": args.rounds,
                       "configs": {k: v.to_dict() for k, v in vars(configs).items()},
                       "results": rows, "sweeps": sweeps})
    print(json.dumps({"saved": str(out)}))


if __name__ == "__main__":
    main()
