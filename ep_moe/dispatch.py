"""All-to-all dispatch and combine of routed rows: communication only.

Shape suffixes follow the legend in :mod:`ep_moe.routing` (R rows this rank sends, S rows
it receives, P ranks of the EP group, e local experts). One EP>1 layer forward is:

1. :func:`exchange_counts`: each rank sends its per-expert counts ``counts_E`` (rank p
   owns experts ``p*e .. p*e+e-1``) and receives, from every source rank, how many rows
   it will get for each of its local experts (``recv_counts_Pe``, rank-major).
2. :func:`split_sizes`: the single host sync of the layer, the split sizes that
   ``all_to_all_single`` needs (for every chunk of the pipeline at once).
3. :func:`start_dispatch`: rows go to the owners of their experts and arrive grouped by
   source rank, then by local expert::

       arrival order (rank-major):   [src0: e0 e1 | src1: e0 e1 | src2: e0 e1]
       expert-major (GEMM order):    [e0: src0 src1 src2 | e1: src0 src1 src2]

   :func:`expert_major_order` gives the gather index from the second order into the
   first, so the grouped GEMM reads the rows in expert order straight from the arrival
   buffer and the down projection scatters back into it: no permute copy.
4. :func:`start_combine`: the reverse all-to-all returns the expert outputs to the ranks
   that own their tokens, in the order they were sent.

The exchanges are asynchronous (:class:`PendingExchange`) so that :mod:`ep_moe.pipeline`
can overlap one chunk's all-to-all with another chunk's expert GEMMs. With a group of one
rank (or none) no collective runs: the functions return their input.
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


def exchange_counts(counts: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """All-to-all of per-expert counts ``[..., E]`` (one row per chunk, or a single [E]):
    returns ``recv_counts`` of the same shape, rank-major per row, where
    ``recv_counts[..., p*e + j]`` is how many rows rank p sends for local expert j. One
    collective for every chunk."""
    ep_size = group_size(group)
    if ep_size == 1:
        return counts
    send_PCe = counts.reshape(-1, ep_size, counts.shape[-1] // ep_size).transpose(0, 1).contiguous()
    recv_PCe = torch.empty_like(send_PCe)
    dist.all_to_all_single(recv_PCe, send_PCe, group=group)
    return recv_PCe.transpose(0, 1).reshape(counts.shape)


def split_sizes(counts_CE: torch.Tensor, recv_counts_CE: torch.Tensor, ep_size: int) -> list[SplitSizes]:
    """Split sizes of each chunk (row of ``[C, E]`` counts), summed per rank and brought to
    the host in one transfer: the layer's single host sync."""
    num_chunks = counts_CE.shape[0]
    per_rank = torch.stack([counts_CE.view(num_chunks, ep_size, -1).sum(2),
                            recv_counts_CE.view(num_chunks, ep_size, -1).sum(2)], dim=1)
    sizes = per_rank.tolist()  # host sync: all_to_all_single needs split sizes as ints
    return [SplitSizes(send=send, recv=recv) for send, recv in sizes]


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


class PendingExchange:
    """An all-to-all in flight: :meth:`wait` returns its output once the current stream
    may use it (NCCL: a stream wait, the host does not block; gloo: blocks)."""

    def __init__(self, out: torch.Tensor, work: Optional[dist.Work]) -> None:
        self._out, self._work = out, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out


def start_exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                   group: Optional[ProcessGroup]) -> PendingExchange:
    """Start ``all_to_all_single`` of the rows of ``x`` with uneven splits (not
    differentiable; :mod:`ep_moe.pipeline` wires the backward). No group: ``x`` itself."""
    if group_size(group) == 1:
        return PendingExchange(x, None)
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)
    return PendingExchange(out, work)


def start_dispatch(send_RH: torch.Tensor, splits: SplitSizes, group: Optional[ProcessGroup]) -> PendingExchange:
    """Rows grouped by destination rank go to the owners of their experts; they arrive
    ([S, ...]) grouped by source rank, then local expert."""
    return start_exchange(send_RH, splits.recv, splits.send, group)


def start_combine(out_SH: torch.Tensor, splits: SplitSizes, group: Optional[ProcessGroup]) -> PendingExchange:
    """The reverse of :func:`start_dispatch`: rows in arrival order go back to the ranks
    that sent them and arrive ([R, ...]) in that rank's send order."""
    return start_exchange(out_SH, splits.send, splits.recv, group)
