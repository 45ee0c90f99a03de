"""Fused SwiGLU between the two expert GEMMs: ``a = silu(gate) * up`` with ``h = [gate | up]``.

One pass over ``h`` forward and one pass over ``(h, da)`` backward, instead of the several
elementwise kernels (and their intermediates) that autograd of ``silu(gate) * up`` runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ep_moe.kernels.grouped_gemm import row_block_programs


# a[r, c] = silu(h[r, c]) * h[r, I + c] for c < I; with BACKWARD, dh from da instead:
#   dh[r, c] = da * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dh[r, I + c] = da * silu(g).
# Tiling: (BLOCK_R rows, BLOCK_C columns of I) blocks; program (i, j) takes row blocks i,
#   i + grid rows, ... of column block j (one each unless LIMIT: row_block_programs); fp32
#   math, rows masked. LIMIT: only rows r < *limit_ptr (a count on the device), the rest of
#   the output left unwritten.
@triton.jit
def _swiglu_kernel(h_ptr, da_ptr, out_ptr, limit_ptr, num_rows, I, stride_h, stride_a, stride_o,
                   BACKWARD: tl.constexpr, LIMIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
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
        sig = tl.sigmoid(gate)
        silu = gate * sig
        if BACKWARD:
            da = tl.load(da_ptr + rows * stride_a + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
            d_gate = da * up * sig * (1.0 + gate * (1.0 - sig))
            out_ptrs = out_ptr + rows * stride_o + offs_c[None, :]
            tl.store(out_ptrs, d_gate.to(out_ty), mask=mask)
            tl.store(out_ptrs + I, (da * silu).to(out_ty), mask=mask)
        else:
            tl.store(out_ptr + rows * stride_o + offs_c[None, :], (silu * up).to(out_ty), mask=mask)


@torch.compiler.disable  # Triton launches stay eager under torch.compile (a graph break)
def _launch(h: torch.Tensor, da: torch.Tensor | None, out: torch.Tensor,
            num_rows: torch.Tensor | None) -> torch.Tensor:
    rows, inter = h.shape[0], h.shape[1] // 2
    if rows == 0:
        return out
    block_c = min(triton.next_power_of_2(max(inter, 16)), 256)
    block_r = 16
    col_blocks = triton.cdiv(inter, block_c)
    grid = (row_block_programs(triton.cdiv(rows, block_r), col_blocks, h.device, num_rows is not None), col_blocks)
    _swiglu_kernel[grid](
        h, da if da is not None else h, out, num_rows if num_rows is not None else h, rows, inter,
        h.stride(0), da.stride(0) if da is not None else 0, out.stride(0),
        BACKWARD=da is not None, LIMIT=num_rows is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )
    return out


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, num_rows):
        ctx.save_for_backward(h, num_rows)
        return _launch(h, None, h.new_empty((h.shape[0], h.shape[1] // 2)), num_rows)

    @staticmethod
    def backward(ctx, da):
        h, num_rows = ctx.saved_tensors
        return _launch(h, da.contiguous(), torch.empty_like(h), num_rows), None


def swiglu(h: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` for ``h`` [rows, 2I] (row-contiguous), fused forward and
    backward in Triton, fp32 math, output in h's dtype.

    ``num_rows``: a count still on the device (0-dim integer tensor) when only the first
    rows of ``h`` are in use (the grouped GEMM's ``bounded_rows``): the output rows past
    it, and the gradient rows past it, are left unwritten, and no time is spent on them."""
    if not h.dtype.is_floating_point:
        raise ValueError(f"swiglu expects floating-point activations, got {h.dtype}")
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1:
        raise ValueError(f"swiglu expects a row-contiguous [rows, 2I] tensor, got shape {tuple(h.shape)} "
                         f"and strides {h.stride()}")
    if num_rows is not None and (num_rows.numel() != 1 or num_rows.dtype.is_floating_point
                                 or num_rows.device != h.device):
        raise ValueError(f"swiglu: num_rows must be a one-element integer tensor on {h.device}, got "
                         f"{num_rows.dtype} {tuple(num_rows.shape)} on {num_rows.device}; pass m_sizes.sum()")
    return _SwiGLU.apply(h, num_rows)
