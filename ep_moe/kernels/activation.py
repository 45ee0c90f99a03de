"""Fused gated activations between the two expert GEMMs: ``a = act(gate) * up`` with
``h = [gate | up]``, ``act`` SiLU (SwiGLU) or the exact GELU (GeGLU).

One pass over ``h`` forward and one pass over ``(h, da)`` backward, instead of the several
elementwise kernels (and their intermediates) that autograd of ``act(gate) * up`` runs.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from ep_moe.kernels.grouped_gemm import cdiv, eager_or_graph_break, next_power_of_2, row_block_programs

GateActivation = Literal["silu", "gelu"]
"""The gate's activation: ``"silu"`` (SwiGLU) or ``"gelu"``, the exact erf form (GeGLU)."""

_SQRT_HALF = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# a[r, c] = act(h[r, c]) * h[r, I + c] for c < I; with BACKWARD, dh from da instead:
#   dh[r, c] = da * up * act'(g),  dh[r, I + c] = da * act(g);
#   silu: act = g * sigmoid(g), act' = sigmoid(g) * (1 + g * (1 - sigmoid(g)));
#   gelu: act = g * Phi(g), act' = Phi(g) + g * phi(g) (Phi, phi: the normal cdf and pdf).
# Tiling: (BLOCK_R rows, BLOCK_C columns of I) blocks; program (i, j) takes row blocks i,
#   i + grid rows, ... of column block j (one each unless LIMIT: row_block_programs); fp32
#   math, rows masked. LIMIT: only rows r < *limit_ptr (a count on the device), the rest of
#   the output left unwritten. ACT: the gate's activation (GateActivation); the kernel keeps
#   the name profiles and benchmarks know it by (benchmarks/bench_train.py) for GeGLU too.
@triton.jit
def _swiglu_kernel(h_ptr, da_ptr, out_ptr, limit_ptr, num_rows, I, stride_h, stride_a, stride_o,
                BACKWARD: tl.constexpr, LIMIT: tl.constexpr, ACT: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row_end = num_rows
    if LIMIT:
        row_end = tl.minimum(tl.load(limit_ptr).to(tl.int32), num_rows)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    out_ty = out_ptr.dtype.element_ty
    for row_block in range(tl.program_id(0), tl.cdiv(row_end, BLOCK_R), tl.num_programs(0)):
        offs_r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (offs_r < row_end)[:, None] & (offs_c < I)[None, :]
        rows = offs_r.to(tl.int64)[:, None]
        gate_ptrs = h_ptr + rows * stride_h + offs_c[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
        if ACT == "silu":
            sig = tl.sigmoid(gate)
            act = gate * sig
            d_act = sig * (1.0 + gate * (1.0 - sig))
        else:
            cdf = 0.5 * (1.0 + tl.erf(gate * _SQRT_HALF))
            act = gate * cdf
            d_act = cdf + gate * _INV_SQRT_2PI * tl.exp(-0.5 * gate * gate)
        if BACKWARD:
            da = tl.load(da_ptr + rows * stride_a + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
            out_ptrs = out_ptr + rows * stride_o + offs_c[None, :]
            tl.store(out_ptrs, (da * up * d_act).to(out_ty), mask=mask)
            tl.store(out_ptrs + I, (da * act).to(out_ty), mask=mask)
        else:
            tl.store(out_ptr + rows * stride_o + offs_c[None, :], (act * up).to(out_ty), mask=mask)


@eager_or_graph_break  # Triton launches stay eager under torch.compile (a graph break)
def _launch(h: torch.Tensor, da: torch.Tensor | None, out: torch.Tensor,
            num_rows: torch.Tensor | None, act: GateActivation = "silu") -> torch.Tensor:
    rows, inter = h.shape[0], h.shape[1] // 2
    if rows == 0:
        return out
    block_c = min(next_power_of_2(max(inter, 16)), 256)
    block_r = 16
    col_blocks = cdiv(inter, block_c)
    grid = (row_block_programs(cdiv(rows, block_r), col_blocks, h.device, num_rows is not None), col_blocks)
    _swiglu_kernel[grid](
        h, da, out, num_rows, rows, inter,  # None (a constexpr the flags prune) when absent
        h.stride(0), da.stride(0) if da is not None else 0, out.stride(0),
        BACKWARD=da is not None, LIMIT=num_rows is not None, ACT=act, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=4,
    )
    return out


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, num_rows, act):
        ctx.save_for_backward(h, num_rows)
        ctx.act = act
        return _launch(h, None, h.new_empty((h.shape[0], h.shape[1] // 2)), num_rows, act)

    @staticmethod
    def backward(ctx, da):
        h, num_rows = ctx.saved_tensors
        return _launch(h, da.contiguous(), torch.empty_like(h), num_rows, ctx.act), None, None


def gated(h: torch.Tensor, act: GateActivation, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``act(h[:, :I]) * h[:, I:]`` for ``h`` [rows, 2I] (row-contiguous), ``act`` SiLU or the
    exact GELU, fused forward and backward in Triton, fp32 math, output in h's dtype.

    ``num_rows``: a count still on the device (0-dim integer tensor) when only the first
    rows of ``h`` are in use (the grouped GEMM's ``bounded_rows``): the output rows past
    it, and the gradient rows past it, are left unwritten, and no time is spent on them."""
    name = "swiglu" if act == "silu" else "geglu"
    if act not in ("silu", "gelu"):
        raise ValueError(f"gated: act={act!r}; use 'silu' (SwiGLU) or 'gelu' (GeGLU)")
    if not h.dtype.is_floating_point:
        raise ValueError(f"{name} expects floating-point activations, got {h.dtype}")
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1:
        raise ValueError(f"{name} expects a row-contiguous [rows, 2I] tensor, got shape {tuple(h.shape)} "
                         f"and strides {h.stride()}")
    if num_rows is not None and (num_rows.numel() != 1 or num_rows.dtype.is_floating_point
                                 or num_rows.device != h.device):
        raise ValueError(f"{name}: num_rows must be a one-element integer tensor on {h.device}, got "
                         f"{num_rows.dtype} {tuple(num_rows.shape)} on {num_rows.device}; pass m_sizes.sum()")
    if not torch.is_grad_enabled():  # the forward alone: no autograd function's per-call setup
        return _launch(h, None, h.new_empty((h.shape[0], h.shape[1] // 2)), num_rows, act)
    return _GLU.apply(h, num_rows, act)


def swiglu(h: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]``: :func:`gated` with SiLU."""
    return gated(h, "silu", num_rows)


def geglu(h: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(h[:, :I]) * h[:, I:]`` (exact erf GELU): :func:`gated` with GELU."""
    return gated(h, "gelu", num_rows)
