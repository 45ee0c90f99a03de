"""The expert-parallel section of the layer as a chunked pipeline: all-to-all of one chunk
overlapped with the expert GEMMs of another, in the forward and in the backward.

The rank's tokens are split into C chunks (``MoEConfig.overlap_chunks``); each chunk is
dispatched, run through the local experts and combined on its own. All exchanges are
started asynchronously on a communication stream (NCCL's, or the copy engines' of
:mod:`ep_moe.copy_engine`), and the compute stream waits for an exchange only right
before it uses its rows::

    comm:     dispatch 0 | dispatch 1 |            | combine 0 |            | combine 1
    compute:             | experts 0  | (waits d1) | experts 1 |

so with C chunks all but about 1/C of the communication can hide behind GEMMs. The
copy engines need no SM; NCCL's kernels do, and a persistent GEMM holds every SM until it
ends, so with NCCL the GEMMs of overlapping chunks launch one program per tile
(:func:`~ep_moe.kernels.grouped_gemm.one_program_per_tile`): an NCCL kernel gets an SM
whenever a tile ends. The backward runs the same schedule in reverse (gradients of the
combined rows go back, the experts' backward of chunk c runs while chunk c+1's gradients
travel, the row gradients return) and computes the weight gradients last
(:class:`~ep_moe.kernels.ops.DeferredWeightGrads`): the last chunk's row gradients travel
back while the dW GEMMs run, so even C = 1 hides that all-to-all::

    comm:     grads 0 |            | rows back 0 |
    compute:          | dX chain 0 | dW GEMMs (one program per tile)

The experts of each chunk are recorded as a small autograd graph on detached inputs
during the forward and replayed by ``torch.autograd.backward`` in the backward (as a
reentrant checkpoint does, without recomputation): the expert math keeps its own
backward (the grouped GEMM's dX and dW kernels) and only the schedule is written here.
C = 1 runs the forward as the plain sequence dispatch, experts, combine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ep_moe.dispatch import PendingExchange, SplitSizes
from ep_moe.kernels.grouped_gemm import one_program_per_tile
from ep_moe.kernels.ops import DeferredWeightGrads, defer_weight_grads
from ep_moe.routing import RoutingMetadata


@dataclass(frozen=True)
class ChunkPlan:
    """Where one chunk's rows go and how the local experts take them."""

    splits: SplitSizes
    """Rows sent to / received from each rank."""
    local: RoutingMetadata
    """Routing of the arrived rows to this rank's experts (rows as tokens)."""


