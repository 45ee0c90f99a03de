"""The FP8 (e4m3) weight gradient of the grouped GEMM: ``dW[e] = dy_rows[e]^T @ x_rows[e]``
over each expert's rows, on FP8 tensor cores.

The reduction runs over rows, so the rows' own scales (one per row, the forward's) cannot
leave the sum. Both operands are scaled per (expert, column) instead, over the expert's rows:
``dW[e, n, k] = s_dy[e, n] * s_x[e, k] * sum_r q_dy[r, n] * q_x[r, k]``, the scales applied
in the epilogue as the forward's are. The quantization reads the rows where they are (x
through the permutation's gather, dy through the scatter and times its row weights, as the
bf16 dW's row gathers do) and writes them transposed, each expert's rows padded with zeros
to whole ``BLOCK_M`` blocks: the row dim contiguous, as the FP8 tensor cores read both
operands of a reduction over rows, and no row masks in the GEMM's loop.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ep_moe.kernels.config import KernelConfig
from ep_moe.kernels.e4m3 import E4M3, E4M3_MAX, MIN_AMAX, on_e4m3_grid, scale_of
from ep_moe.kernels.grouped_gemm import cdiv


@triton.jit
def _expert_block(block_ends_ptr, m_sizes_ptr, m_ends_ptr, num_experts, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    """Padded block ``program_id(0)``'s expert ``e`` (``num_experts`` past the last block), the
    expert's first row and its rows in this block (``rows_local``, the block's rows counted
    from the expert's first, valid below ``m_e``)."""
    b = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(block_ends_ptr + experts, mask=experts < num_experts, other=2147483647)
    e = tl.sum((ends <= b).to(tl.int32))
    e_safe = tl.minimum(e, num_experts - 1)
    m_e = tl.load(m_sizes_ptr + e_safe)
    first_block = tl.load(block_ends_ptr + e_safe) - tl.cdiv(m_e, BLOCK_M)
    rows_local = (b - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, tl.load(m_ends_ptr + e_safe) - m_e, m_e, rows_local


@triton.jit
def _expert_rows_tile(src_ptr, idx_ptr, rw_ptr, seg_start, rows_local, m_e, cols, C, stride_sm,
                      GATHER: tl.constexpr, WEIGHTED: tl.constexpr):
    """The [BLOCK_M, BLOCK_C] tile of expert-ordered rows (``src[idx[r]] * rw[idx[r]]``), fp32,
    0 outside the expert's rows and past ``C``."""
    row_ok = rows_local < m_e
    rows = seg_start + rows_local
    if GATHER:
        src_rows = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src_rows = rows.to(tl.int64)
    ok = row_ok[:, None] & (cols < C)[None, :]
    v = tl.load(src_ptr + src_rows[:, None] * stride_sm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if WEIGHTED:
        v = v * tl.load(rw_ptr + src_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    return v


# Pass 1 (not STORE): amax[e, c] = max over expert e's rows r of |src[g(r), c] * rw[g(r)]| (zeroed
#   first). Pass 2 (STORE): q_t[c, p] = e4m3(src[g(r), c] * rw[g(r)] / scale[e, c]) for the padded
#   position p of expert e's row r (0 for padding), scale from pass 1's maxima.
# Tiling: one program per (padded block of BLOCK_M rows, BLOCK_C columns); each block belongs to
#   one expert; pass 1's column maxima go to amax with atomic max (order-free: deterministic),
#   pass 2 stores its tile transposed (rows contiguous).
# Fuses: the gather, the row weights, the quantization and the transpose into one pass.
@triton.jit
def _expert_columns_kernel(src_ptr, idx_ptr, rw_ptr, block_ends_ptr, m_sizes_ptr, m_ends_ptr, amax_ptr, q_t_ptr,
                           num_experts, C, stride_sm, stride_qc, STORE: tl.constexpr, GATHER: tl.constexpr,
                           WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_E: tl.constexpr, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    e, seg_start, m_e, rows_local = _expert_block(block_ends_ptr, m_sizes_ptr, m_ends_ptr, num_experts,
                                                  BLOCK_M, BLOCK_E)
    if e < num_experts:
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        v = _expert_rows_tile(src_ptr, idx_ptr, rw_ptr, seg_start, rows_local, m_e, cols, C, stride_sm,
                              GATHER, WEIGHTED)
        amax_ptrs = amax_ptr + e.to(tl.int64) * C + cols
        if STORE:
            amax = tl.load(amax_ptrs, mask=cols < C, other=1.0)
            q = on_e4m3_grid(tl.math.div_rn(v, scale_of(amax, FP8_MAX, AMAX_FLOOR)[None, :]))
            positions = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(q_t_ptr + cols.to(tl.int64)[None, :] * stride_qc + positions[:, None],
                     q.to(q_t_ptr.dtype.element_ty), mask=(cols < C)[None, :])
        else:
            tl.atomic_max(amax_ptrs, tl.max(tl.abs(v), axis=0), mask=cols < C)


FP8_DOT_MIN_K = 32
"""The shortest reduction an FP8 ``tl.dot`` takes on NVIDIA GPUs: the dW's rows per step are a
multiple of it."""


class ExpertColumns:
    """Expert-ordered rows in e4m3, transposed and padded: ``values`` [C, blocks * BLOCK_M]
    (expert e's rows from padded block ``block_ends[e-1]`` on, zeros to its next block),
    ``scales`` [E, C] fp32 (per expert and column), ``block_ends`` [E] int32 (each expert's
    padded blocks, cumulated), ``m_ends`` [E] int32 (its rows, cumulated), ``block_m``."""

    __slots__ = ("values", "scales", "block_ends", "m_ends", "block_m")

    def __init__(self, values, scales, block_ends, m_ends, block_m):
        self.values, self.scales, self.block_ends = values, scales, block_ends
        self.m_ends, self.block_m = m_ends, block_m


def quantize_expert_columns(src: torch.Tensor, m_sizes: torch.Tensor, num_rows: int, block_m: int,
                            index: Optional[torch.Tensor] = None, row_weights: Optional[torch.Tensor] = None,
                            layout: Optional[ExpertColumns] = None) -> ExpertColumns:
    """The rows ``src[index[r]] * row_weights[index[r]]`` (``index`` None: ``src[r]``; no
    weights: 1) for the ``num_rows`` expert-ordered rows r (``m_sizes`` [E] int32 each;
    only the counted rows are read), in e4m3 per (expert, column): :class:`ExpertColumns`.
    ``layout``: the other operand's, of the same ``m_sizes`` and ``block_m`` (its cumulated
    blocks and rows are reused)."""
    num_experts, cols = m_sizes.shape[0], src.shape[1]
    src = src if src.stride(-1) == 1 else src.contiguous()
    if layout is None:
        block_ends = torch.cumsum((m_sizes + block_m - 1) // block_m, 0, dtype=torch.int32)
        m_ends = torch.cumsum(m_sizes, 0, dtype=torch.int32)
    else:
        block_ends, m_ends = layout.block_ends, layout.m_ends
    # no host sync: a bound of the blocks, not their count (each block of a counted expert
    # holds one of its rows at least, and the counts sum to num_rows at most)
    max_blocks = min(num_rows, cdiv(num_rows, block_m) + num_experts)
    amax = torch.zeros((num_experts, cols), device=src.device, dtype=torch.float32)
    values = torch.empty((cols, max_blocks * block_m), device=src.device, dtype=E4M3)
    if max_blocks and cols:
        block_c = 64  # 128 bytes of a bf16 row per load
        common = dict(GATHER=index is not None, WEIGHTED=row_weights is not None, BLOCK_M=block_m, BLOCK_C=block_c,
                      BLOCK_E=triton.next_power_of_2(num_experts), num_warps=8 if block_m >= 128 else 4)
        grid = (max_blocks, cdiv(cols, block_c))
        for store in (False, True):  # the maxima, then the values
            _expert_columns_kernel[grid](src, index, row_weights, block_ends, m_sizes, m_ends, amax, values,
                                         num_experts, cols, src.stride(0), values.stride(0), STORE=store,
                                         FP8_MAX=E4M3_MAX, AMAX_FLOOR=MIN_AMAX, **common)
    scales = amax.clamp_min_(MIN_AMAX).mul_(1.0 / E4M3_MAX)
    return ExpertColumns(values, scales, block_ends, m_ends, block_m)


# dW[e, n, k] = s_dy[e, n] * s_x[e, k] * sum over expert e's padded rows p of dy_t[n, p] * x_t[k, p]
#   (+ dW[e, n, k] with ACCUMULATE), from ExpertColumns of dy and x.
# Tiling: one program per (BLOCK_N x BLOCK_K tile of dW, expert), BLOCK_M padded rows a step
#   (whole blocks: no row masks), on FP8 tensor cores, promoted to fp32 every step.
# Fuses: both operands' scales into the epilogue, and the accumulation into an existing dW.
@triton.jit
def _fp8_dw_kernel(dy_t_ptr, x_t_ptr, dy_scale_ptr, x_scale_ptr, block_ends_ptr, dw_ptr, N, K,
                   stride_dyn, stride_xk, stride_we, stride_wn, stride_wk,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACCUMULATE: tl.constexpr):
    e = tl.program_id(1)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    offs_n = (tl.program_id(0) // num_k_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (tl.program_id(0) % num_k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    block_end = tl.load(block_ends_ptr + e)
    block_start = tl.load(block_ends_ptr + e - 1, mask=e > 0, other=0)
    offs_m = block_start.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    dy_ptrs = dy_t_ptr + offs_n.to(tl.int64)[:, None] * stride_dyn + offs_m[None, :]
    x_ptrs = x_t_ptr + offs_k.to(tl.int64)[:, None] * stride_xk + offs_m[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(block_start, block_end):
        dy = tl.load(dy_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
        # promoted to full fp32 every BLOCK_M rows: the FP8 tensor cores' own accumulation keeps
        # about 14 bits, and an expert's rows are unbounded (the forward's K is the model's width)
        acc = tl.dot(dy, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_M)
        dy_ptrs += BLOCK_M
        x_ptrs += BLOCK_M
    e64 = e.to(tl.int64)
    acc *= tl.load(dy_scale_ptr + e64 * N + offs_n, mask=n_ok, other=0.0)[:, None]
    acc *= tl.load(x_scale_ptr + e64 * K + offs_k, mask=k_ok, other=0.0)[None, :]
    dw_ptrs = dw_ptr + e64 * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    tile_ok = n_ok[:, None] & k_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(dw_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=tile_ok)


def launch_fp8_dw(dy: ExpertColumns, x: ExpertColumns, dw: torch.Tensor, config: KernelConfig,
                  accumulate: bool = False) -> None:
    """dW [E, N, K] (in its own dtype) from the :class:`ExpertColumns` of dy (N columns) and x
    (K columns), quantized with ``config.BLOCK_M``-row blocks; ``accumulate``: added to what
    ``dw`` holds."""
    num_experts, n, k = dw.shape
    if config.BLOCK_M % FP8_DOT_MIN_K:
        raise ValueError(f"launch_fp8_dw: config.BLOCK_M={config.BLOCK_M}, the rows of a step, must be a multiple of "
                         f"{FP8_DOT_MIN_K} (the FP8 tensor cores' smallest reduction)")
    if dy.block_m != config.BLOCK_M or x.block_m != config.BLOCK_M:
        raise ValueError(f"launch_fp8_dw: operands padded to {dy.block_m} and {x.block_m} rows, "
                         f"the config steps {config.BLOCK_M}")
    if num_experts == 0 or n == 0 or k == 0:
        return
    grid = (cdiv(n, config.BLOCK_N) * cdiv(k, config.BLOCK_K), num_experts)
    _fp8_dw_kernel[grid](dy.values, x.values, dy.scales, x.scales, dy.block_ends, dw, n, k,
                         dy.values.stride(0), x.values.stride(0), dw.stride(0), dw.stride(1), dw.stride(2),
                         BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
                         ACCUMULATE=accumulate, num_warps=config.num_warps, num_stages=config.num_stages)
