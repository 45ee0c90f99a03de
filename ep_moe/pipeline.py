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

    comm:     grads 0 |            | rows back 0, top-k weight grads 0 |
    compute:          | dX chain 0 | dW GEMMs (one program per tile)

(the top-k weights travel with the expert ids before the pipeline; their gradients go
back from inside it, right after each chunk's input gradients).

With ``MoEConfig.own_rows_first`` the rows a rank sends itself (:class:`OwnRows`, about
1/P of a chunk's rows) need no exchange: the experts run on them from the send buffer
while the dispatch carries the rest, and in the backward while the gradients travel;
the combine carries zeros for them (the dispatch still brings them, unused), and their
results are written into its output::

    comm:     dispatch 0 (others' rows)  |          | combine 0 |
    compute:  own rows 0 (one prog/tile) | others 0 |

An exchange whose rows land source by source (:class:`ep_moe.copy_engine.CopyEngineGather`,
``PendingExchange.landing``) hands them to the experts before they have landed: the
experts' first GEMM on them (the up projection; in the backward, the down projection's dX)
waits tile by tile for each source (:mod:`ep_moe.kernels.arrival`), and the compute stream
waits for the whole transfer once the expert function is queued. Such an exchange may also
send the forward's output while the experts produce it (``departing``: the down projection
sums the tokens source by source and each source's sums leave at once).

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
from ep_moe.kernels.arrival import RowArrival, rows_arriving
from ep_moe.kernels.grouped_gemm import one_program_per_tile
from ep_moe.kernels.ops import DeferredWeightGrads, defer_weight_grads
from ep_moe.routing import RoutingMetadata


@dataclass(frozen=True)
class OwnRows:
    """The rows of a chunk that a rank sends itself: they need no all-to-all, so the
    experts run on them (from the send buffer) while the exchange carries the rest."""

    sent_start: int
    """First of them in the chunk's send order (and in the combined rows)."""
    arrived_start: int
    """First of them in the chunk's arrival order."""
    num_rows: int
    local: RoutingMetadata
    """Routing of these rows to this rank's experts (rows as tokens)."""


@dataclass(frozen=True)
class ChunkPlan:
    """Where one chunk's rows go and how the local experts take them."""

    splits: Optional[SplitSizes]
    """Rows sent to / received from each rank (None for the all-gather dispatch, where
    every rank receives every rank's rows)."""
    local: RoutingMetadata
    """Routing of the arrived rows to this rank's experts (rows as tokens); with ``own``,
    the slots of the own rows are left out (those arrived rows produce zeros)."""
    own: Optional[OwnRows] = None
    """The rows this rank sends itself, when run ahead of the exchange."""

    def own_part(self) -> "ChunkPlan":
        """The plan ``expert_fn`` gets for the own rows."""
        return ChunkPlan(self.splits, self.own.local)


class Exchange(Protocol):
    """The collectives of one layer call: the all-to-alls of
    :class:`ep_moe.dispatch.NcclExchange` or :class:`ep_moe.copy_engine.CopyEngineExchange`,
    or the all-gather / reduce-scatter of :class:`ep_moe.gathered.GatherExchange`."""

    uses_sms: bool
    """Whether the exchange's transfers run as kernels that need SMs (NCCL)."""

    def begin(self) -> None: ...
    def staging(self, chunk: int, kind: str, rows: int, row_shape: tuple,
                dtype: torch.dtype) -> Optional[torch.Tensor]: ...
    def dispatch(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange: ...
    def combine(self, x: torch.Tensor, chunk: int, kind: str) -> PendingExchange: ...
    # Optional: ``departing(chunk, like) -> context manager`` around chunk ``chunk``'s expert
    # function (output like ``like``), when the exchange sends the forward's output while the
    # experts still produce it (:class:`ep_moe.copy_engine.CopyEngineGather`).


def _departing(exchange: Exchange, chunk: int, like: torch.Tensor):
    """``exchange.departing(chunk, like)`` where the exchange has one, else nothing."""
    departing = getattr(exchange, "departing", None)
    return contextlib.nullcontext() if departing is None else departing(chunk, like)


ExpertFn = Callable[[torch.Tensor, torch.Tensor, ChunkPlan, torch.Tensor, torch.Tensor], torch.Tensor]
"""``expert_fn(rows_SH, weights_S, plan, gate_up, down) -> out_SH``: the local experts on
one chunk's arrived rows and their top-k weights (``[S]`` or ``[S, K]``), one output row
per arrived row, differentiable. ``gate_up`` and ``down`` come cast to the rows' dtype,
one cast per pipeline call that every chunk shares."""


class _ExpertPipeline(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_fn: ExpertFn, plans: list[ChunkPlan], exchange: Exchange,
                arrived_weights: list[torch.Tensor], dispatched: Optional[list[PendingExchange]], record: bool,
                gate_up: torch.Tensor, down: torch.Tensor, *rows_and_weights):
        num_chunks = len(plans)
        # GEMMs that overlap an exchange's kernels launch one program per tile: the own
        # rows' (under the dispatch) and, with several chunks, every chunk's.
        share_sms = exchange.uses_sms and num_chunks > 1
        send, send_weights = rows_and_weights[:num_chunks], rows_and_weights[num_chunks:]
        rows_in = dispatched if dispatched is not None else [
            exchange.dispatch(send[c], c, "rows") for c in range(num_chunks)]
        # Detached stand-ins: each chunk's graph ends at these leaves, whose grads the
        # backward collects and returns.
        weights = [_stand_in(w, record and w.requires_grad) for w in (gate_up, down)]
        # Each chunk's graph saves its tensors through the enclosing saved-tensor hooks (an
        # activation checkpoint's, save_on_cpu's), if any; the backward unpacks them itself,
        # in the outer graph task, so a checkpoint recomputes the region once, not once per
        # chunk's replayed backward (each its own graph task).
        saved = [_ChunkSaved.around_outer_hooks() for _ in plans]
        # one cast (autocast's) for every chunk: their dW sum in place
        with torch.set_grad_enabled(record), saved[0].recording():
            compute_weights = [w.to(send[0].dtype) for w in weights]
        graphs, own_graphs, rows_out = [], [], []
        for c, plan in enumerate(plans):
            own_graph = None
            if plan.own is not None:  # from the send buffer, while the dispatch travels
                own = plan.own
                own_rows = _own_slice(send[c], own, "sent")
                if record:  # saved for the backward: not a view pinning (or restaged with) the send buffer
                    own_rows = own_rows.clone()
                own_rows = _stand_in(own_rows, record and send[c].requires_grad)
                own_weights = _stand_in(_own_slice(arrived_weights[c], own, "arrived"),
                                        record and send_weights[c].requires_grad)
                with torch.set_grad_enabled(record), _sharing_sms(exchange.uses_sms), saved[c].recording():
                    own_graph = (expert_fn(own_rows, own_weights, plan.own_part(), *compute_weights), own_rows,
                                 own_weights)
            own_graphs.append(own_graph)
            # a stand-in: without a group the "received" rows are the sent tensors themselves
            rows, arrival = _rows_of(rows_in[c], plan)
            rows_SH = _stand_in(rows, record and send[c].requires_grad)
            row_weights_S = _stand_in(arrived_weights[c], record and send_weights[c].requires_grad)
            with torch.set_grad_enabled(record), _sharing_sms(share_sms), saved[c].recording(), \
                    rows_arriving(rows_SH, arrival, must_be_read=True), _departing(exchange, c, rows_SH):
                out_SH = expert_fn(rows_SH, row_weights_S, plan, *compute_weights)
            rows_in[c].wait()  # whatever reads the rows next waits for all of them
            graphs.append((out_SH, rows_SH, row_weights_S))
            rows_out.append(exchange.combine(out_SH.detach(), c, "rows"))
        ctx.plans, ctx.exchange, ctx.share_sms, ctx.weights = plans, exchange, share_sms, weights
        ctx.graphs, ctx.own_graphs, ctx.saved = graphs, own_graphs, saved
        outs = tuple(pending.wait() for pending in rows_out)
        for plan, out, own_graph in zip(plans, outs, own_graphs):
            if own_graph is not None:  # the exchange brought zeros for these rows
                _own_slice(out, plan.own, "sent").copy_(own_graph[0].detach())
        return outs

    @staticmethod
    def backward(ctx, *grads_back):
        if ctx.graphs is None:
            raise RuntimeError("ep_moe's expert pipeline frees its graphs in the backward; a second "
                               "backward through the same MoE forward (retain_graph=True) is not supported")
        plans, exchange, weights = ctx.plans, ctx.exchange, ctx.weights
        num_chunks = len(plans)
        if num_chunks:  # before any exchange starts: a checkpoint recomputes the region here
            ctx.saved[0].unpack()
        # Which sent rows need a gradient: the same on every rank (the activations of the
        # same model), so every rank skips the same exchanges.
        need_rows = ctx.needs_input_grad[_SEND_ARG: _SEND_ARG + num_chunks]
        need_weights = ctx.needs_input_grad[_SEND_ARG + num_chunks:]
        exchange.begin()
        grads_back = [g.contiguous() for g in grads_back]
        grads_in = [exchange.dispatch(g, c, "rows") for c, g in enumerate(grads_back)]
        rows_back, weights_back = [], []
        weight_grads = DeferredWeightGrads(weights, private_leaves=True)  # the stand-ins
        for c, (plan, graph, own_graph) in enumerate(zip(plans, ctx.graphs, ctx.own_graphs)):
            ctx.saved[c].unpack()  # in this (the outer) graph task, before the chunk's own backward call
            recomputes = ctx.saved[c].replay_may_recompute
            own_grad = None if own_graph is None else _own_slice(grads_back[c], plan.own, "sent")
            if own_graph is not None and not recomputes:  # its gradients are here: no wait for the exchange
                _backward_into(own_graph, own_grad, weights, weight_grads, exchange.uses_sms)
            out_SH, rows_SH, row_weights_S = graph
            # a recompute inside the replay would dispatch into this chunk's landing flag
            # while these rows still land: take them whole first
            grad_in = grads_in[c].wait() if recomputes else grads_in[c]
            if own_graph is not None and recomputes:
                # every backward call recomputes the checkpointed forward (collectives
                # included): one call for both graphs, so that a rank with own rows
                # recomputes as often as one without
                _backward_together([own_graph, graph], [own_grad, grad_in], weights, weight_grads, ctx.share_sms)
            else:
                _backward_into(graph, grad_in, weights, weight_grads, ctx.share_sms, plan)
            if ctx.saved[c].replay_may_recompute:  # and it may have staged its own combines where
                exchange.begin()  # this chunk's go next: stage again once the peers pulled them
            rows_back.append(exchange.combine(_grad_or_zeros(rows_SH), c, "rows") if need_rows[c] else None)
            weights_back.append(None)
            if need_weights[c]:  # back to the senders, under the dW GEMMs
                grad_weights = _grad_or_zeros(row_weights_S)
                if own_graph is not None:  # zeros there so far
                    _own_slice(grad_weights, plan.own, "arrived").copy_(_grad_or_zeros(own_graph[2]))
                weights_back[c] = exchange.combine(grad_weights, c, "weights")
        # under the last chunk's row and top-k weight gradients' all-to-alls
        with _sharing_sms((any(need_rows) or any(need_weights)) and exchange.uses_sms):
            weight_grads.run()
        grads = []
        for w in weights:  # hand the grads over, so autograd can keep them instead of copying
            grads.append(w.grad)
            w.grad = None
        grad_send = []
        for plan, pending, own_graph in zip(plans, rows_back, ctx.own_graphs):
            grad = None if pending is None else pending.wait()
            if grad is not None and own_graph is not None:
                _own_slice(grad, plan.own, "sent").copy_(_grad_or_zeros(own_graph[1]))
            grad_send.append(grad)
        grad_send_weights = [None if p is None else p.wait() for p in weights_back]
        ctx.graphs = ctx.own_graphs = ctx.weights = ctx.exchange = ctx.saved = None  # free the chunks' graphs
        return (None, None, None, None, None, None, *grads, *grad_send, *grad_send_weights)


UNNAMED = "unnamed"
"""What :func:`_outer_hooks` returns when this torch cannot name the hooks in force."""


def _outer_hooks():
    """The (pack, unpack) saved-tensor hooks in force, None when there are none, or
    :data:`UNNAMED` when this torch cannot name them (a private API, missing before 2.8).
    Unnamed, the chunks record under the hooks directly: still correct, but a checkpoint
    then recomputes its region once per chunk's replay, inside the replay."""
    autograd = torch._C._autograd
    if not getattr(autograd, "_saved_tensors_hooks_is_enabled", lambda: True)():
        return None
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return UNNAMED
    try:
        return top(False)
    except TypeError:  # an older signature
        return UNNAMED


class _Saved:
    __slots__ = ("packed", "value")

    def __init__(self, packed) -> None:
        self.packed, self.value = packed, None


class _ChunkSaved:
    """The tensors one chunk's graph saves, packed by the saved-tensor hooks that enclose the
    pipeline (``outer``; None: no hooks, tensors saved as usual) and unpacked by
    :meth:`unpack`, which the pipeline's backward calls in the outer graph task before it
    replays the chunk: the replay, a backward call of its own (a new graph task), only reads
    them. An activation checkpoint thus recomputes its region once (in the outer task), and
    save_on_cpu offloads the chunks' tensors as it does every other."""

    def __init__(self, outer) -> None:
        self._outer, self._pending = (None if outer is UNNAMED else outer), []
        self.replay_may_recompute = outer is UNNAMED
        """Whether a checkpoint may recompute the forward inside the chunk's replay (its
        dispatch then reuses the chunk's exchange regions and landing flag)."""

    @classmethod
    def around_outer_hooks(cls) -> "_ChunkSaved":
        """Around the saved-tensor hooks in force now (:func:`_outer_hooks`)."""
        return cls(_outer_hooks())

    def recording(self):
        if self._outer is None:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack_saved)

    def _pack(self, t: torch.Tensor) -> _Saved:
        saved = _Saved(self._outer[0](t))
        self._pending.append(saved)
        return saved

    def unpack(self) -> None:
        for saved in self._pending:
            saved.value, saved.packed = self._outer[1](saved.packed), None
        self._pending = []

    def _unpack_saved(self, saved: _Saved) -> torch.Tensor:
        if saved.value is None:  # read before the backward's unpack (graph introspection): ask the hooks
            return self._outer[1](saved.packed)
        return saved.value


def _stand_in(t: torch.Tensor, wants_grad: bool) -> torch.Tensor:
    """A detached leaf standing in for ``t`` in a chunk's graph: the graph ends there and
    the backward collects the leaf's grad."""
    return t.detach().requires_grad_(wants_grad)


def _own_slice(t: torch.Tensor, own: OwnRows, order: str) -> torch.Tensor:
    """The own rows of ``t``, a chunk's rows in send (``"sent"``) or arrival order."""
    start = own.sent_start if order == "sent" else own.arrived_start
    return t[start: start + own.num_rows]


def _rows_of(pending: PendingExchange, plan: ChunkPlan) -> tuple[torch.Tensor, Optional[RowArrival]]:
    """The rows of an exchange for the chunk's experts: at once, with how they land, when
    they land source by source (the experts' first GEMM waits for them tile by tile), else
    after the stream waits for the exchange."""
    if pending.landing is None:
        return pending.wait(), None
    return pending.landing_rows(), RowArrival(pending.landing, plan.local.source_ends_ES)


def _backward_into(graph: tuple, grad: "torch.Tensor | PendingExchange", weights: list[torch.Tensor],
                   weight_grads: DeferredWeightGrads, share_sms: bool, plan: Optional[ChunkPlan] = None) -> None:
    """Backward of one recorded expert graph ``(out, rows, row_weights)`` with ``grad`` (or
    what a pending exchange brings, for ``plan``'s rows), its weight gradients queued in
    ``weight_grads``."""
    inputs = _graph_inputs([graph], weights)
    pending = grad if isinstance(grad, PendingExchange) else None
    arrival = None
    if pending is not None:
        grad, arrival = _rows_of(pending, plan)
    if inputs:
        with defer_weight_grads(weight_grads), _sharing_sms(share_sms), rows_arriving(grad, arrival):
            torch.autograd.backward(graph[0], grad, inputs=inputs)
    if pending is not None:
        pending.wait()  # the deferred dW GEMMs read the gradient rows too


def _backward_together(graphs: list[tuple], grads: list[torch.Tensor], weights: list[torch.Tensor],
                       weight_grads: DeferredWeightGrads, share_sms: bool) -> None:
    """Backward of several recorded expert graphs with their (arrived) gradients in one
    backward call, one graph task; weight gradients queued in ``weight_grads``."""
    inputs = _graph_inputs(graphs, weights)
    if inputs:
        with defer_weight_grads(weight_grads), _sharing_sms(share_sms):
            torch.autograd.backward([g[0] for g in graphs], grads, inputs=inputs)


def _graph_inputs(graphs: list[tuple], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the backward of recorded graphs ``(out, rows, row_weights)`` computes gradients for."""
    return [t for _, rows, row_weights in graphs for t in (rows, row_weights) if t.requires_grad] + [
        w for w in weights if w.requires_grad]


def _sharing_sms(share: bool):
    """GEMMs that overlap NCCL's kernels launch one program per tile, so NCCL finds SMs."""
    return one_program_per_tile() if share else contextlib.nullcontext()


_SEND_ARG = 8
"""Position of the first sent rows among ``_ExpertPipeline.forward``'s arguments."""


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


@torch.compiler.disable  # streams, events and async collectives: eager under torch.compile
def expert_pipeline(expert_fn: ExpertFn, plans: list[ChunkPlan], exchange: Exchange,
                    gate_up: torch.Tensor, down: torch.Tensor, send_rows: list[torch.Tensor],
                    send_weights: list[torch.Tensor], arrived_weights: list[torch.Tensor],
                    dispatched: Optional[list[PendingExchange]] = None) -> list[torch.Tensor]:
    """Dispatch, local experts and combine of every chunk, communication overlapped with
    compute (see the module docstring). Differentiable in ``gate_up``, ``down``, the sent
    rows and the sent top-k weights.

    Args:
        expert_fn: the local experts on one chunk (:data:`ExpertFn`).
        plans: one :class:`ChunkPlan` per chunk.
        exchange: the all-to-alls (:class:`Exchange`); the caller has begun the forward's
            session (``exchange.begin()``) before staging or dispatching anything; the
            backward begins its own.
        gate_up, down: the local expert weights, passed on to ``expert_fn``.
        send_rows: per chunk, [U_c, H] rows grouped by destination rank.
        send_weights: per chunk, the top-k weights of the sent rows ([U_c] or [U_c, K]).
        arrived_weights: per chunk, what the dispatch of ``send_weights`` delivered ([S_c]
            or [S_c, K], already here: they travel with the expert ids, before the rows);
            applied by ``expert_fn``. Their gradients go back to the senders with a
            combine that the backward starts right after the chunk's input gradients, so
            it runs under the weight-gradient GEMMs.
        dispatched: per chunk, the dispatch of ``send_rows`` already started by the
            caller on this ``exchange`` (``exchange.dispatch(send_rows[c], c, "rows")``,
            chunks in order, after ``begin()``), so the rows travel while the caller still
            queues work (the receiver's routing); default: the pipeline starts them. Only
            their number is checked.

    Returns:
        Per chunk, [U_c, H] expert outputs in the chunk's send order.
    """
    if dispatched is not None and len(dispatched) != len(plans):
        raise ValueError(f"expert_pipeline: {len(dispatched)} dispatches for {len(plans)} chunks; "
                         "pass one per chunk or None")
    if any(w.requires_grad for w in arrived_weights):
        raise ValueError("expert_pipeline: arrived_weights are data (their gradient goes back to "
                         "send_weights); pass them detached")
    record = torch.is_grad_enabled() and any(
        t.requires_grad for t in (gate_up, down, *send_rows, *send_weights))
    return list(_ExpertPipeline.apply(expert_fn, plans, exchange, arrived_weights, dispatched, record,
                                      gate_up, down, *send_rows, *send_weights))
