"""All-to-all dispatch and combine of routed rows: communication only.

Shape suffixes follow the legend in :mod:`ep_moe.routing` (R rows this rank sends, S rows
it receives, P ranks of the EP group, e local experts). One EP>1 layer forward is:

1. :func:`exchange_counts`: each rank sends its per-expert counts ``counts_E`` (rank p
   owns experts ``p*e .. p*e+e-1``) and receives, from every source rank, how many rows
   it will get for each of its local experts (``recv_counts_Pe``, rank-major).
2. :func:`split_sizes`: the single host sync of the layer, the split sizes that
   ``all_to_all_single`` needs.
3. :func:`dispatch_rows`: rows go to the owners of their experts and arrive grouped by
   source rank, then by local expert::

       arrival order (rank-major):   [src0: e0 e1 | src1: e0 e1 | src2: e0 e1]
       expert-major (GEMM order):    [e0: src0 src1 src2 | e1: src0 src1 src2]

   :func:`expert_major_order` gives the gather index from the second order into the
   first, so the grouped GEMM reads the rows in expert order straight from the arrival
   buffer and the down projection scatters back into it: no permute copy.
4. :func:`combine_rows`: the reverse all-to-all returns the expert outputs to the ranks
   that own their tokens, in the order they were sent.

With a group of one rank (or none) no collective runs: the functions return their input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: Optional[ProcessGroup]) -> int:
    """Ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


@dataclass(frozen=True)
class SplitSizes:
    """Rows this rank sends to / receives from each rank of the EP group (host ints)."""

    send: list[int]
    """Rows sent to rank p (the input splits of the dispatch)."""
    recv: list[int]
    """Rows received from rank p (the output splits of the dispatch)."""

    @property
    def num_recv(self) -> int:
        """S, rows this rank receives for its local experts."""
        return sum(self.recv)


def exchange_counts(counts_E: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """All-to-all of per-expert counts: returns ``recv_counts`` [P*e], rank-major, where
    ``recv_counts[p*e + j]`` is how many rows rank p sends for local expert j."""
    if group_size(group) == 1:
        return counts_E
    recv_counts = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts, counts_E.contiguous(), group=group)
    return recv_counts


def split_sizes(counts_E: torch.Tensor, recv_counts: torch.Tensor, ep_size: int) -> SplitSizes:
    """Sum the counts per rank and bring them to the host, in one transfer."""
    per_rank = torch.cat([counts_E.view(ep_size, -1).sum(1), recv_counts.view(ep_size, -1).sum(1)])
    sizes = per_rank.tolist()  # host sync: all_to_all_single needs split sizes as ints
    return SplitSizes(send=sizes[:ep_size], recv=sizes[ep_size:])


def expert_major_order(recv_counts: torch.Tensor, ep_size: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-major arrival order -> expert-major order, without a host sync.

    Args:
        recv_counts: [P*e] rows from source rank p for local expert j at ``p*e + j``.
        ep_size: P.
        num_rows: S, the number of arrived rows (``sum(recv_counts)``, known on the host).

    Returns:
        ``gather_index_S`` (int64): arrival row of the i-th row in expert-major order
        (stable: within an expert, source rank order, then the sender's order); and
        ``m_sizes_e``: rows per local expert.
    """
    recv_counts_Pe = recv_counts.view(ep_size, -1)
    num_local = recv_counts_Pe.shape[1]
    local_expert_Pe = torch.arange(num_local, device=recv_counts.device).repeat(ep_size)
    expert_of_row_S = torch.repeat_interleave(local_expert_Pe, recv_counts_Pe.flatten(), output_size=num_rows)
    gather_index_S = torch.argsort(expert_of_row_S, stable=True)
    return gather_index_S, recv_counts_Pe.sum(dim=0)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: Optional[ProcessGroup]) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_out):
        return _all_to_all(grad_out, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def dispatch_rows(send_RH: torch.Tensor, splits: SplitSizes, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Send routed rows (grouped by destination rank) to their experts' ranks; returns the
    [S, H] rows that arrived here, grouped by source rank then local expert."""
    return _AllToAll.apply(send_RH, splits.recv, splits.send, group)


def combine_rows(out_SH: torch.Tensor, splits: SplitSizes, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Return expert outputs (in arrival order) to the ranks that sent the rows; the
    result [R, H] is in this rank's send order."""
    return _AllToAll.apply(out_SH, splits.send, splits.recv, group)
