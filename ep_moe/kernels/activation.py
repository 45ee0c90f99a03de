"""Fused SwiGLU between the two expert GEMMs: ``a = silu(gate) * up`` with ``h = [gate | up]``.

One pass over ``h`` forward and one pass over ``(h, da)`` backward, instead of the several
elementwise kernels (and their intermediates) that autograd of ``silu(gate) * up`` runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# a[r, c] = silu(h[r, c]) * h[r, I + c] for c < I; with BACKWARD, dh from da instead:
#   dh[r, c] = da * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dh[r, I + c] = da * silu(g).
# Tiling: one program per (BLOCK_R rows, BLOCK_C columns of I); fp32 math, rows masked.
@triton.jit
def _swiglu_kernel(h_ptr, da_ptr, out_ptr, num_rows, I, stride_h, stride_a, stride_o,
                   BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < num_rows)[:, None] & (offs_c < I)[None, :]
    rows = offs_r.to(tl.int64)[:, None]
    gate_ptrs = h_ptr + rows * stride_h + offs_c[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    out_ty = out_ptr.dtype.element_ty
    if BACKWARD:
        da = tl.load(da_ptr + rows * stride_a + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        d_gate = da * up * sig * (1.0 + gate * (1.0 - sig))
        out_ptrs = out_ptr + rows * stride_o + offs_c[None, :]
        tl.store(out_ptrs, d_gate.to(out_ty), mask=mask)
        tl.store(out_ptrs + I, (da * silu).to(out_ty), mask=mask)
    else:
        tl.store(out_ptr + rows * stride_o + offs_c[None, :], (silu * up).to(out_ty), mask=mask)


@torch.compiler.disable  # Triton launches stay eager under torch.compile (a graph break)
def _launch(h: torch.Tensor, da: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    num_rows, inter = h.shape[0], h.shape[1] // 2
    if num_rows == 0:
        return out
    block_c = min(triton.next_power_of_2(max(inter, 16)), 256)
    block_r = 16
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(inter, block_c))
    _swiglu_kernel[grid](
        h, da if da is not None else h, out, num_rows, inter,
        h.stride(0), da.stride(0) if da is not None else 0, out.stride(0),
        BACKWARD=da is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )
    return out


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return _launch(h, None, h.new_empty((h.shape[0], h.shape[1] // 2)))

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        return _launch(h, da.contiguous(), torch.empty_like(h))


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` for ``h`` [rows, 2I] (row-contiguous), fused forward and
    backward in Triton, fp32 math, output in h's dtype."""
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1:
        raise ValueError(f"swiglu expects a row-contiguous [rows, 2I] tensor, got shape {tuple(h.shape)} "
                         f"and strides {h.stride()}")
    return _SwiGLU.apply(h)
