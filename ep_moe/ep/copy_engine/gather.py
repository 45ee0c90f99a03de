"""The all-gather dispatch on the copy engines (``dispatch="all_gather_copy_engine"``):
:class:`CopyEngineGather`, the exchange, and :class:`AllGatherCopyEngineDispatcher`."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch.distributed import ProcessGroup

from ep_moe.ep.all_gather import AllGatherDispatcher, GatherExchange
from ep_moe.ep.base import PendingExchange, round_up
from ep_moe.ep.copy_engine.workspace import _ALIGN, SymmetricWorkspace, copy_engine_supported
from ep_moe.kernels.arrival import Departure, Landing, rows_departing


class CopyEngineGather(GatherExchange):
    """The all-gather dispatch (:class:`~ep_moe.ep.all_gather.GatherExchange`) with the rows'
    all-gathers and the forward's reduce-scatter on the copy engines, each overlapped with
    the GEMM at its end; capturable in CUDA graphs.

    A dispatch of rows claims this rank's region of its workspace (waits until every peer
    has pulled what was staged there last), stages this rank's [T, H] there and copies them
    into its own slot of the output (all on the current stream, so the own rows are there
    before any reader), then pulls the peers' rows on the copy engines in landing order, the
    next rank first, raising the landing flag to w after the w-th source (the 0/1 handshake
    of the module docstring). The exchange comes back with its
    :class:`~ep_moe.kernels.arrival.Landing`: the grouped GEMM that reads the rows first (the
    up projection in the forward, the down projection's dX in the backward) waits tile by
    tile for its source instead of the whole transfer (:mod:`ep_moe.kernels.arrival`);
    everything after waits for the transfer (``PendingExchange.wait``).

    The forward's reduce-scatter of the partial sums: inside :meth:`departing` the down
    projection sums the tokens source by source, the peers' first (a
    :class:`~ep_moe.kernels.arrival.Departure`), and as each source's [T, H] sums are queued
    the copy engines push them into that rank's *inbox* in its workspace (after waiting until
    it has read what it got there last) and raise its arrived flag. :meth:`combine` then waits
    for every peer's sums on the device and adds them to the own ones. The expert ids and
    top-k weights (small, needed at once by the routing) and the backward's reduce-scatter
    (under the dW GEMMs already) stay on NCCL.

    Every rank must make the same sequence of :meth:`dispatch`, :meth:`departing` and
    :meth:`combine` calls with the same ``num_tokens``."""

    def __init__(self, group: ProcessGroup, workspace: SymmetricWorkspace, num_tokens: int, row_bytes: int,
                 landing: bool = True) -> None:
        super().__init__(group)
        self.workspace, self.rank, self.num_tokens = workspace, workspace.rank, num_tokens
        self.landing = landing
        """Whether the rows' dispatches hand them over while they land (their first reader is a
        Triton grouped GEMM that waits source by source); else they come whole, after the
        transfer (the reference GEMMs read them like any tensor)."""
        # the staged rows [T, H], then the inbox of the peers' sums [P-1, T, H]
        self.inbox_offset = round_up(num_tokens * row_bytes, _ALIGN)
        workspace.reserve(self.inbox_offset + (self.size - 1) * num_tokens * row_bytes)
        self._departure: Optional[Departure] = None
        self._pushed: Optional[torch.cuda.Event] = None  # after the last push

    def dispatch(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """All-gather ``x`` [T, ...]: rows on the copy engines (landing source by source),
        anything else (``kind`` other than ``"rows"``) on NCCL."""
        if kind != "rows":
            return super().dispatch(x, kind)
        ws, me, size = self.workspace, self.rank, self.size
        rows, row_shape = x.shape[0], tuple(x.shape[1:])
        x = x.detach()
        ws.claim_region()
        ws.view(me, 0, rows, row_shape, x.dtype).copy_(x)
        out = x.new_empty((size * rows, *row_shape))
        out[me * rows: (me + 1) * rows].copy_(x)
        landed = ws.clear_landed()
        ws.follow_compute()  # staged, `out` allocated, the landing flag cleared
        ws.signal_staged()
        with ws.copying():
            for w in range(1, size):
                source = (me + w) % size
                ws.await_staged(source)
                out[source * rows: (source + 1) * rows].copy_(ws.view(source, 0, rows, row_shape, x.dtype))
                ws.signal_landed(w)
                ws.signal_pulled(source)
        return ws.finish(out, Landing(landed, 0, size) if self.landing else None)

    @contextlib.contextmanager
    def departing(self, like: torch.Tensor):
        """Around the expert function, whose output is like ``like`` [P*T, H]: a
        slot-summing down projection inside sends each source's sums as it finishes them
        (without tokens nothing is sent: the combine is NCCL's)."""
        if self.num_tokens == 0:
            yield
            return
        out = torch.empty_like(like)
        departure = Departure(out, tuple(range(1, self.size)) + (0,), self.rank,
                              lambda position: self._send(out, position))
        self._departure = departure
        try:
            with rows_departing(departure):
                yield
        except BaseException:
            # Stopped between the sends and the combine (a checkpoint's recompute stops once
            # it has what the backward needs, at the same point on every rank): take the
            # peers' sums in and free the inbox as the combine would, so the next call finds
            # the flags at rest. Stopped halfway through the sends (an error in the GEMM),
            # the exchange is left as after a failed rank in any collective.
            self._departure = None
            if departure.complete:
                self._receive(like)
                self.workspace.free_inbox()
            raise

    def _send(self, sums: torch.Tensor, position: int) -> None:
        """Push the sums of landing position ``position``'s tokens into that rank's inbox
        (on the copy engines, after the work queued so far)."""
        if position == 0:  # the own tokens' sums stay here
            return
        ws, me, size, rows = self.workspace, self.rank, self.size, self.num_tokens
        receiver = (me + position) % size
        slot = (me - receiver) % size - 1  # senders fill the receiver's inbox by distance
        ws.follow_compute()
        ws.claim_inbox(receiver)
        row_bytes = math.prod(sums.shape[1:]) * sums.element_size()
        with ws.copying():  # the push itself on the copy engines, between the flag wait and raise
            ws.view(receiver, self.inbox_offset + slot * rows * row_bytes, rows, tuple(sums.shape[1:]),
                    sums.dtype).copy_(sums[receiver * rows: (receiver + 1) * rows])
        ws.signal_arrived(receiver)
        ws.keep_for_copies(sums)
        self._pushed = ws.mark_copies()

    def combine(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """Reduce-scatter ``x`` [P*T, ...]: the forward's rows (sent from :meth:`departing`)
        on the copy engines, anything else on NCCL."""
        departure = self._departure if kind == "rows" else None
        if departure is None:
            return super().combine(x, kind)
        self._departure = None
        if departure.used and (x.data_ptr() != departure.out.data_ptr() or x.shape != departure.out.shape):
            raise RuntimeError("the expert function must return the slot-summing down projection's output as it "
                               "is: its sums were sent source by source, and a changed output would not be")
        if not departure.used:  # no GEMM sent them source by source: send the finished sums
            departure.out.copy_(x)
            for position in departure.order:
                departure.send(position)
        inbox = self._receive(x)
        me, rows = self.rank, self.num_tokens
        own = departure.out[me * rows: (me + 1) * rows]
        # summed in fp32 and returned in the rows' dtype, whatever autocast is on: CUDA's
        # autocast runs `sum` in fp32, and an fp32 output would make the backward's output
        # gradients fp32, which autograd then casts for the down projection before they land
        out = torch.sum(inbox, 0, dtype=torch.float32).add_(own).to(own.dtype)
        self.workspace.free_inbox()
        return PendingExchange(out)

    def _receive(self, like: torch.Tensor) -> torch.Tensor:
        """On the current stream: wait for the peers' sums (and this rank's own pushes); the
        inbox [P-1, T, ...] (rows like ``like``'s), until ``free_inbox``."""
        ws, rows = self.workspace, self.num_tokens
        ws.await_inbox()
        pushed, self._pushed = self._pushed, None
        if pushed is not None:  # this rank's pushes are done too (and, in a capture, joined)
            ws.wait_copies(pushed)
        inbox = ws.view(self.rank, self.inbox_offset, (self.size - 1) * rows, tuple(like.shape[1:]), like.dtype)
        return inbox.view(self.size - 1, rows, *like.shape[1:])


class AllGatherCopyEngineDispatcher(AllGatherDispatcher):
    """``dispatch="all_gather_copy_engine"``: :class:`~ep_moe.ep.all_gather.AllGatherDispatcher`
    with :class:`CopyEngineGather` as the exchange. Only the Triton GEMMs wait for rows that
    land source by source: with the torch backend the rows are handed over whole."""

    COUNTS_BY_SOURCE = True

    def exchange(self, x_TH: torch.Tensor, backend: str) -> CopyEngineGather:
        """The copy engines' exchange of one call (raises where they cannot run)."""
        supported, reason = copy_engine_supported(self.group)  # collective on first use
        if not supported:
            raise RuntimeError(f"MoEConfig.dispatch='all_gather_copy_engine' cannot run here: {reason}; "
                               "use dispatch='all_gather'")
        workspace = SymmetricWorkspace.for_group(self.group, x_TH.device)
        return CopyEngineGather(self.group, workspace, x_TH.shape[0], x_TH.shape[1] * x_TH.element_size(),
                                landing=backend == "triton")
