"""All-to-all dispatch and combine of routed rows: communication only.

Shape suffixes follow the legend in :mod:`ep_moe.routing` (U rows this rank sends, one
per token and destination rank; P ranks of the EP group). One EP>1 layer forward is:

1. :func:`exchange_counts`: each rank sends, per destination rank, how many rows and
   kept slots it will send there (:func:`ep_moe.routing.rank_counts`), and receives the
   same from every source rank.
2. :func:`counts_to_host`: the single host sync of the layer, the split sizes that
   ``all_to_all_single`` needs (for every chunk of the pipeline at once).
3. :func:`start_dispatch`: rows (and their local expert ids and top-k weights) go to the
   destination ranks and arrive grouped by source rank; the receiver routes them to its
   experts as an EP=1 layer would (gather on GEMM1's load, slot sum after GEMM2).
4. :func:`start_combine`: the reverse all-to-all returns one summed row per sent row to
   the rank that sent it, in the order it was sent.

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


def exchange_counts(counts_CPX: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """All-to-all of per-destination counts: ``counts_CPX[c, p]`` holds X numbers this rank
    has for rank p in chunk c; returns ``recv_CPX`` where ``recv_CPX[c, p]`` holds what
    rank p has for this rank. One collective for every chunk."""
    if group_size(group) == 1:
        return counts_CPX
    send_PCX = counts_CPX.transpose(0, 1).contiguous()
    recv_PCX = torch.empty_like(send_PCX)
    dist.all_to_all_single(recv_PCX, send_PCX, group=group)
    return recv_PCX.transpose(0, 1)


def counts_to_host(send_CPX: torch.Tensor, recv_CPX: torch.Tensor) -> tuple[list, list]:
    """Both count tensors as nested lists, in one transfer: the layer's single host sync
    (``all_to_all_single`` needs its split sizes as ints)."""
    both = torch.stack([send_CPX, recv_CPX.to(send_CPX.dtype)]).tolist()
    return both[0], both[1]


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
    ([S, ...]) grouped by source rank, each source's rows in its send order."""
    return start_exchange(send_RH, splits.recv, splits.send, group)


def start_combine(out_SH: torch.Tensor, splits: SplitSizes, group: Optional[ProcessGroup]) -> PendingExchange:
    """The reverse of :func:`start_dispatch`: rows in arrival order go back to the ranks
    that sent them and arrive ([U, ...]) in that rank's send order."""
    return start_exchange(out_SH, splits.send, splits.recv, group)
