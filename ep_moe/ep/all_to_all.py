"""``dispatch="all_to_all"``: each token goes to the ranks that hold its experts, over
uneven ``all_to_all_single`` (NCCL on GPU, gloo on CPU), and one summed row per token and
rank comes back (:class:`AllToAllDispatcher`).

Shape suffixes follow the legend in :mod:`ep_moe.routing` (U rows this rank sends, one
per token and destination rank; P ranks of the EP group). One EP>1 layer forward is:

1. :func:`start_gather_counts`: every rank learns, per source and destination rank, how
   many rows and kept slots go there (:func:`ep_moe.routing.rank_counts`) and each rank's
   vote for the slot-row format (below), in one all-gather and the layer's single host
   sync per call (after the first call's config check).
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

Where every rank of the group votes for it (a small eager call on each,
:func:`ep_moe.ep.slot_rows.wants_slot_rows`), the call takes the slot-row format of
:mod:`ep_moe.ep.slot_rows` instead: one row per kept slot, whose experts the receiver
learns from the counts, so neither ids nor weights travel; the experts run outside the
pipeline, between two differentiable all-to-alls (:func:`exchange_rows`), in about half the
torch ops. A rank that voted for it while another did not queues the main format's
first steps after the sync instead of before it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ep_moe.distributed import all_gather_single, group_size
from ep_moe.ep.base import Dispatcher, PendingExchange, refuse_double_backward, round_up
from ep_moe.ep.fp8_wire import pack_fp8_rows, rows_placeholder
from ep_moe.ep.pipeline import expert_pipeline
from ep_moe.ep.slot_rows import (
    EXPERT_COUNTS,
    VOTE,
    SlotRows,
    arrived_expert_order,
    combine_slot_rows,
    slot_counts,
    sort_slot_rows,
    wants_slot_rows,
)
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

    def __init__(self, host: torch.Tensor, gathered: torch.Tensor, event: Optional[torch.cuda.Event] = None,
                 keep: tuple = ()) -> None:
        self._host, self._event, self._keep = host, event, keep
        self.gathered = gathered
        """Every rank's counts on the device, [P, P, X] (``all[q][p]``): for the current
        stream once :meth:`result` has returned (the host has then seen the all-gather end)."""

    @eager_or_graph_break  # the host sync: eager under torch.compile
    def result(self) -> list:
        """The nested lists ``all[q][p]`` (host ints; blocks until they are here)."""
        self._release()
        return self._host.tolist()

    def _release(self) -> None:
        if self._keep:
            self._event.synchronize()
            self._keep = ()

    def __del__(self) -> None:  # dropped unread (an error in between): still release safely
        self._release()


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


@eager_or_graph_break  # streams, events and async collectives stay eager under torch.compile
def start_gather_counts(counts_PX: torch.Tensor, group: Optional[ProcessGroup],
                        host_columns: Optional[int] = None) -> PendingCounts:
    """Start gathering every rank's per-destination counts: ``counts_PX[p]`` holds X
    numbers this rank has for rank p; :meth:`PendingCounts.result` returns nested lists
    ``all[q][p]``, rank q's ``counts_PX[p]`` (its first ``host_columns`` numbers only, when
    given: the rest stay on the device, :attr:`PendingCounts.gathered`). Reading the result
    is the layer's single host sync (``all_to_all_single`` needs its split sizes as ints).

    On CUDA the counts come to pinned host memory on a side stream, so the host waits for
    them alone: work queued on the current stream after this call keeps the GPU busy while
    the host waits, and after."""
    size = group_size(group)
    counts_PX = counts_PX.contiguous()
    shape = (size,) + tuple(counts_PX.shape)
    columns = slice(None) if host_columns is None else slice(0, host_columns)
    if size == 1:
        every = counts_PX.view(shape)
        return PendingCounts(every[..., columns], every)
    every = counts_PX.new_empty(shape)
    if counts_PX.device.type != "cuda":
        all_gather_single(every.view(-1, *shape[2:]), counts_PX, group=group)  # concatenated along dim 0
        return PendingCounts(every[..., columns], every)
    work = all_gather_single(every.view(-1, *shape[2:]), counts_PX, group=group, async_op=True)
    if counts_PX.device not in _copy_streams:
        _copy_streams[counts_PX.device] = torch.cuda.Stream(counts_PX.device)
    stream = _copy_streams[counts_PX.device]
    host = torch.empty(every[..., columns].shape, dtype=every.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        work.wait()  # this stream, not the current one, waits for the all-gather
        host.copy_(every[..., columns], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return PendingCounts(host, every, event, keep=(work, counts_PX, every))


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


class _RowsExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return start_exchange(x, output_splits, input_splits, group).wait()

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()  # before once_differentiable's no_grad hides create_graph
        return _RowsExchange.once_backward(ctx, grad)

    @staticmethod
    @once_differentiable
    def once_backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return start_exchange(grad.contiguous(), input_splits, output_splits, ctx.group).wait(), None, None, None


def exchange_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                  group: Optional[ProcessGroup]) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``x``, differentiable: the backward sends the
    gradients back the way the rows came. No group: ``x`` itself."""
    if group_size(group) == 1:
        return x
    return _RowsExchange.apply(x, output_splits, input_splits, group)


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


