"""All-to-all dispatch and combine of routed rows: communication only.

Shape suffixes follow the legend in :mod:`ep_moe.routing` (U rows this rank sends, one
per token and destination rank; P ranks of the EP group). One EP>1 layer forward is:

1. :func:`gather_counts`: every rank learns, per source and destination rank, how many
   rows and kept slots go there (:func:`ep_moe.routing.rank_counts`), for every chunk of
   the pipeline at once, in one all-gather and the layer's single host sync.
2. :func:`chunk_splits`: this rank's split sizes of a chunk, which ``all_to_all_single``
   needs; :func:`row_matrices`: every rank's, for the copy-engine exchange.
3. :func:`start_dispatch`: rows (and their local expert ids and top-k weights) go to the
   destination ranks and arrive grouped by source rank; the receiver routes them to its
   experts as an EP=1 layer would (gather on GEMM1's load, slot sum after GEMM2).
4. :func:`start_combine`: the reverse all-to-all returns one summed row per sent row to
   the rank that sent it, in the order it was sent.

The exchanges are asynchronous (:class:`PendingExchange`) so that :mod:`ep_moe.pipeline`
can overlap one chunk's all-to-all with another chunk's expert GEMMs. :class:`NcclExchange`
bundles them per layer call; :class:`ep_moe.copy_engine.CopyEngineExchange` is the same
on the copy engines. With a group of one rank (or none) no collective runs: the functions
return their input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
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


# all_gather_into_tensor became all_gather_single in newer PyTorch (the old name warns there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_counts(counts_CPX: torch.Tensor, group: Optional[ProcessGroup]) -> list:
    """Every rank's per-destination counts, on the host: ``counts_CPX[c, p]`` holds X
    numbers this rank has for rank p in chunk c; returns nested lists ``all[q][c][p]``,
    rank q's ``counts_CPX[c, p]``. One all-gather for every chunk and the layer's single
    host sync (``all_to_all_single`` needs its split sizes as ints; the copy-engine
    exchange needs every rank's counts to find its rows in the peers' buffers)."""
    if group_size(group) == 1:
        return [counts_CPX.tolist()]
    size = group_size(group)
    every = counts_CPX.new_empty((size * counts_CPX.shape[0],) + tuple(counts_CPX.shape[1:]))
    _all_gather_single(every, counts_CPX.contiguous(), group=group)  # concatenated along dim 0
    return every.view((size,) + tuple(counts_CPX.shape)).tolist()


def chunk_splits(counts: list, rank: int, chunk: int) -> SplitSizes:
    """Rank ``rank``'s split sizes of ``chunk`` from :func:`gather_counts`'s lists (rows
    are the first of the X numbers)."""
    return SplitSizes(send=[x[0] for x in counts[rank][chunk]], recv=[per_rank[chunk][rank][0] for per_rank in counts])


def row_matrices(counts: list) -> list[list[list[int]]]:
    """``matrices[c][q][p]``: rows rank q sends rank p in chunk c (from :func:`gather_counts`)."""
    return [[[x[0] for x in per_rank[c]] for per_rank in counts] for c in range(len(counts[0]))]


class PendingExchange:
    """An all-to-all in flight: :meth:`wait` returns its output once the current stream
    may use it (NCCL or copy engines: a stream wait, the host does not block; gloo:
    blocks). ``work``: the collective's handle; ``event``: recorded after its copies."""

    def __init__(self, out: torch.Tensor, work: Optional[dist.Work] = None,
                 event: Optional[torch.cuda.Event] = None) -> None:
        self._out, self._work, self._event = out, work, event

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._event)
            self._event = None
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


class _Arrived(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sent, arrived_, splits, group):
        ctx.splits, ctx.group = splits, group
        return arrived_

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return start_combine(grad.contiguous(), ctx.splits, ctx.group).wait(), None, None, None


def arrived(sent: torch.Tensor, arrived_rows: torch.Tensor, splits: SplitSizes,
            group: Optional[ProcessGroup]) -> torch.Tensor:
    """``arrived_rows``, what a dispatch of ``sent`` delivered (e.g. packed into another
    message), made differentiable in ``sent``: the gradient goes back by a combine."""
    return _Arrived.apply(sent, arrived_rows, splits, group)


def dispatch_packed(parts: list[torch.Tensor], splits: SplitSizes, group: Optional[ProcessGroup]) -> list[torch.Tensor]:
    """Dispatch several [U, ...] tensors of any dtypes in one all-to-all (their bytes side
    by side in each row); returns the arrived [S, ...] tensors (not differentiable)."""
    widths = [math.prod(p.shape[1:]) * p.element_size() for p in parts]
    packed = torch.empty((parts[0].shape[0], sum(widths)), dtype=torch.uint8, device=parts[0].device)
    start = 0
    for part, width in zip(parts, widths):
        if part.numel():
            packed[:, start: start + width] = part.contiguous().view(torch.uint8).view(part.shape[0], width)
        start += width
    out = start_dispatch(packed, splits, group).wait()
    result, start = [], 0
    for part, width in zip(parts, widths):
        piece = torch.empty((out.shape[0], *part.shape[1:]), dtype=part.dtype, device=out.device)
        if piece.numel():
            piece.view(torch.uint8).view(out.shape[0], width).copy_(out[:, start: start + width])
        result.append(piece)
        start += width
    return result


class NcclExchange:
    """The all-to-alls of one layer call's pipeline through ``all_to_all_single`` (NCCL
    on GPU, gloo on CPU; no collective without a group). Same interface as
    :class:`ep_moe.copy_engine.CopyEngineExchange`; ``kind`` names the message (rows,
    weights) and only matters there."""

    def __init__(self, group: Optional[ProcessGroup], splits: list[SplitSizes]) -> None:
        self.group, self.splits = group, splits

    def begin(self) -> None:
        """Start a session (a forward or a backward): nothing to do here."""

    def staging(self, chunk: int, kind: str, rows: int, row_shape: tuple, dtype: torch.dtype) -> None:
        """Where a dispatch's rows could be written to save a copy: nowhere here (None)."""
        return None

    def dispatch(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange:
        """:func:`start_dispatch` of chunk ``chunk``."""
        return start_dispatch(x, self.splits[chunk], self.group)

    def combine(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange:
        """:func:`start_combine` of chunk ``chunk``."""
        return start_combine(x, self.splits[chunk], self.group)
