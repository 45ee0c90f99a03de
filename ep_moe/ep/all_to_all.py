"""``dispatch="all_to_all"``: each token goes to the ranks that hold its experts, over
uneven ``all_to_all_single`` (NCCL on GPU, gloo on CPU), and one summed row per token and
rank comes back (:class:`AllToAllDispatcher`).

Shape suffixes follow the legend in :mod:`ep_moe.routing` (U rows this rank sends, one
per token and destination rank; P ranks of the EP group). One EP>1 layer forward is:

1. :func:`gather_counts`: every rank learns, per source and destination rank, how many
   rows and kept slots go there (:func:`ep_moe.routing.rank_counts`), in one all-gather
   and the layer's single host sync per call (after the first call's config check).
2. :func:`rank_splits`: this rank's split sizes, which ``all_to_all_single`` needs.
3. :func:`start_dispatch`: rows (and their local expert ids and top-k weights) go to the
   destination ranks and arrive grouped by source rank; the receiver routes them to its
   experts as an EP=1 layer would (gather on GEMM1's load, slot sum after GEMM2).
4. :func:`start_combine`: the reverse all-to-all returns one summed row per sent row to
   the rank that sent it, in the order it was sent.

The exchanges are asynchronous (:class:`~ep_moe.ep.base.PendingExchange`) so that
:mod:`ep_moe.ep.pipeline` can overlap the backward's returning row gradients with the weight-gradient GEMMs.
:class:`NcclExchange` bundles them per layer call. With a group of one rank (or none) no
collective runs: the functions return their input.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ep_moe.ep.base import Dispatcher, PendingExchange, all_gather_single, group_size, round_up
from ep_moe.ep.pipeline import expert_pipeline
from ep_moe.kernels.grouped_gemm import eager_or_graph_break
from ep_moe.kernels.permute import gather_tokens, permute_tokens, sum_slot_rows
from ep_moe.routing import (
    RankRouting,
    RouterOutput,
    build_rank_routing,
    build_routing_metadata,
    rank_counts,
)

if TYPE_CHECKING:
    from ep_moe.experts import GroupedExperts


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


class PendingCounts:
    """:func:`start_gather_counts` in flight; :meth:`result` waits for the counts only.
    ``keep``: tensors the all-gather reads or writes on NCCL's stream, held until the
    host has seen it finish (the current stream does not wait for it, so freeing them
    earlier would let the current stream reuse their memory while NCCL works on it)."""

    _keep: tuple = ()  # also for an instance torch.compile made without __init__ (its __del__ runs)

    def __init__(self, host: torch.Tensor, shape: tuple, event: Optional[torch.cuda.Event] = None,
                 keep: tuple = ()) -> None:
        self._host, self._shape, self._event, self._keep = host, shape, event, keep

    @eager_or_graph_break  # the host sync: eager under torch.compile
    def result(self) -> list:
        """The nested lists ``all[q][p]`` (host ints; blocks until they are here)."""
        self._release()
        return self._host.view(self._shape).tolist()

    def _release(self) -> None:
        if self._keep:
            self._event.synchronize()
            self._keep = ()

    def __del__(self) -> None:  # dropped unread (an error in between): still release safely
        self._release()


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


@eager_or_graph_break  # streams, events and async collectives stay eager under torch.compile
def start_gather_counts(counts_PX: torch.Tensor, group: Optional[ProcessGroup]) -> PendingCounts:
    """Start gathering every rank's per-destination counts: ``counts_PX[p]`` holds X
    numbers this rank has for rank p; :meth:`PendingCounts.result` returns nested lists
    ``all[q][p]``, rank q's ``counts_PX[p]``. Reading the result is the layer's single host
    sync (``all_to_all_single`` needs its split sizes as ints).

    On CUDA the counts come to pinned host memory on a side stream, so the host waits for
    them alone: work queued on the current stream after this call keeps the GPU busy while
    the host waits, and after."""
    size = group_size(group)
    shape = (size,) + tuple(counts_PX.shape)
    if size == 1:
        return PendingCounts(counts_PX, shape)
    counts_PX = counts_PX.contiguous()
    every = counts_PX.new_empty((size * counts_PX.shape[0],) + tuple(counts_PX.shape[1:]))
    if counts_PX.device.type != "cuda":
        all_gather_single(every, counts_PX, group=group)  # concatenated along dim 0
        return PendingCounts(every, shape)
    work = all_gather_single(every, counts_PX, group=group, async_op=True)
    if counts_PX.device not in _copy_streams:
        _copy_streams[counts_PX.device] = torch.cuda.Stream(counts_PX.device)
    stream = _copy_streams[counts_PX.device]
    host = torch.empty(every.shape, dtype=every.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        work.wait()  # this stream, not the current one, waits for the all-gather
        host.copy_(every, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return PendingCounts(host, shape, event, keep=(work, counts_PX, every))


def gather_counts(counts_PX: torch.Tensor, group: Optional[ProcessGroup]) -> list:
    """:func:`start_gather_counts` and its result at once."""
    return start_gather_counts(counts_PX, group).result()


def rank_splits(counts: list, rank: int) -> SplitSizes:
    """Rank ``rank``'s split sizes from :func:`gather_counts`'s lists (rows are the first of
    the X numbers)."""
    return SplitSizes(send=[x[0] for x in counts[rank]], recv=[per_rank[rank][0] for per_rank in counts])


@eager_or_graph_break  # streams, events and async collectives stay eager under torch.compile
def start_exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                   group: Optional[ProcessGroup]) -> PendingExchange:
    """Start ``all_to_all_single`` of the rows of ``x`` with uneven splits (not
    differentiable; :mod:`ep_moe.ep.pipeline` wires the backward). No group: ``x`` itself."""
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


_PACK_ALIGN = 8
"""Bytes each packed part's width is rounded up to, so every part unpacks as a view."""


