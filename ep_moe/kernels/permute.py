"""Row permutation kernels and the token <-> routed-row ops of the MoE layer.

Two memory-bound kernels, each the other's adjoint:

* gather: ``out[r] = src[idx[r]]`` (optionally scaled per source row, fp32), e.g. tokens
  into routed (expert-sorted) order before an all-to-all, or weighted ``dy`` rows in
  expert order for the dW kernel;
* slot sum: ``out[t] = sum_k src[row_of_slot[t*K + k]]``: each token's K routed rows
  summed in slot order (fp32 accumulation, rows ``< 0``, i.e. dropped slots, skipped),
  e.g. the combine of the expert outputs, or the gradient of the gather above.

:func:`permute_tokens` and :func:`sum_slot_rows` wrap them as differentiable ops (each
backward is the other kernel, so no [N, H] slot-order buffer and no atomics), with a
plain-PyTorch path for the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ep_moe.kernels.grouped_gemm import cdiv, eager_or_graph_break, next_power_of_2, row_block_programs

if TYPE_CHECKING:
    from ep_moe.routing import RoutingMetadata


# out[r] = src[idx[r]] * scale[idx[r]] (or scale[r] with SCALE_BY_OUT_ROW; in fp32, optional),
# in one pass; with LIMIT only rows r < *limit_ptr (a count still on the device; the grid
# covers num_rows >= it).
# Tiling: (BLOCK_R rows, BLOCK_C columns) blocks; program (i, j) takes row blocks i, i + grid
# rows, ... below the row count (one each unless LIMIT: row_block_programs) of column block j.
@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, scale_ptr, limit_ptr, out_ptr, num_rows, C, stride_sm, stride_om,
                        SCALE: tl.constexpr, SCALE_BY_OUT_ROW: tl.constexpr, LIMIT: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row_end = num_rows
    if LIMIT:
        row_end = tl.minimum(tl.load(limit_ptr).to(tl.int32), num_rows)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    for row_block in range(tl.program_id(0), tl.cdiv(row_end, BLOCK_R), tl.num_programs(0)):
        offs_r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = offs_r < row_end
        mask = r_ok[:, None] & (offs_c < C)[None, :]
        src_rows = tl.load(idx_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
        vals = tl.load(src_ptr + src_rows[:, None] * stride_sm + offs_c[None, :], mask=mask, other=0.0)
        if SCALE:
            scale_rows = offs_r if SCALE_BY_OUT_ROW else src_rows
            vals = vals.to(tl.float32) * tl.load(scale_ptr + scale_rows, mask=r_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * stride_om + offs_c[None, :],
                 vals.to(out_ptr.dtype.element_ty), mask=mask)


# out[t] = sum over k < TOP_K of src[rows[t*TOP_K + k]], rows < 0 skipped, in slot order
# with fp32 accumulation: reads each routed row once and writes each token once.
# Tiling: one program per (BLOCK_T tokens, BLOCK_C columns), the K slots unrolled.
@triton.jit
def _sum_slot_rows_kernel(src_ptr, rows_ptr, out_ptr, num_tokens, C, stride_sm, stride_om,
                          TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < num_tokens
    c_ok = offs_c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        rows = tl.load(rows_ptr + offs_t.to(tl.int64) * TOP_K + k, mask=t_ok, other=-1).to(tl.int64)
        ok = rows >= 0
        vals = tl.load(src_ptr + rows[:, None] * stride_sm + offs_c[None, :],
                       mask=ok[:, None] & c_ok[None, :], other=0.0)
        acc += vals.to(tl.float32)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_om + offs_c[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


def _column_block(cols: int) -> int:
    return min(next_power_of_2(max(cols, 16)), 256)


@eager_or_graph_break  # Triton launches stay eager under torch.compile (a graph break)
def launch_gather_rows(src: torch.Tensor, idx: Optional[torch.Tensor],
                       scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                       limit: Optional[torch.Tensor] = None, scale_by_out_row: bool = False) -> torch.Tensor:
    """``src[idx] * scale[idx][:, None]`` (``scale[:, None]`` with ``scale_by_out_row``; idx
    None: the identity) as a new contiguous tensor of src's dtype, or written into ``out``,
    whose dtype may differ (e4m3 rows times their scales into bf16). One pass; the scale
    multiply is in fp32, rounded once to the output's dtype. ``src`` must have a contiguous
    last dim. ``limit``: a 0-dim integer tensor on the device; only the first ``limit`` rows
    are written."""
    if idx is None:
        idx = torch.arange(src.shape[0], device=src.device, dtype=torch.int32)
    num_rows, cols = idx.shape[0], src.shape[1]
    out = src.new_empty((num_rows, cols)) if out is None else out
    if num_rows == 0 or cols == 0:
        return out
    block_c, block_r = _column_block(cols), 16
    col_blocks = cdiv(cols, block_c)
    row_programs = row_block_programs(cdiv(num_rows, block_r), col_blocks, src.device, limit is not None)
    _gather_rows_kernel[(row_programs, col_blocks)](
        src, idx, scale, limit, out, num_rows, cols,  # None (a constexpr the flags prune) when absent
        src.stride(0), out.stride(0), SCALE=scale is not None, SCALE_BY_OUT_ROW=scale_by_out_row,
        LIMIT=limit is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )
    return out


@eager_or_graph_break  # Triton launches stay eager under torch.compile (a graph break)
def launch_sum_slot_rows(src: torch.Tensor, row_of_slot: torch.Tensor, top_k: int,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = sum_k src[row_of_slot[t*top_k + k]]`` ([N / top_k, C], src's dtype; into
    ``out`` when given, a row stride of its own allowed), negative rows skipped. ``src`` must
    have a contiguous last dim."""
    num_tokens, cols = row_of_slot.shape[0] // top_k, src.shape[1]
    out = src.new_empty((num_tokens, cols)) if out is None else out
    if num_tokens == 0 or cols == 0:
        return out
    block_c, block_t = _column_block(cols), 16
    _sum_slot_rows_kernel[(cdiv(num_tokens, block_t), cdiv(cols, block_c))](
        src, row_of_slot, out, num_tokens, cols, src.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4,
    )
    return out


