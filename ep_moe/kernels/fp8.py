"""FP8 (e4m3) operands for the grouped GEMM: quantization, and the grouped product whose
forward and dX run on FP8 tensor cores.

Recipe (rowwise, "tensorwise per row"; the format itself in :mod:`ep_moe.kernels.e4m3`):

- activations: one fp32 scale per row over the reduced dim, ``scale = amax(|row|) * (1/448)``,
  the row stored as ``row / scale`` in e4m3 (round to nearest even). Rows the GEMM gathers
  (the layer's tokens, read once per routed slot) are quantized once each, and the GEMM
  gathers the e4m3 rows with their scales; at EP>1 the senders quantize them and they travel
  in e4m3 (:mod:`ep_moe.ep.fp8_wire`);
- weights: one scale per (expert, output channel) over the reduced dim. The forward reduces
  over ``w``'s K, the dX over its N, so each pass has its own copy: ``w`` [E, N, K] scaled per
  (e, n), and ``w`` transposed to [E, K, N] scaled per (e, k), both K-contiguous as the FP8
  tensor cores read them. They are made once per weight version (an optimizer step), not per
  call (:func:`quantized_weight`);
- the product accumulates in fp32, is multiplied by the row's and the channel's scale in the
  epilogue, then gets the bias and the row weight (the top-k weight) as the bf16 GEMM's, and
  is stored in the output dtype (bf16);
- dX: the output gradient quantized per row the same way, times the weight's dX copy; the
  top-k weights' gradient is the dot of that product with the backward's ``x_rows`` (below;
  so it carries the dX's quantization), taken in the same epilogue;
- dW stays bf16 (``dy_rows^T @ x_rows``): its reduction runs over the rows, across the
  rowwise scales. ``x_rows`` are x itself where the rows are the GEMM's own (the down
  projection's activations), and the e4m3 rows dequantized to x's dtype where the GEMM
  gathers them (the up projection's tokens: at EP>1 they arrive in e4m3 with no other
  copy, so at every EP size, and EP=N computes what EP=1 does). An FP8 dW with operands
  scaled per (expert, column) measured slower than the bf16 one on the H200 (its two extra
  quantization passes cost what the FP8 product saves; ``benchmarks/experiments/fp8_dw.patch``,
  made against an earlier form of this module).

The autograd, index modes (deterministic sums of gathered rows), bounded rows and deferred
weight gradients are :mod:`ep_moe.kernels.ops`' own, with these operands;
:func:`layer_grouped_gemm_fp8` is what ``MoEConfig(expert_precision="fp8")`` runs.

On CPU the same kernels run in Triton's interpreter (tests); :func:`fp8_supported` says where
the FP8 tensor cores are.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary

from ep_moe.kernels.config import (
    DEFAULT_CONFIGS,
    GemmConfigs,
    KernelConfig,
    configs_from_ints,
    configs_to_ints,
    fit_to_smem,
)
from ep_moe.kernels.e4m3 import E4M3, E4M3_MAX, MIN_AMAX, on_e4m3_grid, scale_of
from ep_moe.kernels.grouped_gemm import cdiv, eager_or_graph_break, interpreter_active, launch_rows, smem_limit_for
from ep_moe.kernels.ops import (_SAVED, _as_int32, _check_gather_slots, _contiguous,
                                _grad_input, _setup_context, _validate, debug_enabled,
                                eager_backward, value_checks)
from ep_moe.kernels.permute import launch_gather_rows


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


# q[r, :] = e4m3(x[g(r), :] / scale[r]), scale[r] = max(amax(|x[g(r), :]|), MIN_AMAX) / 448.
# Tiling: one program per BLOCK_R rows. Rows that fit one BLOCK_K block (ONE_BLOCK) are read
#   once and kept in registers; longer rows take two passes in BLOCK_K columns (the amax, then
#   the scaled stores, the second reading from L2).
# Fuses: a gather (GATHER: row r reads x[g(r)]; the all-to-all sender's (token, rank) rows)
#   into the quantization, so the selected rows are written once, in FP8 (a message's bytes:
#   q's rows strided by stride_qm). LIMIT: only rows r < *limit_ptr (a count on the device),
#   the rest left unwritten.
@triton.jit
def _quantize_rows_kernel(x_ptr, idx_ptr, q_ptr, scale_ptr, limit_ptr, num_rows, K, stride_xm, stride_qm,
                          GATHER: tl.constexpr, LIMIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                          ONE_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    row_end = num_rows
    if LIMIT:
        row_end = tl.minimum(tl.load(limit_ptr).to(tl.int32), num_rows)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < row_end
    if GATHER:
        src = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if ONE_BLOCK:
        ok = row_ok[:, None] & (cols < K)[None, :]
        v = tl.load(x_ptr + src[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
    else:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = row_ok[:, None] & (k0 + cols < K)[None, :]
            v = tl.load(x_ptr + src[:, None] * stride_xm + (k0 + cols)[None, :], mask=ok, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    scale = scale_of(amax, FP8_MAX, AMAX_FLOOR)
    for k0 in range(0, K, BLOCK_K):
        ok = row_ok[:, None] & (k0 + cols < K)[None, :]
        if not ONE_BLOCK:
            v = tl.load(x_ptr + src[:, None] * stride_xm + (k0 + cols)[None, :], mask=ok, other=0.0).to(tl.float32)
        q = on_e4m3_grid(tl.math.div_rn(v, scale[:, None]))
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + (k0 + cols)[None, :],
                 q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + rows, scale, mask=row_ok)


QUANTIZE_ROW_ELEMENTS = 8192
"""Values each program of the row quantization holds (rows up to this long are read once)."""


class QuantizedRows(NamedTuple):
    """Rows in e4m3 with one fp32 scale each, ``values[r] * scales[r] ~= row r``
    (:func:`quantize_rows`)."""

    values: torch.Tensor
    """e4m3 [R, K]: each row contiguous, the rows possibly strided (a view of a message)."""
    scales: torch.Tensor
    """fp32 [R], contiguous."""


def quantize_rows(x: torch.Tensor, gather_index: Optional[torch.Tensor] = None,
                  values_out: Optional[torch.Tensor] = None, limit: Optional[torch.Tensor] = None) -> QuantizedRows:
    """Rows of ``x`` [T, K] (read at ``gather_index[r]`` when given) in e4m3 with one fp32 scale
    per row: ``(values [R, K], scales [R])`` with ``values[r] * scales[r] ~= x[g(r)]``.
    ``values_out``: where the values go (e4m3 [R, K], each row contiguous; e.g. a view of a
    message's bytes), default a new tensor. ``limit``: a count on the device (0-dim
    integer): only rows below it are written, the rest left as they were (no host sync)."""
    rows = gather_index.shape[0] if gather_index is not None else x.shape[0]
    k = x.shape[1]
    if values_out is None:
        q = torch.empty((rows, k), device=x.device, dtype=E4M3)
    elif values_out.dtype != E4M3 or values_out.shape != (rows, k) or (rows and k > 1 and values_out.stride(1) != 1):
        raise ValueError(f"quantize_rows: values_out must be {E4M3} [{rows}, {k}] with contiguous rows, got "
                         f"{values_out.dtype} {tuple(values_out.shape)} strides {values_out.stride()}")
    else:
        q = values_out
    scale = torch.empty((rows,), device=x.device, dtype=torch.float32)
    if rows == 0:
        return QuantizedRows(q, scale)
    x = x if x.stride(-1) == 1 else x.contiguous()
    one_block = k <= QUANTIZE_ROW_ELEMENTS
    block_k = triton.next_power_of_2(max(k, 16)) if one_block else 1024
    block_r = max(1, min(16, QUANTIZE_ROW_ELEMENTS // block_k))
    _quantize_rows_kernel[(cdiv(rows, block_r),)](
        x, gather_index, q, scale, limit, rows, k, x.stride(0), q.stride(0),
        GATHER=gather_index is not None, LIMIT=limit is not None, BLOCK_R=block_r, BLOCK_K=block_k, ONE_BLOCK=one_block,
        FP8_MAX=E4M3_MAX, AMAX_FLOOR=MIN_AMAX, num_warps=8,
    )
    return QuantizedRows(q, scale)


def dequantize_rows(rows: QuantizedRows, dtype: torch.dtype, index: Optional[torch.Tensor] = None,
                    limit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``values[i] * scales[i]`` in ``dtype`` (the fp32 product rounded to ``dtype``) for each
    row i of ``index`` (default: every row, in order): [len(index), K], contiguous, in one
    pass that reads the e4m3 rows where they are (the rows' gather,
    :func:`~ep_moe.kernels.permute.launch_gather_rows`). ``limit``: a count on the device;
    only the rows below it are written."""
    values, scales = rows
    out = torch.empty((values.shape[0] if index is None else index.shape[0], values.shape[1]),
                      dtype=dtype, device=values.device)
    return launch_gather_rows(values, index, scales, out=out, limit=limit)


