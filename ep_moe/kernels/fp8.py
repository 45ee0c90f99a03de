"""FP8 (e4m3) operands for the grouped GEMM: quantization, and the grouped product whose
forward and dX run on FP8 tensor cores.

Recipe (rowwise, "tensorwise per row"):

- activations: one fp32 scale per row over the reduced dim, ``scale = amax(|row|) / 448``, the
  row stored as ``row / scale`` in e4m3 (round to nearest even). The quantization reads the rows
  through the permutation's gather, so the sorted FP8 rows are the only copy written;
- weights: one scale per (expert, output channel) over the reduced dim. The forward reduces
  over ``w``'s K, the dX over its N, so each pass has its own copy: ``w`` [E, N, K] scaled per
  (e, n), and ``w`` transposed to [E, K, N] scaled per (e, k), both K-contiguous as the FP8
  tensor cores read them. They are made once per weight version (an optimizer step), not per
  call (:func:`quantized_weight`);
- the product accumulates in fp32, is multiplied by the row's and the channel's scale in the
  epilogue, and is stored in the output dtype (bf16);
- dW stays bf16 (``dy_rows^T @ x_rows``): its reduction runs over the rows, across the
  rowwise scales.

On CPU the same kernels run in Triton's interpreter (tests); :func:`fp8_supported` says where
the FP8 tensor cores are.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from ep_moe.kernels.config import KernelConfig
from ep_moe.kernels.grouped_gemm import cdiv, eager_or_graph_break, interpreter_active, launch_dw, launch_rows
from ep_moe.kernels.permute import launch_gather_rows

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""The largest finite e4m3 value: a row's largest magnitude maps onto it."""
MIN_AMAX = 1e-12
"""An all-zero row's amax is taken as this (its scale stays finite; its values stay 0)."""


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """(whether FP8 grouped GEMMs run on ``device``, why not). CUDA needs FP8 tensor cores
    (compute capability 8.9 or newer: Ada, Hopper, Blackwell); CPU runs them only in the
    Triton interpreter (``TRITON_INTERPRET=1``, for tests)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return False, (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no "
                           "FP8 tensor cores; FP8 experts need 8.9 or newer (Ada, Hopper, Blackwell)")
        return True, ""
    if interpreter_active():
        return True, ""
    return False, (f"FP8 experts run on CUDA GPUs with FP8 tensor cores, not on {device.type} "
                   "(set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter, slowly)")


@triton.jit
def _on_e4m3_grid(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32:
    3 mantissa bits kept in the bits of normal values (a carry may enter the exponent), steps of
    2**-9 below 2**-6 (e4m3's subnormals). The cast that follows is then exact, so every backend
    writes the same bits (Triton's CPU interpreter rounds fp8 casts without that carry)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0  # fp32's step at 1.5 * 2**14 is 2**-9
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


# q[r, :] = e4m3(x[g(r), :] / scale[r]), scale[r] = max(amax(|x[g(r), :]|), MIN_AMAX) / 448.
# Tiling: one program per BLOCK_R rows; two passes over the row in BLOCK_K columns (the amax,
#   then the scaled stores; the second reads from L2).
# Fuses: the permutation's gather (GATHER: row r reads x[g(r)]) into the quantization, so the
#   expert-sorted rows are written once, in FP8.
@triton.jit
def _quantize_rows_kernel(x_ptr, idx_ptr, q_ptr, scale_ptr, num_rows, K, stride_xm, stride_qm,
                          GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                          FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    if GATHER:
        src = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = row_ok[:, None] & (k0 + cols < K)[None, :]
        v = tl.load(x_ptr + src[:, None] * stride_xm + (k0 + cols)[None, :], mask=ok, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    scale = tl.maximum(amax, AMAX_FLOOR) / FP8_MAX
    for k0 in range(0, K, BLOCK_K):
        ok = row_ok[:, None] & (k0 + cols < K)[None, :]
        v = tl.load(x_ptr + src[:, None] * stride_xm + (k0 + cols)[None, :], mask=ok, other=0.0)
        q = _on_e4m3_grid(tl.math.div_rn(v.to(tl.float32), scale[:, None]))
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + (k0 + cols)[None, :],
                 q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + rows, scale, mask=row_ok)


def quantize_rows(x: torch.Tensor, gather_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` [T, K] (read at ``gather_index[r]`` when given) in e4m3 with one fp32 scale
    per row: ``(q [R, K], scale [R])`` with ``q[r] * scale[r] ~= x[g(r)]``."""
    rows = gather_index.shape[0] if gather_index is not None else x.shape[0]
    k = x.shape[1]
    q = torch.empty((rows, k), device=x.device, dtype=E4M3)
    scale = torch.empty((rows,), device=x.device, dtype=torch.float32)
    if rows == 0:
        return q, scale
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_k = min(triton.next_power_of_2(max(k, 16)), 1024)
    block_r = max(1, min(16, 4096 // block_k))
    _quantize_rows_kernel[(cdiv(rows, block_r),)](
        x, gather_index, q, scale, rows, k, x.stride(0), q.stride(0),
        GATHER=gather_index is not None, BLOCK_R=block_r, BLOCK_K=block_k,
        FP8_MAX=E4M3_MAX, AMAX_FLOOR=MIN_AMAX, num_warps=4,
    )
    return q, scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in PyTorch ops, over the last dim of ``x`` (any leading dims):
    the recipe's definition, for the weights and for tests."""
    amax = x.detach().float().abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX)
    scale = amax / E4M3_MAX
    return (x.detach().float() / scale).to(E4M3), scale.squeeze(-1)


class QuantizedWeight:
    """A weight [E, N, K] in e4m3 for both passes: ``forward`` ([E, N, K] scaled per (e, n))
    and ``dx`` ([E, K, N] scaled per (e, k)), each a (values, scales) pair, made from one
    version of the weight."""

    __slots__ = ("version", "forward", "dx")

    def __init__(self, w: torch.Tensor):
        self.version = w._version
        self.forward = quantize_rows_reference(w)
        self.dx = quantize_rows_reference(w.transpose(1, 2))
        self.dx = (self.dx[0].contiguous(), self.dx[1].contiguous())


_QUANTIZED = WeakIdKeyDictionary()  # weight -> QuantizedWeight, dropped with the weight


def quantized_weight(w: torch.Tensor) -> QuantizedWeight:
    """``w``'s e4m3 copies, made once per version of ``w``: an optimizer step (an in-place
    update) bumps the version and the next call quantizes again; calls between steps (layers
    that share a weight, activation checkpointing's recompute) reuse them."""
    held = _QUANTIZED.get(w)
    if held is None or held.version != w._version:
        held = QuantizedWeight(w)
        _QUANTIZED[w] = held
    return held


def _rows_fp8(q: torch.Tensor, q_scale: torch.Tensor, wq: tuple[torch.Tensor, torch.Tensor], m_sizes: torch.Tensor,
              config: KernelConfig, out_dtype: torch.dtype, scatter_index: Optional[torch.Tensor] = None,
              out_rows: Optional[int] = None) -> torch.Tensor:
    w_values, w_scale = wq
    rows = out_rows if out_rows is not None else q.shape[0]
    out = (torch.zeros if scatter_index is not None else torch.empty)(
        (rows, w_values.shape[1]), device=q.device, dtype=out_dtype)
    if q.shape[0]:
        launch_rows(q, w_values, out, m_sizes, config, transpose_w=True, store_idx=scatter_index,
                    fp8_scales=(q_scale, w_scale))
    return out


class _GroupedGemmFP8(torch.autograd.Function):
    """``out[r] = x[g(r)] @ w[e(r)]^T`` with e4m3 operands (forward and dX), bf16 dW."""

    @staticmethod
    def forward(ctx, x, w, m_sizes, gather_index, forward_config, dx_config, dw_config):
        q, q_scale = quantize_rows(x, gather_index)
        out = _rows_fp8(q, q_scale, quantized_weight(w).forward, m_sizes, forward_config, x.dtype)
        ctx.save_for_backward(x, w, m_sizes, gather_index)
        ctx.configs = (dx_config, dw_config)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w, m_sizes, gather_index = ctx.saved_tensors
        dx_config, dw_config = ctx.configs
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dq, dq_scale = quantize_rows(dy)
            if gather_index is None:
                dx = _rows_fp8(dq, dq_scale, quantized_weight(w).dx, m_sizes, dx_config, x.dtype)
            else:  # rows land on their tokens: several rows of one token add up
                rows = _rows_fp8(dq, dq_scale, quantized_weight(w).dx, m_sizes, dx_config, torch.float32)
                dx = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
                dx.index_add_(0, gather_index.long(), rows)
                dx = dx.to(x.dtype)
        if ctx.needs_input_grad[1]:
            x_rows = x if gather_index is None else launch_gather_rows(x, gather_index)
            dw = torch.empty(w.shape, device=w.device, dtype=w.dtype)
            launch_dw(dy, x_rows.to(dy.dtype), dw, m_sizes, dw_config)
        return dx, dw, None, None, None, None, None


@eager_or_graph_break
def grouped_gemm_fp8(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *,
                     gather_index: Optional[torch.Tensor] = None,
                     configs: Optional[tuple[KernelConfig, KernelConfig, KernelConfig]] = None) -> torch.Tensor:
    """``out[r] = x[g(r)] @ w[e(r)]^T`` for rows sorted by expert (``m_sizes`` [E] rows each,
    int32), with e4m3 operands in the forward and the dX (the recipe in this module's
    docstring) and a bf16 dW; differentiable in ``x`` and ``w``.

    ``x`` [T, K] (bf16 or fp16; read at ``gather_index[r]`` when given, else T = rows), ``w``
    [E, N, K] in the same dtype. ``configs``: the (forward, dx, dw) kernel configs, default
    :func:`fp8_configs`. Raises where the device has no FP8 tensor cores.
    """
    ok, why = fp8_supported(x.device)
    if not ok:
        raise RuntimeError(f"grouped_gemm_fp8: {why}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise TypeError(f"grouped_gemm_fp8: x and w must both be bfloat16 or float16, got x {x.dtype} and "
                        f"w {w.dtype}; cast them (the master weights may stay fp32: pass w.to(x.dtype))")
    if w.dim() != 3 or x.dim() != 2 or w.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_gemm_fp8: w must be [E, N, K] and x [T, K], got w {tuple(w.shape)} and "
                         f"x {tuple(x.shape)}")
    if m_sizes.dtype != torch.int32 or m_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm_fp8: m_sizes must be int32 [E] = [{w.shape[0]}], got "
                         f"{m_sizes.dtype} {tuple(m_sizes.shape)}")
    if gather_index is not None and gather_index.dtype != torch.int32:
        gather_index = gather_index.to(torch.int32)
    forward, dx, dw = configs if configs is not None else fp8_configs()
    return _GroupedGemmFP8.apply(x, w, m_sizes, gather_index, forward, dx, dw)


def fp8_configs() -> tuple[KernelConfig, KernelConfig, KernelConfig]:
    """(forward, dx, dw) kernel configs of the FP8 path: 128-wide K steps (one e4m3 byte per
    value, so a 128-byte row per stage as bf16's 64), B through TMA; dW is bf16's."""
    if interpreter_active():
        small = KernelConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
        return small, small, small
    rows = KernelConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, use_tma=True)
    return rows, rows, KernelConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, use_tma=True)
