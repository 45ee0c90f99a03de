"""Fused gated activations between the two expert GEMMs: ``a = act(gate) * up`` with
``h = [gate | up]``, ``act`` SiLU (SwiGLU) or the exact GELU (GeGLU); and the clamped SwiGLU
of OpenAI's GPT-OSS (:class:`ClampedSwiGLU`: gate and up interleaved, both clamped,
``(up + 1) * gate * sigmoid(alpha * gate)``).

One pass over ``h`` forward and one pass over ``(h, da)`` backward, instead of the several
elementwise kernels (and their intermediates) that autograd of ``act(gate) * up`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import triton
import triton.language as tl

from ep_moe.kernels.grouped_gemm import cdiv, next_power_of_2, row_block_programs

GateActivation = Literal["silu", "gelu"]
"""The gate's activation: ``"silu"`` (SwiGLU) or ``"gelu"``, the exact erf form (GeGLU)."""

_SQRT_HALF = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# a[r, c] = act(g) * (u + UP_OFFSET), g = h[r, c], u = h[r, I + c] for c < I (INTERLEAVED:
#   g = h[r, 2c], u = h[r, 2c + 1]); with BACKWARD, dh from da instead:
#   dh[gate] = da * (u + UP_OFFSET) * act'(g),  dh[up] = da * act(g);
#   silu: act = g * sigmoid(ALPHA g), act' = s + ALPHA g s (1 - s) with s = sigmoid(ALPHA g);
#   gelu: act = g * Phi(g), act' = Phi(g) + g * phi(g) (Phi, phi: the normal cdf and pdf).
#   CLAMP: g clamped to at most CLAMP_AT and u to [-CLAMP_AT, CLAMP_AT] first, their gradient
#   zero where a clamp bit (torch.clamp's: the bounds themselves pass it).
# Tiling: (BLOCK_R rows, BLOCK_C columns of I) blocks; program (i, j) takes row blocks i,
#   i + grid rows, ... of column block j (one each unless LIMIT: row_block_programs); fp32
#   math, rows masked. LIMIT: only rows r < *limit_ptr (a count on the device), the rest of
#   the output left unwritten. ACT: the gate's activation (GateActivation); the kernel keeps
#   the name profiles and benchmarks know it by (benchmarks/bench_train.py) for GeGLU too.
@triton.jit
def _swiglu_kernel(h_ptr, da_ptr, out_ptr, limit_ptr, num_rows, I, stride_h, stride_a, stride_o,
                   ALPHA, UP_OFFSET, CLAMP_AT,
                   BACKWARD: tl.constexpr, LIMIT: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                   CLAMP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row_end = num_rows
    if LIMIT:
        row_end = tl.minimum(tl.load(limit_ptr).to(tl.int32), num_rows)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if INTERLEAVED:
        gate_cols, up_shift = 2 * offs_c, 1
    else:
        gate_cols, up_shift = offs_c, I
    out_ty = out_ptr.dtype.element_ty
    for row_block in range(tl.program_id(0), tl.cdiv(row_end, BLOCK_R), tl.num_programs(0)):
        offs_r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (offs_r < row_end)[:, None] & (offs_c < I)[None, :]
        rows = offs_r.to(tl.int64)[:, None]
        gate_ptrs = h_ptr + rows * stride_h + gate_cols[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + up_shift, mask=mask, other=0.0).to(tl.float32)
        if CLAMP:
            gate_passes = gate <= CLAMP_AT
            up_passes = (up >= -CLAMP_AT) & (up <= CLAMP_AT)
            gate = tl.minimum(gate, CLAMP_AT)
            up = tl.minimum(tl.maximum(up, -CLAMP_AT), CLAMP_AT)
        up = up + UP_OFFSET
        if ACT == "silu":
            sig = tl.sigmoid(gate * ALPHA)
            act = gate * sig
            d_act = sig * (1.0 + ALPHA * gate * (1.0 - sig))
        else:
            cdf = 0.5 * (1.0 + tl.erf(gate * _SQRT_HALF))
            act = gate * cdf
            d_act = cdf + gate * _INV_SQRT_2PI * tl.exp(-0.5 * gate * gate)
        if BACKWARD:
            da = tl.load(da_ptr + rows * stride_a + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
            d_gate = da * up * d_act
            d_up = da * act
            if CLAMP:
                d_gate = tl.where(gate_passes, d_gate, 0.0)
                d_up = tl.where(up_passes, d_up, 0.0)
            out_ptrs = out_ptr + rows * stride_o + gate_cols[None, :]
            tl.store(out_ptrs, d_gate.to(out_ty), mask=mask)
            tl.store(out_ptrs + up_shift, d_up.to(out_ty), mask=mask)
        else:
            tl.store(out_ptr + rows * stride_o + offs_c[None, :], (act * up).to(out_ty), mask=mask)


@dataclass(frozen=True)
class GateForm:
    """The gated activation's form beyond its ``act`` (the kernel's runtime arguments):
    SwiGLU's and GeGLU's are the defaults; :class:`ClampedSwiGLU` sets them all."""

    alpha: float = 1.0
    up_offset: float = 0.0
    clamp_at: Optional[float] = None
    interleaved: bool = False

    def in_torch(self, h: torch.Tensor, act: GateActivation) -> torch.Tensor:
        """The kernel's math as torch ops in ``h``'s dtype (autograd's gradients; torch.clamp's
        pass at the bounds, as the kernel's do)."""
        gate, up = (h[..., ::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)
        if self.clamp_at is not None:
            gate = gate.clamp(max=self.clamp_at)
            up = up.clamp(min=-self.clamp_at, max=self.clamp_at)
        act_g = gate * torch.sigmoid(gate * self.alpha) if act == "silu" else torch.nn.functional.gelu(gate)
        return (up + self.up_offset) * act_g


_PLAIN = GateForm()


def _launch(h: torch.Tensor, da: torch.Tensor | None, out: torch.Tensor,
            num_rows: torch.Tensor | None, act: GateActivation = "silu", form: GateForm = _PLAIN) -> torch.Tensor:
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
        float(form.alpha), float(form.up_offset), float(form.clamp_at or 0.0),
        BACKWARD=da is not None, LIMIT=num_rows is not None, ACT=act, INTERLEAVED=form.interleaved,
        CLAMP=form.clamp_at is not None, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=4,
    )
    return out


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, num_rows, act, form):
        ctx.save_for_backward(h, num_rows)
        ctx.act, ctx.form = act, form
        return _launch(h, None, h.new_empty((h.shape[0], h.shape[1] // 2)), num_rows, act, form)

    @staticmethod
    def backward(ctx, da):
        h, num_rows = ctx.saved_tensors
        return _launch(h, da.contiguous(), torch.empty_like(h), num_rows, ctx.act, ctx.form), None, None, None


def gated(h: torch.Tensor, act: GateActivation, num_rows: torch.Tensor | None = None,
          form: GateForm = _PLAIN) -> torch.Tensor:
    """``act(h[:, :I]) * h[:, I:]`` for ``h`` [rows, 2I] (row-contiguous), ``act`` SiLU or the
    exact GELU, fused forward and backward in Triton, fp32 math, output in h's dtype;
    ``form``: another gate of that kind (:class:`GateForm`, :class:`ClampedSwiGLU`).

    ``num_rows``: a count still on the device (0-dim integer tensor) when only the first
    rows of ``h`` are in use (the grouped GEMM's ``bounded_rows``): the output rows past
    it, and the gradient rows past it, are left unwritten, and no time is spent on them.
    Under ``torch.compile`` the same math runs as torch ops, which Inductor fuses (the
    kernel's launch would break the graph), every row computed."""
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
    if torch.compiler.is_compiling():  # no graph break: Inductor fuses the same math (fp32, rounded once), each way
        return form.in_torch(h.float(), act).to(h.dtype)
    if not torch.is_grad_enabled():  # the forward alone: no autograd function's per-call setup
        return _launch(h, None, h.new_empty((h.shape[0], h.shape[1] // 2)), num_rows, act, form)
    return _GLU.apply(h, num_rows, act, form)


@dataclass(frozen=True)
class ClampedSwiGLU(GateForm):
    """GPT-OSS's gate on ``h`` [rows, 2I] with gate and up interleaved (columns 2c and 2c+1):
    ``g = min(h_gate, limit)``, ``u = clamp(h_up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)``. :meth:`fused` runs it in the Triton kernel,
    :meth:`reference` as torch ops."""

    interleaved: bool = True
    up_offset: float = 1.0

    def fused(self, h: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The gate fused forward and backward (:func:`gated`)."""
        return gated(h, "silu", num_rows, self)

    def reference(self, h: torch.Tensor) -> torch.Tensor:
        """The gate as torch ops (autograd's gradients)."""
        return self.in_torch(h, "silu")


def swiglu(h: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]``: :func:`gated` with SiLU."""
    return gated(h, "silu", num_rows)


def geglu(h: torch.Tensor, num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(h[:, :I]) * h[:, I:]`` (exact erf GELU): :func:`gated` with GELU."""
    return gated(h, "gelu", num_rows)