# amax_rows[e, n] = max_k |w[e, n, k]|, amax_cols[e, k] = max_n |w[e, n, k]| (both zeroed first).
# Tiling: one program per (expert, BLOCK_N x BLOCK_K tile); each tile's row and column maxima
#   go to both vectors with atomic max (order-free, so the result is deterministic).
# Fuses: both layouts' reductions into one read of the weight.
@triton.jit
def _weight_amax_kernel(w_ptr, amax_rows_ptr, amax_cols_ptr, N, K, stride_we, stride_wn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (ns < N)[:, None] & (ks < K)[None, :]
    v = tl.abs(tl.load(w_ptr + e * stride_we + ns[:, None] * stride_wn + ks[None, :], mask=ok, other=0.0)
               .to(tl.float32))
    tl.atomic_max(amax_rows_ptr + e * N + ns, tl.max(v, axis=1), mask=ns < N)
    tl.atomic_max(amax_cols_ptr + e * K + ks, tl.max(v, axis=0), mask=ks < K)


# q[e, n, k] = e4m3(w[e, n, k] / scale_rows[e, n]) and q_t[e, k, n] = e4m3(w[e, n, k] / scale_cols[e, k]),
#   scale = max(amax, AMAX_FLOOR) / FP8_MAX from _weight_amax_kernel's maxima.
# Tiling: one program per (expert, BLOCK_N x BLOCK_K tile), read once, stored twice (the second
#   transposed, so each layout is K-contiguous as the FP8 tensor cores read it).
# Fuses: both layouts' quantization and the transpose into one read of the weight.
@triton.jit
def _quantize_weight_kernel(w_ptr, amax_rows_ptr, amax_cols_ptr, q_ptr, q_t_ptr, N, K, stride_we, stride_wn,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                            AMAX_FLOOR: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (ns < N)[:, None] & (ks < K)[None, :]
    v = tl.load(w_ptr + e * stride_we + ns[:, None] * stride_wn + ks[None, :], mask=ok, other=0.0).to(tl.float32)
    scale_rows = scale_of(tl.load(amax_rows_ptr + e * N + ns, mask=ns < N, other=1.0), FP8_MAX, AMAX_FLOOR)
    scale_cols = scale_of(tl.load(amax_cols_ptr + e * K + ks, mask=ks < K, other=1.0), FP8_MAX, AMAX_FLOOR)
    q = on_e4m3_grid(tl.math.div_rn(v, scale_rows[:, None]))
    tl.store(q_ptr + e * N * K + ns[:, None] * K + ks[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    q_t = on_e4m3_grid(tl.math.div_rn(v, scale_cols[None, :]))
    tl.store(q_t_ptr + e * N * K + ks[None, :] * N + ns[:, None], q_t.to(q_t_ptr.dtype.element_ty), mask=ok)


def quantize_weight(w: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Both e4m3 copies of ``w`` [E, N, K] (any float dtype, K-contiguous rows): ``(forward,
    dx)``, forward ``(q [E, N, K], scale [E, N])`` scaled per (e, n) over K, dx ``(q [E, K, N],
    scale [E, K])`` scaled per (e, k) over N; each :func:`~ep_moe.kernels.e4m3.quantize_rows_reference` of its
    layout bit for bit, from two reads of ``w`` (the maxima of both layouts, then both stores)."""
    num_experts, n, k = w.shape
    w = w if w.stride(-1) == 1 else w.contiguous()
    amax_rows = torch.zeros((num_experts, n), device=w.device, dtype=torch.float32)
    amax_cols = torch.zeros((num_experts, k), device=w.device, dtype=torch.float32)
    q = torch.empty((num_experts, n, k), device=w.device, dtype=E4M3)
    q_t = torch.empty((num_experts, k, n), device=w.device, dtype=E4M3)
    if w.numel():
        block = 32 if interpreter_active() else 64
        grid = (num_experts, cdiv(n, block), cdiv(k, block))
        _weight_amax_kernel[grid](w, amax_rows, amax_cols, n, k, w.stride(0), w.stride(1),
                                  BLOCK_N=block, BLOCK_K=block, num_warps=4)
        _quantize_weight_kernel[grid](w, amax_rows, amax_cols, q, q_t, n, k, w.stride(0), w.stride(1),
                                      BLOCK_N=block, BLOCK_K=block, FP8_MAX=E4M3_MAX, AMAX_FLOOR=MIN_AMAX,
                                      num_warps=4)
    scale = amax_rows.clamp_min_(MIN_AMAX).mul_(1.0 / E4M3_MAX)
    scale_t = amax_cols.clamp_min_(MIN_AMAX).mul_(1.0 / E4M3_MAX)
    return (q, scale), (q_t, scale_t)


class QuantizedWeight:
    """A weight [E, N, K] in e4m3 for both passes: ``forward`` ([E, N, K] scaled per (e, n))
    and ``dx`` ([E, K, N] scaled per (e, k)), each a (values, scales) pair, made from one
    version of the weight by :func:`quantize_weight` (``version``: what :func:`quantized_weight`
    compares; None: not cached)."""

    __slots__ = ("version", "forward", "dx")

    def __init__(self, w: torch.Tensor, version: Optional[tuple[int, int]] = None):
        self.version = version
        self.forward, self.dx = quantize_weight(w.detach())


_QUANTIZED = WeakIdKeyDictionary()
"""A weight's storage owner (the tensor, or the base of a view) -> {the view's geometry:
:class:`QuantizedWeight`}, dropped with the owner."""
_optimizer_steps = 0
"""Steps of any ``torch.optim`` optimizer in this process (counted by a global step hook)."""
_step_hook = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def quantized_weight(w: torch.Tensor) -> QuantizedWeight:
    """``w``'s e4m3 copies, made once per version of ``w``, keyed on the tensor ``w`` itself,
    or for a view (a transposed layout's, made per call) on its base and its geometry: pass the
    parameter or a view of it, not a cast of it made per call. They are made again after an
    in-place update of ``w`` (its version counter moves) or a step of any ``torch.optim``
    optimizer (counted by a global step hook, registered on the first call): FSDP2 writes
    the all-gathered values into its unsharded parameters without moving their version,
    and DeepSpeed's ZeRO through ``.data``. Calls between steps (layers that share a weight,
    gradient accumulation, activation checkpointing's recompute) reuse them. Weights
    changed otherwise without a version bump (``.data`` outside an optimizer) need
    :func:`forget_quantized_weights`.

    Not cached (made on every call) inside a CUDA graph capture, so that each replay
    quantizes the weights as they are then, and for inference tensors (no version)."""
    global _step_hook
    if w.is_inference() or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return QuantizedWeight(w)
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_optimizer_step)
    version = (w._version, _optimizer_steps)
    owner = w if w._base is None else w._base  # a view made per call (a transposed layout) is keyed on its base
    views = _QUANTIZED.get(owner)
    if views is None:
        views = _QUANTIZED[owner] = {}
    geometry = (tuple(w.shape), w.stride(), w.storage_offset(), w.dtype)
    held = views.get(geometry)
    if held is None or held.version != version:
        held = views[geometry] = QuantizedWeight(w, version)
    return held


def forget_quantized_weights() -> None:
    """Drop every weight's cached e4m3 copies (:func:`quantized_weight` makes them again)."""
    _QUANTIZED.clear()


def _forward(qw: QuantizedWeight, x_rows: QuantizedRows, x, w, m_sizes, gather_index, scatter_index, row_weights,
             config, dx_mode, bounded_rows, bias, dx_slots) -> torch.Tensor:
    """The forward of ``ep_moe::grouped_gemm_fwd`` (same inputs) on e4m3 operands: x's rows
    as ``x_rows`` holds them (x itself is not read), gathered, the product scattered, its row
    weights and bias applied after the scales (``w`` is not read either: ``qw`` holds its
    copies)."""
    w_values, w_scale = qw.forward
    out = x.new_empty((x.shape[0] if gather_index is None else gather_index.shape[0], w_values.shape[1]))
    if out.shape[0]:
        launch_rows(x_rows.values, w_values, out, m_sizes, configs_from_ints(tuple(config)).forward,
                    transpose_w=True, load_idx=gather_index, store_idx=scatter_index, scale=row_weights, bias=bias,
                    fp8_scales=(x_rows.scales, w_scale))
    return out


def _bias_share(dy: torch.Tensor, bias: torch.Tensor, m_sizes: torch.Tensor, scatter_index: Optional[torch.Tensor],
                bounded_rows: bool) -> torch.Tensor:
    """``dy[o] . bias[e]`` for each output row o (of expert e), fp32: the bias's share of the
    row weight's gradient (0 past the counts with ``bounded_rows``)."""
    rows = dy if scatter_index is None else dy.index_select(0, scatter_index)  # in expert order
    ends = torch.cumsum(m_sizes, 0, dtype=torch.int64)
    routed = torch.arange(rows.shape[0], device=dy.device)
    expert = torch.searchsorted(ends, routed, right=True).clamp_max(bias.shape[0] - 1)
    share = (rows.float() @ bias.float().T).gather(1, expert[:, None]).squeeze(1)
    if bounded_rows:
        share = share.masked_fill(routed >= ends[-1], 0.0)
    if scatter_index is None:
        return share
    return torch.empty_like(share).index_copy_(0, scatter_index.long(), share)


def _grad_input_fp8(qw: QuantizedWeight, dy, x, w, m_sizes, gather_index, scatter_index, row_weights, config,
                    dx_mode, need_drw, bounded_rows=False, bias=None, dx_slots=None):
    """:func:`ep_moe.kernels.ops._grad_input` on e4m3 operands: ``dy`` quantized per row, the
    weight's dX copy. The row weights' gradient is the dot of that product with x's rows (so
    it carries the dX's quantization; for gathered rows x is their e4m3 values dequantized),
    plus the bias's share from the unquantized ``dy``."""
    dq, dq_scale = quantize_rows(dy)
    w_values, w_scale = qw.dx
    dx, drw = _grad_input(dq, x, w_values, m_sizes, gather_index, scatter_index, row_weights, config, dx_mode,
                          need_drw, bounded_rows, dx_slots=dx_slots, fp8_scales=(dq_scale, w_scale))
    if bias is not None and drw is not None:
        drw = drw + _bias_share(dy, bias, m_sizes, scatter_index, bounded_rows)
    return dx, drw


class _GroupedGemmFP8(torch.autograd.Function):
    """The grouped GEMM's eager autograd function (:mod:`ep_moe.kernels.ops`: the inputs of
    ``ep_moe::grouped_gemm_fwd``, then the weight's :class:`QuantizedWeight` and x's rows in
    e4m3) with e4m3 operands in the forward and the dX; dW and the bias's gradient as the
    bf16 GEMM's, queued where an open ``defer_weight_grads`` queue owns the weight, against
    the e4m3 rows dequantized where the forward gathered them (the module docstring)."""

    @staticmethod
    def forward(ctx, *inputs_weight_and_rows):
        *inputs, qw, x_rows = inputs_weight_and_rows
        out = _forward(qw, x_rows, *inputs)
        if inputs[3] is None:
            _setup_context(ctx, inputs, out)
        else:  # gathered rows: the backward reads their e4m3 values, so x itself is not kept
            x = inputs[0]
            _setup_context(ctx, (x.new_empty((0, x.shape[1])), *inputs[1:]), out, extra=tuple(x_rows))
        ctx.quantized_weight = qw
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        saved = ctx.saved_tensors  # once: an activation checkpoint's unpack hook allows one
        gather_x = None
        if len(saved) > _SAVED:
            rows, dtype = QuantizedRows(*saved[_SAVED:]), saved[0].dtype
            if ctx.needs_input_grad[5]:  # the row weights' dots read every row's values
                x = dequantize_rows(rows, dtype)
            else:  # dX reads x's shape only; dW gathers the e4m3 rows, dequantized as it gathers them
                x = saved[0].new_zeros((1, rows.values.shape[1])).expand(rows.values.shape)
                gather_x = functools.partial(dequantize_rows, rows, dtype)
            saved = (x, *saved[1:_SAVED])
        grads = eager_backward(ctx, dy, functools.partial(_grad_input_fp8, ctx.quantized_weight), saved=saved,
                               gather_x=gather_x)
        return (*grads, None, None)


def _run(qw: QuantizedWeight, x, w, m_sizes, gather_index, scatter_index, row_weights, bias, configs: GemmConfigs,
         dx_mode: str, bounded_rows: bool, dx_slots, x_rows: Optional[QuantizedRows] = None) -> torch.Tensor:
    """:func:`grouped_gemm_fp8` and :func:`layer_grouped_gemm_fp8` on checked arguments
    (``x_rows``: x's rows already in e4m3, else quantized here, once each)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    inputs = (x, w, _as_int32(m_sizes), _contiguous(gather_index), _contiguous(scatter_index),
              _contiguous(row_weights), configs_to_ints(configs), dx_mode, bounded_rows, _contiguous(bias),
              _contiguous(dx_slots))
    x_rows = quantize_rows(x) if x_rows is None else x_rows
    if not torch.is_grad_enabled():
        return _forward(qw, x_rows, *inputs)
    return _GroupedGemmFP8.apply(*inputs, qw, x_rows)


@eager_or_graph_break
def grouped_gemm_fp8(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *,
                     gather_index: Optional[torch.Tensor] = None, scatter_index: Optional[torch.Tensor] = None,
                     row_weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                     configs: Optional[tuple[KernelConfig, KernelConfig, KernelConfig]] = None) -> torch.Tensor:
    """:func:`ep_moe.grouped_gemm`'s product, ``out[s(r)] = row_weights[s(r)] * (x[g(r)] @
    w[e(r)]^T + bias[e(r)])`` for rows sorted by expert (``m_sizes`` [E] rows each, int32),
    with e4m3 operands in the forward and the dX (the recipe in this module's docstring) and
    a bf16 dW; differentiable in ``x``, ``w``, ``row_weights`` and ``bias``.

    ``x`` [T, K] bf16 or fp16 (read at ``gather_index[r]`` when given, else T = rows; rows
    read several times get their gradients summed in a fixed order); ``w`` [E, N, K] in x's
    dtype or float32 (master weights: quantized as they are, once per version, see
    :func:`quantized_weight`; the gradient comes in w's dtype); ``scatter_index`` [rows], a
    permutation: row r lands at ``scatter_index[r]``; ``row_weights`` [rows] (fp32, indexed by
    output row, multiplied after the scales: the top-k weights; their gradient carries the
    dX's quantization, :func:`_grad_input_fp8`); ``bias`` [E, N] in w's dtype. Gathered rows
    are quantized once each and enter the backward (dW, the row weights' gradient) as their
    e4m3 values (the module docstring).
    ``configs``: the (forward, dx, dw) kernel configs, default :func:`fp8_gemm_configs`.
    Raises where the device has no FP8 tensor cores.
    """
    ok, why = fp8_supported(x.device)
    if not ok:
        raise RuntimeError(f"grouped_gemm_fp8: {why}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"grouped_gemm_fp8: x must be bfloat16 or float16 and w of x's dtype or float32 (master "
                        f"weights, quantized as they are), got x {x.dtype} and w {w.dtype}")
    if w.dim() != 3 or x.dim() != 2 or w.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_gemm_fp8: w must be [E, N, K] and x [T, K], got w {tuple(w.shape)} and "
                         f"x {tuple(x.shape)}")
    if m_sizes.dtype != torch.int32 or m_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm_fp8: m_sizes must be int32 [E] = [{w.shape[0]}], got "
                         f"{m_sizes.dtype} {tuple(m_sizes.shape)}")
    _validate(x, w, m_sizes, gather_index, scatter_index, row_weights, debug_enabled(), False, bias,
              fp32_weights=True)
    gemm_configs = GemmConfigs(*configs) if configs is not None else fp8_gemm_configs(x.device, x.dtype)
    return _run(quantized_weight(w), x, w, m_sizes, gather_index, scatter_index, row_weights, bias, gemm_configs,
                "sort", False, None)


_FP8_GPUS: set[int] = set()
"""Indices of the CUDA devices :func:`fp8_supported` accepted (checked once each)."""


@eager_or_graph_break
def layer_grouped_gemm_fp8(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *,
                           weight: Optional[torch.Tensor] = None, gather_index: Optional[torch.Tensor] = None,
                           scatter_index: Optional[torch.Tensor] = None, row_weights: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None, configs: Optional[GemmConfigs] = None,
                           bounded_rows: bool = False, gather_slots: Optional[torch.Tensor] = None,
                           quantized_rows: Optional[QuantizedRows] = None) -> torch.Tensor:
    """:func:`ep_moe.kernels.ops.layer_grouped_gemm` (the Triton backend, deterministic) with
    :func:`grouped_gemm_fp8`'s e4m3 operands: what :func:`ep_moe.experts.expert_mlp` runs for
    ``MoEConfig(expert_precision="fp8")``. ``weight``: the tensor whose e4m3 copies the GEMM
    multiplies by (:func:`quantized_weight`, cached on it), default ``w``; the layer passes its
    parameter there, while ``w`` is what the weight's gradient goes to (the parameter, or the
    expert pipeline's stand-in for it, maybe a cast). ``x`` any float dtype the grouped GEMM
    takes, ``w`` and ``bias`` in it or float32. ``quantized_rows``: x's rows already in e4m3
    (as :func:`quantize_rows` makes them: rows that arrived so from another rank,
    :mod:`ep_moe.ep.fp8_wire`), which the GEMM reads instead of x; x then only stands for them
    in autograd (it takes their gradient; its values are not read). Arguments checked where
    the value checks run (the CPU, ``EP_MOE_DEBUG``), as
    :func:`~ep_moe.kernels.ops.layer_grouped_gemm`'s; raises where the device has no FP8
    tensor cores."""
    if not (x.device.type == "cuda" and x.device.index in _FP8_GPUS):
        ok, why = fp8_supported(x.device)
        if not ok:
            raise RuntimeError(f"FP8 experts (expert_precision='fp8'): {why}")
        if x.device.type == "cuda":
            _FP8_GPUS.add(x.device.index)
    source = w if weight is None else weight
    if source.shape != w.shape:
        raise ValueError(f"layer_grouped_gemm_fp8: weight {tuple(source.shape)} must have w's shape {tuple(w.shape)}")
    if quantized_rows is not None:
        _check_quantized_rows(quantized_rows, x, gather_index)
    if value_checks(x.device):
        _validate(x, w, m_sizes, gather_index, scatter_index, row_weights, True, bounded_rows, bias, fp32_weights=True)
        _check_gather_slots(gather_slots, gather_index, x.shape[0], bounded_rows)
    return _run(quantized_weight(source), x, w, m_sizes, gather_index, scatter_index, row_weights, bias,
                configs or fp8_gemm_configs(x.device, x.dtype), "sort" if gather_slots is None else "slots",
                bounded_rows, gather_slots, quantized_rows)


def _check_quantized_rows(rows: QuantizedRows, x: torch.Tensor, gather_index: Optional[torch.Tensor]) -> None:
    """``rows`` can stand for ``x``'s rows: e4m3 values of x's shape, contiguous along each
    row, and one contiguous fp32 scale per row, on x's device; rows the GEMM gathers (whose
    e4m3 values its backward reads, :func:`_GroupedGemmFP8.backward`)."""
    if gather_index is None:
        raise ValueError("layer_grouped_gemm_fp8: quantized_rows are token rows the GEMM gathers; pass their "
                         "gather_index")
    values, scales = rows
    if (values.dtype != E4M3 or values.shape != x.shape or (values.shape[1] > 1 and values.stride(1) != 1)
            or scales.dtype != torch.float32 or scales.shape != x.shape[:1] or not scales.is_contiguous()
            or values.device != x.device or scales.device != x.device):
        raise ValueError(f"layer_grouped_gemm_fp8: quantized_rows must be {E4M3} values of x's shape "
                         f"{tuple(x.shape)} (contiguous rows) and contiguous float32 scales [{x.shape[0]}] on "
                         f"{x.device}, as quantize_rows makes them; got {values.dtype} {tuple(values.shape)} "
                         f"strides {values.stride()} and {scales.dtype} {tuple(scales.shape)} on {values.device}")


@eager_or_graph_break  # device queries: run eagerly, the configs enter as constants
def fp8_gemm_configs(device: torch.device, dtype: torch.dtype) -> GemmConfigs:
    """The (forward, dx, dw) kernel configs of the FP8 GEMMs on ``device`` with rows of
    ``dtype``: 128-wide K steps (one e4m3 byte per value, so a 128-byte row per stage as
    bf16's 64), B through TMA, dW in ``dtype``; fitted to the device's shared memory (fewer
    stages, then shorter reduction steps: an Ada GPU has less than Hopper's); small blocks in
    the interpreter. Not autotuned yet."""
    return _fitted_configs(interpreter_active(), smem_limit_for(device), dtype.itemsize)


@functools.lru_cache(maxsize=None)
def _fitted_configs(interpreted: bool, smem_limit: int, row_bytes: int) -> GemmConfigs:
    if interpreted:
        small = KernelConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
        return GemmConfigs(forward=small, dx=small, dw=small)
    rows = KernelConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, use_tma=True)
    return GemmConfigs(forward=fit_to_smem(rows, "forward", 1, smem_limit), dx=fit_to_smem(rows, "dx", 1, smem_limit),
                       dw=fit_to_smem(DEFAULT_CONFIGS["dw"], "dw", row_bytes, smem_limit))
