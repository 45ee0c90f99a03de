"""The public grouped GEMM op: validation, autograd, and the registered custom ops.

``grouped_gemm`` checks its arguments, then runs either the Triton kernels or the
plain-PyTorch reference. Under ``torch.compile`` the kernels run through two
``torch.library`` custom ops, ``ep_moe::grouped_gemm_fwd`` and ``ep_moe::grouped_gemm_bwd``
(wired together with ``register_autograd``, with fake implementations), so Dynamo traces
models that use them while the kernels stay opaque to Inductor, which keeps the persistent
launch and TMA descriptors out of its tracing. In eager mode the same implementations run
through a plain ``autograd.Function``: the custom-op dispatch costs tens of microseconds
of host time per call (``benchmarks/PERFORMANCE_LOG.md``), which an EP layer, whose host sync leaves the GPU waiting for the host,
pays in full.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Literal, Optional, Protocol, Union

import torch
from torch.autograd.function import once_differentiable

from ep_moe.kernels.arrival import take_departure
from ep_moe.kernels.config import GemmConfigs, KernelConfig, configs_from_ints, configs_to_ints
from ep_moe.kernels.grouped_gemm import (
    eager_or_graph_break,
    interpreter_active,
    launch_dw,
    launch_rows,
    launch_segment_sum,
    smem_limit_for,
)
from ep_moe.kernels.permute import launch_gather_rows, launch_sum_slot_rows
from ep_moe.kernels.reference import grouped_gemm_reference

Backend = Literal["auto", "triton", "torch"]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
def _routed_rows(x: torch.Tensor, gather_index: Optional[torch.Tensor]) -> int:
    return gather_index.shape[0] if gather_index is not None else x.shape[0]


def _as_int32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _fwd_impl(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    gather_index: Optional[torch.Tensor],
    scatter_index: Optional[torch.Tensor],
    row_weights: Optional[torch.Tensor],
    config: list[int],
    dx_mode: str,
    bounded_rows: bool,
    bias: Optional[torch.Tensor],
    dx_slots: Optional[torch.Tensor],
) -> torch.Tensor:
    out = x.new_empty((_routed_rows(x, gather_index), w.shape[1]))
    launch_rows(
        x, w, out, m_sizes, configs_from_ints(tuple(config)).forward, transpose_w=True,
        load_idx=gather_index, store_idx=scatter_index, scale=row_weights, bias=bias,
    )
    return out


_grouped_gemm_fwd = torch.library.custom_op("ep_moe::grouped_gemm_fwd", mutates_args=())(_fwd_impl)


@_grouped_gemm_fwd.register_fake
def _grouped_gemm_fwd_fake(x, w, m_sizes, gather_index, scatter_index, row_weights, config, dx_mode, bounded_rows,
                           bias, dx_slots):
    return x.new_empty((_routed_rows(x, gather_index), w.shape[1]))


def _grads(dy, x, w, m_sizes, gather_index, scatter_index, row_weights, config, dx_mode, bounded_rows,
           need_dx, need_dw, need_drw, bias, need_db, dx_slots, grad_input=None, gather_x=None):
    """(dx, dw, d row_weights, d bias), None for a gradient not asked for (the eager backward's;
    the custom op's, :func:`_bwd_impl`, returns empty tensors instead). ``grad_input``: what
    computes dX and the row weights' gradient, default :func:`_grad_input`; ``gather_x``: what
    gathers x's rows for dW (:func:`_grad_weight`). The FP8 GEMM passes its own dX, and for
    the tokens it gathers in e4m3 their gather, dequantizing (:mod:`ep_moe.kernels.fp8`)."""
    configs = configs_from_ints(tuple(config))
    dx = dw = drw = db = None
    if need_dx or need_drw:
        dx, drw_f32 = (grad_input or _grad_input)(dy, x, w, m_sizes, gather_index, scatter_index, row_weights,
                                                  configs.dx, dx_mode, need_drw, bounded_rows,
                                                  bias if need_drw else None, dx_slots)
        if need_drw:
            drw = drw_f32.to(row_weights.dtype)
    if need_dw or need_db:
        grads = _grad_weight(dy, x, w, m_sizes, gather_index, scatter_index, row_weights, configs.dw,
                             bounded_rows=bounded_rows, bias=bias if need_db else None, need_dw=need_dw,
                             gather_x=gather_x)
        if not need_db:
            dw = grads
        elif need_dw:
            dw, db = grads
        else:
            db = grads[1]
    return dx, dw, drw, db


def _bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    gather_index: Optional[torch.Tensor],
    scatter_index: Optional[torch.Tensor],
    row_weights: Optional[torch.Tensor],
    config: list[int],
    dx_mode: str,
    bounded_rows: bool,
    need_dx: bool,
    need_dw: bool,
    need_drw: bool,
    bias: Optional[torch.Tensor],
    need_db: bool,
    dx_slots: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, d row_weights, d bias); a gradient not asked for comes back as an empty tensor."""
    grads = _grads(dy, x, w, m_sizes, gather_index, scatter_index, row_weights, config, dx_mode, bounded_rows,
                   need_dx, need_dw, need_drw, bias, need_db, dx_slots)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


_grouped_gemm_bwd = torch.library.custom_op("ep_moe::grouped_gemm_bwd", mutates_args=())(_bwd_impl)


@_grouped_gemm_bwd.register_fake
def _grouped_gemm_bwd_fake(dy, x, w, m_sizes, gather_index, scatter_index, row_weights, config,
                           dx_mode, bounded_rows, need_dx, need_dw, need_drw, bias, need_db, dx_slots):
    # the kernels' allocations, strides included (a weight stored transposed gets its dW so)
    dx = torch.empty_like(x) if (need_dx or need_drw) else x.new_empty(0)
    dw = torch.empty_like(w) if need_dw else w.new_empty(0)
    drw = row_weights.new_empty(row_weights.shape) if need_drw else x.new_empty(0)
    db = bias.new_empty(bias.shape) if need_db else x.new_empty(0)
    return dx, dw, drw, db


def _grad_weight(dy, x, w, m_sizes, gather_index, scatter_index, row_weights, config: KernelConfig,
                 add_to=None, bounded_rows: bool = False, bias: Optional[torch.Tensor] = None,
                 need_dw: bool = True, gather_x=None):
    """dW on expert-ordered rows gathered (and weighted) first (:func:`_expert_rows_grads`);
    with ``bias``, the pair (dW, db), dW None without ``need_dw``. ``bounded_rows``: only
    the counted rows are gathered (the kernels read no others). ``gather_x(gather_index,
    limit)``: x's rows in that order, where x itself is not what they are made from (default
    :func:`~ep_moe.kernels.permute.launch_gather_rows` of x)."""
    limit = m_sizes.sum() if bounded_rows else None
    weighted = scatter_index is not None or row_weights is not None
    dy_rows = launch_gather_rows(dy, scatter_index, row_weights, limit=limit) if weighted else dy
    if not need_dw:
        return None, _bias_grad(dy_rows, m_sizes, bias)
    if gather_index is None:
        x_rows = x
    elif gather_x is not None:
        x_rows = gather_x(gather_index, limit)
    else:
        x_rows = launch_gather_rows(x, gather_index, limit=limit)
    return _expert_rows_grads(dy_rows, x_rows, w, m_sizes, config, bias, add_to)


def _expert_rows_grads(dy_rows, x_rows, w, m_sizes, config: KernelConfig, bias: Optional[torch.Tensor],
                       add_to=None):
    """dW of expert-ordered rows through the dW kernel; with ``bias``, (dW, db), db from
    :func:`_bias_grad`. ``add_to`` (what this returns): added to in place instead of new tensors."""
    held_dw, held_db = (add_to, None) if bias is None or add_to is None else add_to
    dw = torch.empty_like(w) if held_dw is None else held_dw
    launch_dw(dy_rows, x_rows, dw, m_sizes, config, accumulate=held_dw is not None)
    if bias is None:
        return dw
    db = _bias_grad(dy_rows, m_sizes, bias)
    return dw, (db if held_db is None else held_db.add_(db))


BIAS_GRAD_ROWS_PER_STEP = 32
"""Rows of dy each program of the bias gradient's segment sum reads at once (measured on H200,
qwen3-30b-a3b's down projection at 8192 tokens: see the performance log)."""


def _bias_grad(dy_rows: torch.Tensor, m_sizes: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """db: each expert's column sums of its expert-ordered, weighted rows of dy (a segment
    sum), in the bias's dtype."""
    offsets = torch.cat([m_sizes.new_zeros(1), torch.cumsum(m_sizes, 0)])
    db = torch.empty_like(bias)
    launch_segment_sum(dy_rows, offsets, db, rows_per_step=BIAS_GRAD_ROWS_PER_STEP)
    return db


def _grad_input(dy, x, w, m_sizes, gather_index, scatter_index, row_weights, config,
                dx_mode, need_drw, bounded_rows=False, bias=None, dx_slots=None, fp8_scales=None):
    """dX through the row kernel. Rows of a gathered x: ``dx_mode`` "unique" (each row read
    at most once) stores straight through the index; "sort" sums repeated rows without
    float atomics (sorted by destination, then a segment sum); "slots" (every row of x read
    exactly K times, routed row r being slot ``dx_slots[r]`` of row ``dx_slots[r] // K``)
    stores each row at its slot and sums each row's K slots, in slot order; "atomic" adds
    in fp32.
    ``bounded_rows``: rows past ``m_sizes.sum()`` (not computed) add nothing, and their
    row-weight gradients are 0. ``bias`` (with ``need_drw``): the forward's bias, whose
    share of the row-weight gradient the kernel adds. ``fp8_scales=(dy_scale, w_scale)``:
    ``dy`` and ``w`` hold e4m3 values, ``w`` in the dX layout [E, K, N]
    (:class:`ep_moe.kernels.fp8.QuantizedWeight`), their scales multiplied in the epilogue
    (no ``bias`` then: the kernel's bias dot reads the unscaled rows)."""
    common = dict(transpose_w=fp8_scales is not None, load_idx=scatter_index, scale=row_weights,
                  scale_by_load_row=True, dot_with=x if need_drw else None, dot_idx=gather_index, bias=bias,
                  fp8_scales=fp8_scales)
    num_rows = _routed_rows(x, gather_index)
    past = (torch.arange(num_rows, device=x.device) >= m_sizes.sum()) if bounded_rows else None
    dx, drw = _grad_input_rows(dy, x, w, m_sizes, gather_index, config, dx_mode, common, past, dx_slots)
    if past is not None and drw is not None:
        drw.masked_fill_(past, 0.0)
    return dx, drw


def _grad_input_rows(dy, x, w, m_sizes, gather_index, config, dx_mode, common, past, dx_slots):
    """:func:`_grad_input`'s dX and fp32 row-weight gradient (rows ``past`` the counts,
    when given, left out of dX)."""
    if gather_index is None:
        dx = torch.empty_like(x) if past is None else torch.zeros_like(x)
        drw = launch_rows(dy, w, dx, m_sizes, config, **common)
        return dx, drw
    num_rows = gather_index.shape[0]
    if dx_mode == "unique":
        covered = num_rows == x.shape[0] and past is None  # a permutation writes every row; else unread rows are 0
        dx = torch.empty_like(x) if covered else torch.zeros_like(x)
        drw = launch_rows(dy, w, dx, m_sizes, config, store_idx=gather_index, **common)
        return dx, drw
    if dx_mode == "slots" and past is None and num_rows:
        # no sort: the slots are token-major, each row of x owns K consecutive ones
        rows_by_slot = x.new_empty((num_rows, x.shape[1]))
        drw = launch_rows(dy, w, rows_by_slot, m_sizes, config, store_idx=dx_slots, **common)
        slots = rows_by_slot.view(x.shape[0], num_rows // x.shape[0], x.shape[1])
        return slots.sum(dim=1, dtype=torch.float32).to(x.dtype), drw
    if dx_mode in ("sort", "slots"):
        # Rows sorted by destination (stable), and each destination's first row: no host
        # sync (bincount would read the max index), so this also runs in a CUDA graph.
        # Rows past the counts sort after every destination, outside every segment.
        dest = gather_index if past is None else gather_index.masked_fill(past, x.shape[0])
        sorted_dest, order = torch.sort(dest, stable=True)
        position = torch.empty_like(order)
        position[order] = torch.arange(num_rows, device=order.device, dtype=order.dtype)
        rows_by_dest = x.new_empty((num_rows, x.shape[1]))
        drw = launch_rows(dy, w, rows_by_dest, m_sizes, config, store_idx=position, **common)
        offsets = torch.searchsorted(sorted_dest, torch.arange(x.shape[0] + 1, device=x.device,
                                                               dtype=sorted_dest.dtype))
        dx = torch.empty_like(x)
        launch_segment_sum(rows_by_dest, offsets, dx)
        return dx, drw
    rows = torch.empty((num_rows, x.shape[1]), device=x.device, dtype=torch.float32)
    drw = launch_rows(dy, w, rows, m_sizes, config, **common)
    if past is not None:
        rows.masked_fill_(past[:, None], 0.0)
    dx = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    dx.index_add_(0, gather_index.long(), rows)
    return dx.to(x.dtype), drw


_BIAS_ARG = 9
"""Position of ``bias`` among the forward op's inputs."""
_SAVED = 8
"""Tensors the op saves: x, w, m_sizes, gather_index, scatter_index, row_weights, bias, dx_slots."""


def _setup_context(ctx, inputs, output, extra: tuple = ()):
    """Saves the tensors the backward reads (then ``extra``, a caller's own: after the
    :data:`_SAVED` of the op's) and the op's settings in ``ctx``."""
    x, w, m_sizes, gather_index, scatter_index, row_weights, config, dx_mode, bounded_rows, bias, dx_slots = inputs
    ctx.save_for_backward(x, w, m_sizes, gather_index, scatter_index, row_weights, bias, dx_slots, *extra)
    ctx.config = config
    ctx.dx_mode = dx_mode
    ctx.bounded_rows = bounded_rows


def _backward_with(bwd, ctx, dy, defer_dw: bool = False, saved=None):
    """The op's gradients through ``bwd``; ``defer_dw``: dW and db are queued elsewhere."""
    x, w, m_sizes, gather_index, scatter_index, row_weights, bias, dx_slots = \
        ctx.saved_tensors if saved is None else saved
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and not defer_dw
    need_drw = row_weights is not None and ctx.needs_input_grad[5]
    need_db = bias is not None and ctx.needs_input_grad[_BIAS_ARG] and not defer_dw
    dx, dw, drw, db = bwd(
        dy.contiguous(), x, w, m_sizes, gather_index, scatter_index, row_weights,
        ctx.config, ctx.dx_mode, ctx.bounded_rows, need_dx, need_dw, need_drw, bias, need_db, dx_slots,
    )
    return (dx if need_dx else None, dw if need_dw else None, None, None, None,
            drw if need_drw else None, None, None, None, db if need_db else None, None)


def _backward(ctx, dy):
    return _backward_with(torch.ops.ep_moe.grouped_gemm_bwd, ctx, dy)


_grouped_gemm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerGroupedGemm(torch.autograd.Function):
    """The custom ops' forward and backward without the custom-op dispatch (eager mode)."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return eager_backward(ctx, dy)


def eager_backward(ctx, dy, grad_input=None, saved: Optional[tuple] = None, gather_x=None):
    """The eager backward of a grouped GEMM whose context :func:`_setup_context` filled (its
    inputs those of ``ep_moe::grouped_gemm_fwd``), through :func:`_grads` with ``grad_input``
    and ``gather_x`` (defaults: :func:`_grad_input`, x's rows gathered); the weight's gradient
    queued where an open :func:`defer_weight_grads` queue owns the weight. ``saved``: the op's
    :data:`_SAVED` tensors as the caller has unpacked them (default: ``ctx.saved_tensors``)."""
    grads = functools.partial(_grads, grad_input=grad_input, gather_x=gather_x)
    if saved is None:
        saved = ctx.saved_tensors  # once: an activation checkpoint's unpack hook allows one
    x, w, m_sizes, gather_index, scatter_index, row_weights, bias, _ = saved
    with_bias = bias is not None and ctx.needs_input_grad[_BIAS_ARG]
    queue = _queue_for(w, bias if with_bias else None) if ctx.needs_input_grad[1] else None
    if queue is None:
        return _backward_with(grads, ctx, dy, saved=saved)
    dy = dy.contiguous()
    config = configs_from_ints(tuple(ctx.config)).dw
    bounded_rows, bias = ctx.bounded_rows, bias if with_bias else None
    queue.add((w, bias) if with_bias else w,
              lambda add_to: _grad_weight(dy, x, w, m_sizes, gather_index, scatter_index, row_weights,
                                          config, add_to, bounded_rows, bias, gather_x=gather_x))
    return _backward_with(grads, ctx, dy, defer_dw=True, saved=saved)


class _GemmSlotSum(torch.autograd.Function):
    """:func:`grouped_gemm_slot_sum`'s forward and backward (Triton)."""

    @staticmethod
    def forward(ctx, a, w, m_sizes, row_weights, token_index, row_of_slot, top_k, configs, bounded_rows,
                source_ends, departure, bias):
        rows = a.new_empty((a.shape[0], w.shape[1]))
        ctx.save_for_backward(a, w, m_sizes, row_weights, token_index, bias)
        ctx.configs, ctx.bounded_rows = configs, bounded_rows
        if departure is None:
            launch_rows(a, w, rows, m_sizes, configs.forward, transpose_w=True, scale=row_weights, bias=bias)
            return launch_sum_slot_rows(rows, row_of_slot, top_k)
        for position in departure.order:  # each source's rows, summed, then handed on
            launch_rows(a, w, rows, m_sizes, configs.forward, transpose_w=True, scale=row_weights, bias=bias,
                        source_window=(source_ends, position))
            tokens = departure.tokens(position)
            launch_sum_slot_rows(rows, row_of_slot[tokens.start * top_k: tokens.stop * top_k], top_k,
                                 out=departure.out[tokens])
            departure.send(position)
        return departure.out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        a, w, m_sizes, row_weights, token_index, bias = ctx.saved_tensors
        need_da, need_dw, need_drw = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]
        need_db = bias is not None and ctx.needs_input_grad[11]  # bias, the last input
        dy = dy.contiguous()
        da = drw = dw = db = None
        if need_da or need_drw:  # each routed row loads its token's gradient row
            da = torch.empty_like(a)
            drw = launch_rows(dy, w, da, m_sizes, ctx.configs.dx, transpose_w=False, load_idx=token_index,
                              scale=row_weights, per_routed_row=True, dot_with=a if need_drw else None,
                              bias=bias if need_drw else None)
            if ctx.bounded_rows and need_drw:  # rows past the counts were not computed
                drw.masked_fill_(torch.arange(drw.shape[0], device=drw.device) >= m_sizes.sum(), 0.0)
        if need_dw or need_db:
            config, bounded_rows, grad_bias = ctx.configs.dw, ctx.bounded_rows, bias if need_db else None

            def weighted_rows() -> torch.Tensor:
                return launch_gather_rows(dy, token_index, row_weights, scale_by_out_row=True,
                                          limit=m_sizes.sum() if bounded_rows else None)

            queue = _queue_for(w, grad_bias) if need_dw else None
            if not need_dw:
                db = _bias_grad(weighted_rows(), m_sizes, bias)
            elif queue is None:
                grads = _expert_rows_grads(weighted_rows(), a, w, m_sizes, config, grad_bias)
                dw, db = grads if need_db else (grads, None)
            else:
                queue.add((w, grad_bias) if need_db else w,
                          lambda add_to: _expert_rows_grads(weighted_rows(), a, w, m_sizes, config, grad_bias, add_to))
        return (da if need_da else None, dw, None, drw.to(row_weights.dtype) if need_drw else None,
                None, None, None, None, None, None, None, db)


@eager_or_graph_break  # eager only: its autograd.Function is not a custom op
def grouped_gemm_slot_sum(a: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, row_weights: torch.Tensor,
                          token_index: torch.Tensor, row_of_slot: torch.Tensor, top_k: int,
                          configs: Optional[GemmConfigs] = None, bounded_rows: bool = False,
                          source_ends: Optional[torch.Tensor] = None,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed rows through their experts, weighted, then summed per token over its slots
    (Triton; the EP receiver's down projection and slot sum):
    ``out[t] = sum_k row_weights[r] * (a[r] @ w[e(r)]^T + bias[e(r)])`` for ``r =
    row_of_slot[t*K + k]`` (-1 skipped; no bias term without ``bias`` [E, N]), [T, N],
    T = ``len(row_of_slot) / top_k``.

    ``a`` [M, K] is in expert order (``m_sizes`` rows each), ``row_weights`` [M] belongs to
    each routed row, ``token_index`` [M] gives each routed row's token (the inverse of
    ``row_of_slot``). Same result as :func:`grouped_gemm` with ``row_weights`` followed by
    :func:`ep_moe.kernels.permute.sum_slot_rows`, but the backward reads the [T, N]
    gradient through ``token_index`` (dA in the kernel's loads, the dW operand in its one
    weighting pass) instead of first gathering it to [M, N]. Its dW joins an open
    :func:`defer_weight_grads` queue like the grouped GEMM's. ``bounded_rows`` as for
    :func:`grouped_gemm` (rows past ``m_sizes.sum()``: no slot may name them). Arguments
    are checked as :func:`grouped_gemm`'s are (their values on the CPU or with ``EP_MOE_DEBUG``).

    Inside :func:`ep_moe.kernels.arrival.rows_departing` the sums are produced source by
    source into the departure's buffer, which is returned (``source_ends`` [E, S]: each
    expert's rows are sorted by source, so many from sources <= w; required then)."""
    _validate_slot_sum(a, w, m_sizes, row_weights, token_index, row_of_slot, top_k, bounded_rows)
    _check_bias(bias, w)
    return _slot_sum(a, w, m_sizes, row_weights, token_index, row_of_slot, top_k, configs, bounded_rows,
                     source_ends, bias)


@eager_or_graph_break  # eager only: its autograd.Function is not a custom op
def layer_grouped_gemm_slot_sum(a: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, row_weights: torch.Tensor,
                                token_index: torch.Tensor, row_of_slot: torch.Tensor, top_k: int,
                                configs: Optional[GemmConfigs] = None, bounded_rows: bool = False,
                                source_ends: Optional[torch.Tensor] = None,
                                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`grouped_gemm_slot_sum` on operands the layer built itself
    (:func:`ep_moe.experts.expert_mlp`): checked only where the value checks run, as
    :func:`layer_grouped_gemm`."""
    if value_checks(a.device):
        _validate_slot_sum(a, w, m_sizes, row_weights, token_index, row_of_slot, top_k, bounded_rows)
        _check_bias(bias, w)
    return _slot_sum(a, w, m_sizes, row_weights, token_index, row_of_slot, top_k, configs, bounded_rows,
                     source_ends, bias)


def _slot_sum(a, w, m_sizes, row_weights, token_index, row_of_slot, top_k, configs, bounded_rows, source_ends, bias):
    """:func:`grouped_gemm_slot_sum` on checked arguments (the kernels take int32 or int64
    indices, m_sizes as int32, every tensor with stride 1)."""
    if isinstance(configs, tuple):  # the int form (configs_to_ints), as _triton_grouped_gemm takes it
        configs = configs_from_ints(configs)
    configs = configs or GemmConfigs.defaults(a.element_size(), smem_limit_for(a.device))
    departure = take_departure()
    if departure is not None and (source_ends is None or source_ends.shape[1] != departure.num_sources):
        raise ValueError("grouped_gemm_slot_sum: a departure needs source_ends with one column per source "
                         f"({departure.num_sources}), got {None if source_ends is None else tuple(source_ends.shape)}")
    return _GemmSlotSum.apply(a, w, _as_int32(m_sizes), row_weights.contiguous(), token_index.contiguous(),
                              row_of_slot.contiguous(), top_k, configs, bounded_rows,
                              source_ends, departure, _contiguous(bias))


class WeightGradQueue(Protocol):
    """Where the grouped GEMMs' backward queues weight gradients inside
    :func:`defer_weight_grads` (:class:`ep_moe.ep.pipeline.DeferredWeightGrads`)."""

    def owns_weight(self, weight: torch.Tensor) -> bool:
        """Whether the dW of a GEMM multiplying by ``weight`` is queued here."""

    def add(self, weight: Union[torch.Tensor, tuple[torch.Tensor, ...]], grad_fn: Callable) -> None:
        """Queue ``grad_fn(add_to)``, the gradient of ``weight``: a new tensor for
        ``add_to=None``, else added to ``add_to`` in place and returned. For a tuple of
        tensors (a weight and its bias, whose gradients one kernel computes), ``grad_fn``
        takes and returns a tuple of their gradients."""


_open_queues: list[WeightGradQueue] = []
"""The queues of the open :func:`defer_weight_grads` blocks. Process wide, not a context
variable: on CUDA the autograd engine runs backward functions on its own device thread,
which does not see the context of a caller on another thread. The weights a queue owns
keep other GEMMs (other layers, other threads) out of it."""


def _queue_for(w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[WeightGradQueue]:
    """The open queue that owns ``w`` (and ``bias``, when given: their gradients come from
    one kernel, so both are queued or neither)."""
    return next((q for q in reversed(_open_queues)
                 if q.owns_weight(w) and (bias is None or q.owns_weight(bias))), None)


@contextlib.contextmanager
def defer_weight_grads(queue: WeightGradQueue):
    """Backward passes run inside the block (from any thread; eager mode, compiled graphs
    compute every gradient at once) compute the input and row-weight gradients of grouped
    GEMMs whose weight ``queue`` owns now, and queue their weight gradients. The caller runs
    ``queue.run()`` later, before reading the weights' ``.grad``; until then the queue
    holds each GEMM's saved operands.

    For ``.backward()`` (or ``torch.autograd.backward``) over graphs whose owned weights
    all want a gradient: ``torch.autograd.grad`` inside the block would return None for
    them, and ``queue.run()`` accumulates into their ``.grad`` whatever was asked."""
    _open_queues.append(queue)
    try:
        yield
    finally:
        _open_queues.remove(queue)


def debug_enabled(debug: Optional[bool] = None) -> bool:
    """Whether the value checks that cost a host sync on the GPU run: ``debug`` when given,
    else whether the ``EP_MOE_DEBUG`` environment variable is set to anything but ``0``."""
    if debug is not None:
        return debug
    return os.environ.get("EP_MOE_DEBUG", "0") not in ("", "0")


def value_checks(device: torch.device, debug: Optional[bool] = None) -> bool:
    """Whether the checks of index and count values run: on the CPU, where they are free,
    or in debug mode (:func:`debug_enabled`; on a GPU each costs a host sync); never while
    tracing, where the values are data-dependent. ``benchmarks/host_proxy.py`` turns them off
    to count a CPU call as a GPU call runs."""
    return (device.type == "cpu" or debug_enabled(debug)) and not torch.compiler.is_compiling()


def _check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}; convert it with torch.as_tensor")


def _check_index(name: str, idx: Optional[torch.Tensor], length: int, device: torch.device,
                 rows_name: str = "x") -> None:
    if idx is None:
        return
    _check_tensor(name, idx)
    if idx.dim() != 1 or idx.shape[0] != length:
        raise ValueError(f"{name} must be 1-D with {length} entries (one per routed row), got shape {tuple(idx.shape)}")
    if idx.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {idx.dtype}; convert with .to(torch.int32)")
    if idx.device != device:
        raise ValueError(f"{name} is on {idx.device} but {rows_name} is on {device}; move it with "
                         f".to({rows_name}.device)")


def _check_operands(x, w, m_sizes, x_name: str = "x", fp32_weights: bool = False) -> None:
    """The checks every grouped GEMM makes of its rows ``x`` (called ``x_name``), its
    weights and its counts: kinds, shapes, dtypes, devices (host only). ``fp32_weights``:
    ``w`` may also be float32 (master weights the FP8 GEMM quantizes itself)."""
    for name, value in ((x_name, x), ("w", w), ("m_sizes", m_sizes)):
        _check_tensor(name, value)
    if x.dim() != 2:
        raise ValueError(f"{x_name} must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"{x_name} has K={x.shape[1]} columns but w is [E, N, K] with K={w.shape[2]}; "
                         "pass w as [E, N, K] (out_features before in_features)")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{x_name} dtype {x.dtype} is not supported; use float16, bfloat16 or float32")
    if w.dtype != x.dtype and not (fp32_weights and w.dtype == torch.float32):
        raise ValueError(f"w dtype {w.dtype} does not match {x_name} dtype {x.dtype}; cast one of them")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device} but {x_name} is on {x.device}; move both to one device")
    if m_sizes.dim() != 1 or m_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"m_sizes must be 1-D with one count per expert ({w.shape[0]}), got shape "
                         f"{tuple(m_sizes.shape)}")
    if m_sizes.dtype not in _INDEX_DTYPES:
        raise ValueError(f"m_sizes must be int32 or int64, got {m_sizes.dtype}; convert with .to(torch.int32)")
    if m_sizes.device != x.device:
        raise ValueError(f"m_sizes is on {m_sizes.device} but {x_name} is on {x.device}; keep the counts on "
                         f"{x_name}'s device")


def _check_bias(bias: Optional[torch.Tensor], w: torch.Tensor) -> None:
    """``bias`` [E, N] against ``w`` [E, N, K]: kind, shape, dtype, device."""
    if bias is None:
        return
    _check_tensor("bias", bias)
    if tuple(bias.shape) != tuple(w.shape[:2]):
        raise ValueError(f"bias must be [E, N] = {list(w.shape[:2])} (one row of out_features per expert), got "
                         f"shape {tuple(bias.shape)}; stack the experts' nn.Linear biases")
    if bias.dtype != w.dtype:
        raise ValueError(f"bias dtype {bias.dtype} does not match w dtype {w.dtype}; cast it with bias.to(w.dtype)")
    if bias.device != w.device:
        raise ValueError(f"bias is on {bias.device} but w is on {w.device}; move it with bias.to(w.device)")


def _check_row_weights(row_weights, rows: int, device: torch.device, per: str) -> None:
    _check_tensor("row_weights", row_weights)
    if row_weights.dim() != 1 or row_weights.shape[0] != rows:
        raise ValueError(f"row_weights must be 1-D with {rows} entries (one per {per}), got shape "
                         f"{tuple(row_weights.shape)}")
    if not row_weights.is_floating_point():
        raise ValueError(f"row_weights must be a float tensor, got {row_weights.dtype}; convert with .float()")
    if row_weights.device != device:
        raise ValueError(f"row_weights is on {row_weights.device} but the rows are on {device}; "
                         "move it to their device")


def _check_counts(m_sizes: torch.Tensor, rows: int, bounded_rows: bool, what: str) -> None:
    """``m_sizes`` against the ``rows`` routed rows (values: a host sync on the GPU)."""
    total = int(m_sizes.sum())
    if bool((m_sizes < 0).any()):
        raise ValueError("m_sizes has negative counts; pass each expert's number of rows (>= 0)")
    if total > rows or (total < rows and not bounded_rows):
        raise ValueError(f"m_sizes sums to {total} but there are {rows} routed rows ({what}); "
                         "counts must cover every row exactly once (or, with bounded_rows=True, "
                         "at most every row)")


def _validate(x, w, m_sizes, gather_index, scatter_index, row_weights, debug: bool, bounded_rows: bool,
              bias: Optional[torch.Tensor] = None, fp32_weights: bool = False) -> None:
    _check_operands(x, w, m_sizes, fp32_weights=fp32_weights)
    _check_bias(bias, w)
    if gather_index is not None:
        _check_tensor("gather_index", gather_index)
    rows = _routed_rows(x, gather_index)
    _check_index("gather_index", gather_index, rows, x.device)
    _check_index("scatter_index", scatter_index, rows, x.device)
    if row_weights is not None:
        _check_row_weights(row_weights, rows, x.device, "output row")
    if bounded_rows and scatter_index is not None:
        raise ValueError("bounded_rows=True does not take a scatter_index (a permutation of every row); "
                         "sum the rows with row_of_slot instead (ep_moe.kernels.permute.sum_slot_rows)")
    if not value_checks(x.device, debug):
        return
    _check_counts(m_sizes, rows, bounded_rows, "gather_index entries" if gather_index is not None else "rows of x")
    if gather_index is not None and rows and not bool(((gather_index >= 0) & (gather_index < x.shape[0])).all()):
        raise ValueError(f"gather_index has entries outside [0, {x.shape[0]}) (the rows of x); index rows of x only")
    if scatter_index is not None and rows:
        if not bool(((scatter_index >= 0) & (scatter_index < rows)).all()):
            raise ValueError(f"scatter_index has entries outside [0, {rows}); pass a permutation of the {rows} "
                             "output rows")
        if torch.unique(scatter_index).numel() != rows:
            raise ValueError("scatter_index must be a permutation: every output row written exactly once")


def _validate_slot_sum(a, w, m_sizes, row_weights, token_index, row_of_slot, top_k, bounded_rows: bool) -> None:
    """:func:`grouped_gemm_slot_sum`'s arguments: kinds, shapes, dtypes and devices always
    (host only); the counts and ``row_of_slot``'s values where that is free (the CPU) or
    asked for (``EP_MOE_DEBUG``), as :func:`grouped_gemm` does."""
    _check_operands(a, w, m_sizes, x_name="a")
    rows = a.shape[0]
    _check_row_weights(row_weights, rows, a.device, "row of a")
    _check_index("token_index", token_index, rows, a.device, "a")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be a positive int (slots per token), got {top_k!r}")
    _check_tensor("row_of_slot", row_of_slot)
    if row_of_slot.dim() != 1 or row_of_slot.shape[0] % top_k:
        raise ValueError(f"row_of_slot must be 1-D with top_k={top_k} entries per token (slot t*K + k), got "
                         f"shape {tuple(row_of_slot.shape)}")
    _check_index("row_of_slot", row_of_slot, row_of_slot.shape[0], a.device, "a")
    if not value_checks(a.device):
        return
    _check_counts(m_sizes, rows, bounded_rows, "rows of a")
    if row_of_slot.numel() and not bool(((row_of_slot >= -1) & (row_of_slot < rows)).all()):
        raise ValueError(f"row_of_slot has entries outside [-1, {rows}) (a routed row of a, or -1 for none)")


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    gather_index: Optional[torch.Tensor] = None,
    scatter_index: Optional[torch.Tensor] = None,
    row_weights: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    configs: Optional[GemmConfigs] = None,
    deterministic: bool = True,
    unique_gather: bool = False,
    backend: Backend = "auto",
    debug: Optional[bool] = None,
    bounded_rows: bool = False,
) -> torch.Tensor:
    """Grouped GEMM over experts with fused permutation, autograd-aware.

    Args:
        x: [rows, K] input. Without ``gather_index`` its rows are the routed problem,
            expert 0's rows first; with it, any table the index reads from (e.g. [T, H]).
        w: [E, N, K] expert weights (``out_features`` before ``in_features``).
        m_sizes: [E] int32/int64 row counts per expert on x's device, summing to M
            (at most M with ``bounded_rows``).
        gather_index: optional [M] ints: routed row r reads ``x[gather_index[r]]``. Rows of
            x read several times get their gradients summed.
        scatter_index: optional [M] permutation: routed row r is written to output row
            ``scatter_index[r]``.
        row_weights: optional [M] weights indexed by *output* row, multiplied in fp32 in the
            epilogue (the top-k weights); gets a gradient.
        bias: optional [E, N] per-expert bias (``nn.Linear``'s), in w's dtype, added to
            each row of expert e in the epilogue, before the row weight; gets a gradient
            (each expert's weighted column sums of the output gradient, taken in the dW
            kernel's pass).
        configs: kernel configs for forward, dX and dW; default: ``GemmConfigs.defaults``
            fitted to x's element size and the device's shared memory.
        deterministic: sum the gradient of gathered rows in a fixed order (default) instead
            of with float atomics.
        unique_gather: promise that ``gather_index`` reads each row of x at most once (a
            permutation, e.g. rows already laid out for this GEMM): the backward then
            writes dx straight through the index, with no sort and no extra buffer.
            Checked in debug mode.
        backend: ``"triton"``, ``"torch"`` (reference), or ``"auto"``: Triton on CUDA and in
            the Triton interpreter, the reference elsewhere.
        debug: check index ranges and ``m_sizes`` on the GPU (host syncs); default from
            ``EP_MOE_DEBUG``. These checks always run for CPU tensors.
        bounded_rows: M is a bound, known on the host, of a row count known only on the
            device: ``m_sizes`` may sum to fewer than M rows (no ``scatter_index`` then).
            Rows past the sum are not computed: their outputs are undefined (zeros in
            the reference) and they get no gradient (dX, dW and the row weights' gradient
            leave them out). Their ``gather_index`` entries must still be rows of x.

    Returns:
        [M, N] tensor of x's dtype: rows of expert e are ``x_e @ w[e]^T (+ bias[e])``.
    """
    debug = debug_enabled(debug)
    _validate(x, w, m_sizes, gather_index, scatter_index, row_weights, debug, bounded_rows, bias)
    if unique_gather and gather_index is not None and value_checks(x.device, debug) \
            and torch.unique(gather_index).numel() != gather_index.numel():
        raise ValueError("unique_gather=True but gather_index reads some rows of x more than once; "
                         "pass unique_gather=False")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'triton' or 'torch'")
    if configs is not None and not isinstance(configs, GemmConfigs):
        raise ValueError(f"configs must be a GemmConfigs (forward, dx and dw KernelConfigs) or None, got "
                         f"{type(configs).__name__}; wrap one config c as GemmConfigs(forward=c, dx=c, dw=c)")
    use_triton = backend == "triton" or (backend == "auto" and (x.is_cuda or interpreter_active()))
    if backend == "triton" and not (x.is_cuda or interpreter_active()):
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1); use backend='torch' on CPU")
    if not use_triton:
        return grouped_gemm_reference(x, w, m_sizes, gather_index=gather_index,
                                      scatter_index=scatter_index, row_weights=row_weights, bias=bias)
    return _triton_grouped_gemm(x, w, m_sizes, gather_index, scatter_index, row_weights, bias, configs,
                                "unique" if unique_gather else ("sort" if deterministic else "atomic"), bounded_rows)


def _triton_grouped_gemm(x, w, m_sizes, gather_index, scatter_index, row_weights, bias,
                         configs: Union[GemmConfigs, tuple[int, ...], None], dx_mode: str, bounded_rows: bool,
                         dx_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`grouped_gemm`'s Triton path, on arguments already checked: the custom op under
    ``torch.compile``, else the autograd function, or under ``no_grad`` the forward alone
    (the autograd function's per-call setup is host time for nothing there)."""
    if x.stride(-1) != 1:  # the row gathers of the backward (dW, sorted dX) read rows as contiguous
        x = x.contiguous()
    # the kernels index every tensor below with stride 1; they take int32 or int64 indices
    # (no conversion per call), m_sizes as int32
    inputs = (x, w, _as_int32(m_sizes), _contiguous(gather_index), _contiguous(scatter_index),
              _contiguous(row_weights),
              # the int form passes as it is (what the experts' config lookup hands over in a torch.compile trace)
              configs if isinstance(configs, tuple)
              else configs_to_ints(configs or GemmConfigs.defaults(x.element_size(), smem_limit_for(x.device))),
              dx_mode, bounded_rows, _contiguous(bias), _contiguous(dx_slots))
    if torch.compiler.is_compiling():
        return torch.ops.ep_moe.grouped_gemm_fwd(*inputs)
    if not torch.is_grad_enabled():
        return _fwd_impl(*inputs)
    return _EagerGroupedGemm.apply(*inputs)


def layer_grouped_gemm(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *,
                       gather_index: Optional[torch.Tensor] = None, scatter_index: Optional[torch.Tensor] = None,
                       row_weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                       configs: Optional[GemmConfigs] = None, backend: str, bounded_rows: bool = False,
                       gather_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`grouped_gemm` (deterministic) on operands the layer built itself
    (:func:`ep_moe.experts.expert_mlp`), ``backend`` ``"triton"`` or ``"torch"``: the
    argument checks run only where the value checks do (the CPU, ``EP_MOE_DEBUG``), so a
    GPU call goes straight to the kernels.

    ``gather_slots`` (Triton, with ``gather_index``, not ``bounded_rows``): [M] routed row r's
    slot in token-major order, a permutation of the M = T * K slots of the T rows of x, with
    ``gather_index[r] == gather_slots[r] // K`` (a dropless top-K routing). The backward then
    stores each row's dX at its slot and sums each row's K slots, where it would otherwise
    sort the rows by destination."""
    if backend != "triton":
        return grouped_gemm(x, w, m_sizes, gather_index=gather_index, scatter_index=scatter_index,
                            row_weights=row_weights, bias=bias, configs=configs, backend=backend,
                            bounded_rows=bounded_rows)
    if value_checks(x.device):
        _validate(x, w, m_sizes, gather_index, scatter_index, row_weights, True, bounded_rows, bias)
        _check_gather_slots(gather_slots, gather_index, x.shape[0], bounded_rows)
    return _triton_grouped_gemm(x, w, m_sizes, gather_index, scatter_index, row_weights, bias, configs,
                                "sort" if gather_slots is None else "slots", bounded_rows, gather_slots)


def _check_gather_slots(gather_slots: Optional[torch.Tensor], gather_index: Optional[torch.Tensor], rows: int,
                        bounded_rows: bool) -> None:
    """:func:`layer_grouped_gemm`'s ``gather_slots`` against its ``gather_index`` (values: a host sync)."""
    if gather_slots is None:
        return
    if gather_index is None or bounded_rows:
        raise ValueError("gather_slots needs a gather_index and every row counted (bounded_rows=False)")
    slots = gather_slots.shape[0]
    if slots == 0 and gather_index.shape[0] == 0:
        return
    if gather_slots.shape != gather_index.shape or rows == 0 or slots % rows:
        raise ValueError(f"gather_slots of shape {tuple(gather_slots.shape)} must match gather_index "
                         f"{tuple(gather_index.shape)}, K slots for each of the {rows} rows of x")
    if torch.unique(gather_slots).numel() != slots or \
            not bool((torch.div(gather_slots, slots // rows, rounding_mode="floor") == gather_index).all()):
        raise ValueError(f"gather_slots must be a permutation of the {slots} slots, slot s belonging to row "
                         f"s // {slots // rows} of x as gather_index says")