@dataclass(frozen=True)
class PackedRows:
    """Several [rows, ...] tensors of any dtypes side by side, as the bytes of each row
    (``data``, uint8 [rows, width]), to travel in one all-to-all (:func:`pack_rows`)."""

    data: torch.Tensor
    parts: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    """Dtype and trailing shape of each part, in order."""

    def first_rows(self, num_rows: int) -> "PackedRows":
        """The first ``num_rows`` rows (contiguous)."""
        return PackedRows(self.data[:num_rows], self.parts)

    def unpack(self) -> list[torch.Tensor]:
        """The parts, as strided views of ``data`` (no copies)."""
        result, start = [], 0
        for dtype, tail in self.parts:
            width = math.prod(tail) * dtype.itemsize
            piece = self.data[:, start: start + width].view(dtype)
            result.append(piece.view(piece.shape[0], *tail) if len(tail) == 1 else piece.unflatten(1, tail))
            start += round_up(width, _PACK_ALIGN)
        return result


def pack_rows(parts: list[torch.Tensor]) -> PackedRows:
    """:class:`PackedRows` of ``parts`` (same number of rows, not differentiable)."""
    widths = [math.prod(p.shape[1:]) * p.element_size() for p in parts]
    data = torch.empty((parts[0].shape[0], sum(round_up(w, _PACK_ALIGN) for w in widths)), dtype=torch.uint8,
                       device=parts[0].device)
    start = 0
    for part, width in zip(parts, widths):
        if part.numel():
            data[:, start: start + width] = part.detach().contiguous().view(torch.uint8).view(part.shape[0], width)
        start += round_up(width, _PACK_ALIGN)
    return PackedRows(data, tuple((p.dtype, tuple(p.shape[1:])) for p in parts))


class PendingPacked:
    """:func:`start_dispatch_packed` in flight; :meth:`wait` returns the arrived parts."""

    def __init__(self, pending: PendingExchange, parts: tuple) -> None:
        self._pending, self._parts = pending, parts

    def wait(self) -> list[torch.Tensor]:
        """The arrived parts ([S, ...] each, views of one buffer; not differentiable), once
        the current stream may use them."""
        return PackedRows(self._pending.wait(), self._parts).unpack()


def start_dispatch_packed(packed: PackedRows, splits: SplitSizes, group: Optional[ProcessGroup]) -> PendingPacked:
    """Start dispatching packed rows in one all-to-all."""
    return PendingPacked(start_dispatch(packed.data, splits, group), packed.parts)


def dispatch_packed(packed: PackedRows, splits: SplitSizes, group: Optional[ProcessGroup]) -> list[torch.Tensor]:
    """:func:`start_dispatch_packed` and its arrived parts at once."""
    return start_dispatch_packed(packed, splits, group).wait()