def _gather(src: torch.Tensor, idx: torch.Tensor, use_triton: bool) -> torch.Tensor:
    if use_triton:
        return launch_gather_rows(src.contiguous(), idx)
    return src.index_select(0, idx)


def _sum_slots(src: torch.Tensor, row_of_slot: torch.Tensor, top_k: int, use_triton: bool) -> torch.Tensor:
    if use_triton:
        return launch_sum_slot_rows(src.contiguous(), row_of_slot, top_k)
    if src.shape[0] == 0:  # every slot dropped (or no tokens): nothing to gather
        return src.new_zeros((row_of_slot.shape[0] // top_k, src.shape[1]))
    picked = src.index_select(0, row_of_slot.clamp_min(0)).masked_fill((row_of_slot < 0)[:, None], 0)
    acc_dtype = torch.float64 if src.dtype == torch.float64 else torch.float32
    return picked.view(-1, top_k, src.shape[1]).sum(dim=1, dtype=acc_dtype).to(src.dtype)


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, meta, use_triton, gathered):
        ctx.meta, ctx.use_triton = meta, use_triton
        return gathered if gathered is not None else _gather(x_TH, meta.token_index_R, use_triton)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_RH):
        return _sum_slots(grad_RH, ctx.meta.row_of_slot_N, ctx.meta.top_k, ctx.use_triton), None, None, None


class _SumSlotRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_RH, meta, use_triton):
        ctx.meta, ctx.use_triton = meta, use_triton
        return _sum_slots(rows_RH, meta.row_of_slot_N, meta.top_k, use_triton)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_TH):
        return _gather(grad_TH, ctx.meta.token_index_R, ctx.use_triton), None, None


def permute_tokens(x_TH: torch.Tensor, meta: "RoutingMetadata", backend: str = "torch",
                   gathered: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens in routed (expert-sorted) order: ``x_TH[meta.token_index_R]``, [R, H].
    ``gathered``: those rows, already made by :func:`gather_tokens` (before R was known),
    or a stand-in for rows that travel in another form (an expanded row, stride 0, whose
    values nothing reads: :func:`ep_moe.ep.fp8_wire.rows_placeholder`); returned as they
    are, made differentiable.

    Differentiable; the backward sums each token's K row gradients in slot order (no
    atomics). ``backend``: ``"triton"`` (the kernels above) or ``"torch"``.
    """
    _check_backend("permute_tokens", backend)
    if x_TH.dim() != 2 or x_TH.shape[0] != meta.num_tokens:
        raise ValueError(f"permute_tokens: x_TH is {tuple(x_TH.shape)}; pass the [T, H] tokens meta routes "
                         f"(T = meta.num_tokens = {meta.num_tokens})")
    want = (meta.token_index_R.shape[0],) + tuple(x_TH.shape[1:])
    if gathered is not None and (tuple(gathered.shape) != want or gathered.dtype != x_TH.dtype
                                 or (gathered.numel() and not gathered.is_contiguous()
                                     and gathered.stride() != (0, 1))):
        raise ValueError(f"permute_tokens: gathered is {tuple(gathered.shape)} {gathered.dtype}"
                         f"{'' if gathered.is_contiguous() else ' (not contiguous)'}; pass a contiguous "
                         f"{want} {x_TH.dtype} tensor (or an expanded row standing for one) or gathered=None")
    return _PermuteTokens.apply(x_TH, meta, backend == "triton", gathered)


@torch.no_grad()
def gather_tokens(x_TH: torch.Tensor, meta: "RoutingMetadata", num_rows: torch.Tensor,
                  backend: str = "torch") -> torch.Tensor:
    """``x_TH[meta.token_index_R]`` before the routed row count is on the host: ``meta``
    uncut (:func:`ep_moe.routing.sort_slots`), ``num_rows`` the count on the device
    (0-dim). Returns [R, H] for meta's R rows, of which only the first ``num_rows`` are
    written on the Triton path (the torch path gathers all); not differentiable: cut it
    and pass it to :func:`permute_tokens` as ``gathered`` once the count is known."""
    _check_backend("gather_tokens", backend)
    if backend == "triton":
        return launch_gather_rows(x_TH.contiguous(), meta.token_index_R, limit=num_rows)
    return x_TH.index_select(0, meta.token_index_R)


def sum_slot_rows(rows_RH: torch.Tensor, meta: "RoutingMetadata", backend: str = "torch") -> torch.Tensor:
    """Routed rows summed per token, [T, H]: ``y[t] = sum_k rows_RH[row of slot t*K+k]``
    in slot order, dropped slots contributing zero. Rows must already carry their top-k
    weights. Differentiable; the backward gathers ``grad[meta.token_index_R]``."""
    _check_backend("sum_slot_rows", backend)
    if rows_RH.dim() != 2 or rows_RH.shape[0] < meta.token_index_R.shape[0]:
        raise ValueError(f"sum_slot_rows: rows_RH is {tuple(rows_RH.shape)}; pass [R, H] with at least the "
                         f"R = {meta.token_index_R.shape[0]} routed rows of meta")
    return _SumSlotRows.apply(rows_RH, meta, backend == "triton")


def _check_backend(caller: str, backend: str) -> None:
    if backend not in ("triton", "torch"):
        raise ValueError(f"{caller}: backend={backend!r}; use 'triton' or 'torch'")
