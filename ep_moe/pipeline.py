"""The expert-parallel section of the layer as a chunked pipeline: all-to-all of one chunk
overlapped with the expert GEMMs of another, in the forward and in the backward.

The rank's tokens are split into C chunks (``MoEConfig.overlap_chunks``); each chunk is
dispatched, run through the local experts and combined on its own. All exchanges are
started asynchronously on the process group's communication stream, and the compute
stream waits for an exchange only right before it uses its rows::

    comm:     dispatch 0 | dispatch 1 |            | combine 0 |            | combine 1
    compute:             | experts 0  | (waits d1) | experts 1 |

so with C chunks all but about 1/C of the communication hides behind GEMMs. A persistent
GEMM occupies every SM until it ends, which would hold the communication kernels back;
while chunks overlap the GEMMs leave ``comm_sms`` SMs to them. The backward
runs the same schedule in reverse (gradients of the combined rows go back, the experts'
backward of chunk c runs while chunk c+1's gradients travel, the row gradients return).

The experts of each chunk are recorded as a small autograd graph on detached inputs
during the forward and replayed by ``torch.autograd.backward`` in the backward (as a
reentrant checkpoint does, without recomputation): the expert math keeps its own
backward (the grouped GEMM's dX and dW kernels) and only the schedule is written here.
C = 1 is the plain sequence dispatch, experts, combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed import ProcessGroup

from ep_moe.dispatch import SplitSizes, start_combine, start_dispatch
from ep_moe.kernels.grouped_gemm import reserve_sms
from ep_moe.routing import RoutingMetadata


@dataclass(frozen=True)
class ChunkPlan:
    """Where one chunk's rows go and how the local experts take them."""

    splits: SplitSizes
    """Rows sent to / received from each rank."""
    local: RoutingMetadata
    """Routing of the arrived rows to this rank's experts (rows as tokens)."""


ExpertFn = Callable[[torch.Tensor, torch.Tensor, ChunkPlan, torch.Tensor, torch.Tensor], torch.Tensor]
"""``expert_fn(rows_SH, weights_S, plan, gate_up, down) -> out_SH``: the local experts on
one chunk's arrived rows and their top-k weights (``[S]`` or ``[S, K]``), one output row
per arrived row, differentiable."""


class _ExpertPipeline(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_fn: ExpertFn, plans: list[ChunkPlan], group: Optional[ProcessGroup],
                comm_sms: int, record: bool, gate_up: torch.Tensor, down: torch.Tensor, *send):
        num_chunks = len(plans)
        rows_in = [start_dispatch(send[c], plans[c].splits, group) for c in range(num_chunks)]
        weights_in = [start_dispatch(send[num_chunks + c], plans[c].splits, group) for c in range(num_chunks)]
        # Detached stand-ins: each chunk's graph ends at these leaves, whose grads the
        # backward collects and returns.
        weights = [w.detach().requires_grad_(record and w.requires_grad) for w in (gate_up, down)]
        graphs, rows_out = [], []
        for c, plan in enumerate(plans):
            # detach: without a group the "received" rows are the sent tensors themselves
            rows_SH = rows_in[c].wait().detach().requires_grad_(record and send[c].requires_grad)
            row_weights_S = weights_in[c].wait().detach().requires_grad_(
                record and send[num_chunks + c].requires_grad)
            with torch.set_grad_enabled(record), reserve_sms(comm_sms):
                out_SH = expert_fn(rows_SH, row_weights_S, plan, *weights)
            graphs.append((out_SH, rows_SH, row_weights_S))
            rows_out.append(start_combine(out_SH.detach(), plan.splits, group))
        ctx.plans, ctx.group, ctx.comm_sms, ctx.weights, ctx.graphs = plans, group, comm_sms, weights, graphs
        return tuple(pending.wait() for pending in rows_out)

    @staticmethod
    def backward(ctx, *grads_back):
        if ctx.graphs is None:
            raise RuntimeError("ep_moe's expert pipeline frees its graphs in the backward; a second "
                               "backward through the same MoE forward (retain_graph=True) is not supported")
        plans, group, weights = ctx.plans, ctx.group, ctx.weights
        num_chunks = len(plans)
        # Which sent tensors need a gradient: the same on every rank (parameters, and the
        # activations of the same model), so every rank skips the same exchanges.
        need_rows = ctx.needs_input_grad[_SEND_ARG: _SEND_ARG + num_chunks]
        need_weights = ctx.needs_input_grad[_SEND_ARG + num_chunks:]
        grads_in = [start_dispatch(g.contiguous(), plan.splits, group) for g, plan in zip(grads_back, plans)]
        rows_back, weights_back = [], []
        for c, (out_SH, rows_SH, row_weights_S) in enumerate(ctx.graphs):
            inputs = [t for t in (rows_SH, row_weights_S, *weights) if t.requires_grad]
            if inputs:
                with reserve_sms(ctx.comm_sms):
                    torch.autograd.backward(out_SH, grads_in[c].wait(), inputs=inputs)
            rows_back.append(start_combine(_grad_or_zeros(rows_SH), plans[c].splits, group)
                             if need_rows[c] else None)
            weights_back.append(start_combine(_grad_or_zeros(row_weights_S), plans[c].splits, group)
                                if need_weights[c] else None)
        weight_grads = []
        for w in weights:  # hand the grads over, so autograd can keep them instead of copying
            weight_grads.append(w.grad)
            w.grad = None
        ctx.graphs = ctx.weights = None  # free the chunks' graphs
        grad_send = [None if p is None else p.wait() for p in rows_back + weights_back]
        return (None, None, None, None, None, *weight_grads, *grad_send)


_SEND_ARG = 7
"""Position of the first sent tensor among ``_ExpertPipeline.forward``'s arguments."""


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def expert_pipeline(expert_fn: ExpertFn, plans: list[ChunkPlan], group: Optional[ProcessGroup],
                    gate_up: torch.Tensor, down: torch.Tensor, send_rows: list[torch.Tensor],
                    send_weights: list[torch.Tensor], comm_sms: int = 0) -> list[torch.Tensor]:
    """Dispatch, local experts and combine of every chunk, communication overlapped with
    compute (see the module docstring). Differentiable in ``gate_up``, ``down``, the sent
    rows and their weights.

    Args:
        expert_fn: the local experts on one chunk (:data:`ExpertFn`).
        plans: one :class:`ChunkPlan` per chunk.
        group: the EP group (None: no collective).
        gate_up, down: the local expert weights, passed on to ``expert_fn``.
        send_rows: per chunk, [U_c, H] rows grouped by destination rank.
        send_weights: per chunk, the top-k weights of each row ([U_c] or [U_c, K]; applied
            by ``expert_fn``).
        comm_sms: SMs the persistent GEMM kernels leave free for the all-to-all while
            chunks overlap (:func:`ep_moe.kernels.grouped_gemm.reserve_sms`); use 0 for a
            single chunk.

    Returns:
        Per chunk, [U_c, H] expert outputs in the chunk's send order.
    """
    record = torch.is_grad_enabled() and any(
        t.requires_grad for t in (gate_up, down, *send_rows, *send_weights))
    return list(_ExpertPipeline.apply(expert_fn, plans, group, comm_sms, record, gate_up, down,
                                      *send_rows, *send_weights))