class NcclExchange:
    """The all-to-alls of one layer call's pipeline through ``all_to_all_single`` (NCCL
    on GPU, gloo on CPU; no collective without a group), as an
    :class:`ep_moe.ep.base.Exchange`; ``kind`` names the message (rows, weights)."""

    uses_sms = True
    """NCCL's all-to-all runs as kernels: GEMMs that overlap it leave it SMs."""

    def __init__(self, group: Optional[ProcessGroup], splits: SplitSizes) -> None:
        self.group, self.splits = group, splits

    def dispatch(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """:func:`start_dispatch` of ``x``."""
        return start_dispatch(x, self.splits, self.group)

    def combine(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """:func:`start_combine` of ``x``."""
        return start_combine(x, self.splits, self.group)


@dataclass
class RoutedRows:
    """What :meth:`AllToAllDispatcher.dispatch` hands its later steps: the rows on their way."""

    backend: str
    routing: RankRouting
    """This rank's (token, destination rank) pairs, cut to the rows sent."""
    send_rows: torch.Tensor
    send_weights: torch.Tensor
    exchange: NcclExchange
    rows_in: PendingExchange
    ids_in: "PendingPacked"
    """The arrived rows' local expert ids and top-k weights, in flight."""
    num_kept: int
    """Slots of the arrived rows that chose this rank's experts."""


class AllToAllDispatcher(Dispatcher):
    """``dispatch="all_to_all"``: one host sync per call (the split sizes), any token count
    per rank; each token travels once per destination rank, and the receiver expands it to
    its experts and sums their outputs before sending one row back."""

    # Both steps run eagerly under torch.compile: the host sync, collectives and side
    # streams make graph breaks of nearly every line.
    @eager_or_graph_break
    def dispatch(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                 backend: str) -> RoutedRows:
        """Count, sort and send: one all-gather of counts and one host sync, then the rows."""
        ids_TK = router.topk_ids_TK
        send_P, counts_PX = rank_counts(ids_TK, keep_TK, self.num_local, self.size)
        pending_counts = start_gather_counts(counts_PX, self.group)
        # Queue all that does not need the split sizes before the host waits for them, so
        # the GPU has work while the host issues the rest: the (token, rank) sort, padded to
        # T*min(P, K) rows of which the first U are sent; the top-k weights and local expert
        # ids of those rows, packed to travel in one message; the send rows themselves.
        routing = build_rank_routing(ids_TK, keep_TK, send_P, self.num_local)
        weights_U = permute_tokens(router.topk_weights_TK, routing.pairs, backend)
        packed = pack_rows([routing.local_ids_UK, weights_U])
        early_rows = gather_tokens(x_TH, routing.pairs, routing.num_sent, backend)
        counts = pending_counts.result()  # [source][destination][rows, slots]: the host sync
        splits = rank_splits(counts, self.rank)
        num_sent = sum(splits.send)
        # Right after the sync, the exchanges: first the small one of expert ids and weights,
        # then the rows, which travel while the host queues the receiver's routing (the GPU
        # would otherwise idle until the host has issued it).
        routing = routing.first_rows(num_sent)
        packed_in = start_dispatch_packed(packed.first_rows(num_sent), splits, self.group)
        exchange = NcclExchange(self.group, splits)
        send_rows = permute_tokens(x_TH, routing.pairs, backend, gathered=early_rows[:num_sent])
        with torch.no_grad():
            rows_in = exchange.dispatch(send_rows, "rows")
        num_kept = sum(source[self.rank][1] for source in counts)
        return RoutedRows(backend, routing, send_rows, weights_U[:num_sent], exchange, rows_in, packed_in, num_kept)

    @eager_or_graph_break
    def experts(self, routed: RoutedRows, experts: "GroupedExperts") -> torch.Tensor:
        """The arrived rows routed to the local experts, the experts on them (GEMM2 sums each
        row's slots) and one row back per row received, through the expert pipeline: [U, H]
        in send order."""
        recv_ids_SK, recv_weights_SK = routed.ids_in.wait()  # local expert ids, -1 for slots sent elsewhere
        local = build_routing_metadata(recv_ids_SK.clamp(min=0), self.num_local, recv_ids_SK >= 0,
                                       num_kept=routed.num_kept)
        # looked up only if the kernels run (a small eager call runs torch._grouped_mm instead)
        configs = functools.partial(experts.kernel_configs, routed.backend, local.slot_index_R.shape[0],
                                    routed.send_rows)
        expert_fn = functools.partial(experts.on_routed_rows, backend=routed.backend, configs=configs)
        return expert_pipeline(expert_fn, local, routed.exchange, experts.expert_tensors(), routed.send_rows,
                               routed.send_weights, recv_weights_SK, routed.rows_in)

    def combine(self, routed: RoutedRows, out: torch.Tensor) -> torch.Tensor:
        """Each token's returned rows summed (one per destination rank): [T, H]."""
        return sum_slot_rows(out, routed.routing.pairs, routed.backend)