def _no_rows_out(rows_SH: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The experts' output on a rank that received no rows ([0, H]), without running them,
    yet depending on the arrived rows and the experts' tensors (a zero gradient to each), as
    every other rank's output does: each rank's backward then runs both exchanges, which
    its peers wait for (an expert module's output on no rows may depend on nothing)."""
    out_SH = rows_SH.new_zeros(rows_SH.shape)
    for t in (rows_SH, *tensors):
        if t.requires_grad:
            out_SH = out_SH + t.sum().to(out_SH.dtype) * 0
    return out_SH


@dataclass
class ArrivedSlotRows:
    """What :meth:`AllToAllDispatcher.dispatch` hands its later steps in the slot-row format
    (:mod:`ep_moe.ep.slot_rows`): the rows have arrived."""

    backend: str
    sent: SlotRows
    """This rank's slots, cut to the kept ones (the rows sent)."""
    splits: SplitSizes
    rows_SH: torch.Tensor
    """The kept slots' rows that arrived here, grouped by source, each source's by expert."""
    counts_Pe: torch.Tensor
    """Kept slots each source sent to each local expert (int64 [P, e], on the device)."""


class AllToAllDispatcher(Dispatcher):
    """``dispatch="all_to_all"``: one host sync per call (the split sizes), any token count
    per rank; each token travels once per destination rank, and the receiver expands it to
    its experts and sums their outputs before sending one row back. A small eager call on
    every rank sends one row per kept slot instead (:mod:`ep_moe.ep.slot_rows`)."""

    # Both steps run eagerly under torch.compile: the host sync, collectives and side
    # streams make graph breaks of nearly every line.
    @eager_or_graph_break
    def dispatch(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                 backend: str) -> "RoutedRows | ArrivedSlotRows":
        """Count, sort and send: one all-gather of counts and one host sync, then the rows."""
        ids_TK = router.topk_ids_TK
        send_P, counts_P2 = rank_counts(ids_TK, keep_TK, self.num_local, self.size)
        slots = None
        if backend == "triton" and wants_slot_rows(x_TH, ids_TK.numel()):
            slots = sort_slot_rows(x_TH, router, keep_TK, self.config.num_experts)
        pending_counts = start_gather_counts(slot_counts(counts_P2, slots, self.num_local), self.group,
                                             host_columns=EXPERT_COUNTS)
        # Queue all that does not need the split sizes before the host waits for them, so
        # the GPU has work while the host issues the rest.
        early = None if slots is not None else self._before_counts(x_TH, router, keep_TK, send_P, backend)
        counts = pending_counts.result()  # [source][destination][rows, slots, vote]: the host sync
        if all(source[0][VOTE] for source in counts):
            return self._send_slot_rows(slots, counts, pending_counts.gathered, backend)
        if early is None:  # this rank voted for the slot rows, another did not
            early = self._before_counts(x_TH, router, keep_TK, send_P, backend)
        return self._send_rank_rows(x_TH, early, counts, backend)

    def _before_counts(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                       send_P: torch.Tensor, backend: str) -> tuple:
        """The main format's work before the split sizes are known: the (token, rank) sort,
        padded to T*min(P, K) rows of which the first U are sent; the top-k weights and
        local expert ids of those rows, packed to travel in one message; the send rows (with
        FP8 experts their e4m3 message, :mod:`ep_moe.ep.fp8_wire`)."""
        routing = build_rank_routing(router.topk_ids_TK, keep_TK, send_P, self.num_local)
        weights_U = permute_tokens(router.topk_weights_TK, routing.pairs, backend)
        packed = pack_rows([routing.local_ids_UK, weights_U])
        if self.fp8_rows:  # the rows' message itself, quantized through the gather (the sent rows only)
            early_rows = pack_fp8_rows(x_TH, routing.pairs.token_index_R, limit=routing.num_sent)
        else:
            early_rows = gather_tokens(x_TH, routing.pairs, routing.num_sent, backend)
        return routing, weights_U, packed, early_rows

    def _send_rank_rows(self, x_TH: torch.Tensor, early: tuple, counts: list, backend: str) -> RoutedRows:
        """The main format's exchanges, right after the sync: first the small one of expert
        ids and weights, then the rows, which travel while the host queues the receiver's
        routing (the GPU would otherwise idle until the host has issued it)."""
        routing, weights_U, packed, early_rows = early
        splits = rank_splits(counts, self.rank)
        num_sent = sum(splits.send)
        routing = routing.first_rows(num_sent)
        packed_in = start_dispatch_packed(packed.first_rows(num_sent), splits, self.group)
        exchange = NcclExchange(self.group, splits)
        message = early_rows[:num_sent]
        # the sent rows in autograd (their gradient comes back to x_TH): the message's rows, or
        # a placeholder for its e4m3 rows
        gathered = rows_placeholder(num_sent, x_TH.shape[1], x_TH.dtype, x_TH.device) if self.fp8_rows else message
        send_rows = permute_tokens(x_TH, routing.pairs, backend, gathered=gathered)
        rows_in = exchange.dispatch(message, "rows")
        num_kept = sum(source[self.rank][1] for source in counts)
        return RoutedRows(backend, routing, send_rows, weights_U[:num_sent], exchange, rows_in, packed_in, num_kept)

    def _send_slot_rows(self, slots: SlotRows, counts: list, gathered: torch.Tensor,
                        backend: str) -> ArrivedSlotRows:
        """The slot-row format's exchange: each destination's kept slots (as many as the
        second count), which arrive grouped by source."""
        splits = SplitSizes(send=[x[1] for x in counts[self.rank]], recv=[source[self.rank][1] for source in counts])
        num_sent = sum(splits.send)
        sent = SlotRows(slots.meta.first_rows(num_sent), slots.rows_NH[:num_sent], slots.weights_TK)
        rows_SH = exchange_rows(sent.rows_NH, splits.recv, splits.send, self.group)
        return ArrivedSlotRows(backend, sent, splits, rows_SH, gathered[:, self.rank, EXPERT_COUNTS:])

    @eager_or_graph_break
    def experts(self, routed: "RoutedRows | ArrivedSlotRows", experts: "GroupedExperts") -> torch.Tensor:
        """The arrived rows routed to the local experts, the experts on them and one row back
        per row received, in send order: [U, H], each row's slots weighted and summed
        (through the expert pipeline), or in the slot-row format the kept slots' rows,
        unweighted."""
        if isinstance(routed, ArrivedSlotRows):
            return self._slot_row_experts(routed, experts)
        recv_ids_SK, recv_weights_SK = routed.ids_in.wait()  # local expert ids, -1 for slots sent elsewhere
        local = build_routing_metadata(recv_ids_SK.clamp(min=0), self.num_local, recv_ids_SK >= 0,
                                       num_kept=routed.num_kept)
        # looked up only if the kernels run (a small eager call runs torch._grouped_mm instead)
        configs = functools.partial(experts.kernel_configs, routed.backend, local.slot_index_R.shape[0],
                                    routed.send_rows)
        expert_fn = functools.partial(experts.on_routed_rows, backend=routed.backend, configs=configs)
        return expert_pipeline(expert_fn, local, routed.exchange, experts.expert_tensors(), routed.send_rows,
                               routed.send_weights, recv_weights_SK, routed.rows_in, fp8_rows=self.fp8_rows)

    def _slot_row_experts(self, routed: ArrivedSlotRows, experts: "GroupedExperts") -> torch.Tensor:
        """The experts on the arrived slot rows in expert order, each output row back to its
        sender: [kept slots sent, H]."""
        num_rows = routed.splits.num_recv
        if num_rows == 0:
            out_SH = _no_rows_out(routed.rows_SH, experts.expert_tensors())
        else:
            m_sizes_e, order_S = arrived_expert_order(routed.counts_Pe, num_rows)
            configs = functools.partial(experts.kernel_configs, routed.backend, num_rows, routed.rows_SH)
            out_SH = experts(routed.rows_SH, m_sizes_e, gather_index=order_S, scatter_index=order_S,
                             backend=routed.backend, configs=configs, gather_slots=order_S)
        return exchange_rows(out_SH, routed.splits.send, routed.splits.recv, self.group)

    def combine(self, routed: "RoutedRows | ArrivedSlotRows", out: torch.Tensor) -> torch.Tensor:
        """Each token's returned rows summed (one per destination rank, or in the slot-row
        format one per kept slot, weighted here): [T, H]."""
        if isinstance(routed, ArrivedSlotRows):
            return combine_slot_rows(out, routed.sent.meta, routed.sent.weights_TK)
        return sum_slot_rows(out, routed.routing.pairs, routed.backend)