class Exchange(Protocol):
    """The all-to-alls of one layer call: :class:`ep_moe.dispatch.NcclExchange` or
    :class:`ep_moe.copy_engine.CopyEngineExchange`."""

    def begin(self) -> None: ...
    def staging(self, chunk: int, kind: str, rows: int, row_shape: tuple,
                dtype: torch.dtype) -> Optional[torch.Tensor]: ...
    def dispatch(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange: ...
    def combine(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange: ...


ExpertFn = Callable[[torch.Tensor, torch.Tensor, ChunkPlan, torch.Tensor, torch.Tensor], torch.Tensor]
"""``expert_fn(rows_SH, weights_S, plan, gate_up, down) -> out_SH``: the local experts on
one chunk's arrived rows and their top-k weights (``[S]`` or ``[S, K]``), one output row
per arrived row, differentiable."""


class _ExpertPipeline(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_fn: ExpertFn, plans: list[ChunkPlan], exchange: Exchange,
                share_sms: bool, record: bool, gate_up: torch.Tensor, down: torch.Tensor, *rows_and_weights):
        num_chunks = len(plans)
        send, arrived_weights = rows_and_weights[:num_chunks], rows_and_weights[num_chunks:]
        rows_in = [exchange.dispatch(send[c], c, "rows") for c in range(num_chunks)]
        # Detached stand-ins: each chunk's graph ends at these leaves, whose grads the
        # backward collects and returns.
        weights = [w.detach().requires_grad_(record and w.requires_grad) for w in (gate_up, down)]
        graphs, rows_out = [], []
        for c, plan in enumerate(plans):
            # detach: without a group the "received" rows are the sent tensors themselves
            rows_SH = rows_in[c].wait().detach().requires_grad_(record and send[c].requires_grad)
            row_weights_S = arrived_weights[c].detach().requires_grad_(record and arrived_weights[c].requires_grad)
            with torch.set_grad_enabled(record), _sharing_sms(share_sms):
                out_SH = expert_fn(rows_SH, row_weights_S, plan, *weights)
            graphs.append((out_SH, rows_SH, row_weights_S))
            rows_out.append(exchange.combine(out_SH.detach(), c, "rows"))
        ctx.plans, ctx.exchange, ctx.share_sms, ctx.weights, ctx.graphs = plans, exchange, share_sms, weights, graphs
        return tuple(pending.wait() for pending in rows_out)

    @staticmethod
    def backward(ctx, *grads_back):
        if ctx.graphs is None:
            raise RuntimeError("ep_moe's expert pipeline frees its graphs in the backward; a second "
                               "backward through the same MoE forward (retain_graph=True) is not supported")
        plans, exchange, weights = ctx.plans, ctx.exchange, ctx.weights
        num_chunks = len(plans)
        # Which sent rows need a gradient: the same on every rank (the activations of the
        # same model), so every rank skips the same exchanges.
        need_rows = ctx.needs_input_grad[_SEND_ARG: _SEND_ARG + num_chunks]
        need_weights = ctx.needs_input_grad[_SEND_ARG + num_chunks:]
        exchange.begin()
        grads_in = [exchange.dispatch(g.contiguous(), c, "rows") for c, g in enumerate(grads_back)]
        rows_back, weights_grads = [], []
        weight_grads = DeferredWeightGrads(weights)
        for c, (out_SH, rows_SH, row_weights_S) in enumerate(ctx.graphs):
            inputs = [t for t in (rows_SH, row_weights_S, *weights) if t.requires_grad]
            if inputs:
                with defer_weight_grads(weight_grads), _sharing_sms(ctx.share_sms):
                    torch.autograd.backward(out_SH, grads_in[c].wait(), inputs=inputs)
            rows_back.append(exchange.combine(_grad_or_zeros(rows_SH), c, "rows") if need_rows[c] else None)
            weights_grads.append(_grad_or_zeros(row_weights_S) if need_weights[c] else None)
        with _sharing_sms(any(need_rows)):  # under the last row gradients' all-to-all
            weight_grads.run()
        grads = []
        for w in weights:  # hand the grads over, so autograd can keep them instead of copying
            grads.append(w.grad)
            w.grad = None
        ctx.graphs = ctx.weights = ctx.exchange = None  # free the chunks' graphs
        grad_send = [None if p is None else p.wait() for p in rows_back]
        return (None, None, None, None, None, *grads, *grad_send, *weights_grads)


def _sharing_sms(share: bool):
    """GEMMs that overlap NCCL's kernels launch one program per tile, so NCCL finds SMs."""
    return one_program_per_tile() if share else contextlib.nullcontext()


_SEND_ARG = 7
"""Position of the first sent rows among ``_ExpertPipeline.forward``'s arguments."""


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def expert_pipeline(expert_fn: ExpertFn, plans: list[ChunkPlan], exchange: Exchange,
                    gate_up: torch.Tensor, down: torch.Tensor, send_rows: list[torch.Tensor],
                    arrived_weights: list[torch.Tensor], share_sms: bool = False) -> list[torch.Tensor]:
    """Dispatch, local experts and combine of every chunk, communication overlapped with
    compute (see the module docstring). Differentiable in ``gate_up``, ``down``, the sent
    rows and the arrived weights.

    Args:
        expert_fn: the local experts on one chunk (:data:`ExpertFn`).
        plans: one :class:`ChunkPlan` per chunk.
        exchange: the all-to-alls (:class:`Exchange`); the caller has begun the forward's
            session (``exchange.begin()``) before staging anything; the backward begins its own.
        gate_up, down: the local expert weights, passed on to ``expert_fn``.
        send_rows: per chunk, [U_c, H] rows grouped by destination rank.
        arrived_weights: per chunk, the top-k weights of each row this rank receives
            ([S_c] or [S_c, K], already here: they travel with the expert ids, see
            :func:`ep_moe.dispatch.arrived`; applied by ``expert_fn``).
        share_sms: launch the GEMMs of the chunks one program per tile, so that the
            all-to-alls they overlap find SMs (True for NCCL with several chunks; the
            copy engines need no SM, and one chunk overlaps nothing in the forward).

    Returns:
        Per chunk, [U_c, H] expert outputs in the chunk's send order.
    """
    record = torch.is_grad_enabled() and any(
        t.requires_grad for t in (gate_up, down, *send_rows, *arrived_weights))
    return list(_ExpertPipeline.apply(expert_fn, plans, exchange, share_sms, record, gate_up, down,
                                      *send_rows, *arrived_weights))
