"""The expert-parallel section of the layer as one autograd function: dispatch, the local
experts and combine in the forward; in the backward the same in reverse, with the weight
gradients computed last so that the row gradients travel back under them.

The exchanges are started asynchronously on a communication stream (NCCL's, or the copy
engines' of :mod:`ep_moe.ep.copy_engine`), and the compute stream waits for an exchange only
right before it uses its rows. The backward computes the weight gradients last
(:class:`DeferredWeightGrads`): the input gradients and the top-k weights' gradients travel
back to their senders while the dW GEMMs run::

    comm:     grads in |                  | rows back, top-k weight grads |
    compute:           | dX chain (dA, dH) | dW GEMMs (one program per tile, with NCCL)

NCCL's kernels need SMs, and a persistent GEMM holds every SM until it ends, so with NCCL
the dW GEMMs launch one program per tile
(:func:`~ep_moe.kernels.grouped_gemm.one_program_per_tile`): an NCCL kernel gets an SM
whenever a tile ends. The copy engines need none.

An exchange whose rows land source by source (:class:`ep_moe.ep.copy_engine.CopyEngineGather`,
``PendingExchange.landing``) hands them to the experts before they have landed: the
experts' first GEMM on them (the up projection; in the backward, the down projection's dX)
waits tile by tile for each source (:mod:`ep_moe.kernels.arrival`), and the compute stream
waits for the whole transfer once the expert function is queued. Such an exchange may also
send the forward's output while the experts produce it (``departing``: the down projection
sums the tokens source by source and each source's sums leave at once).

The experts are recorded as a small autograd graph on detached inputs during the forward
and replayed by ``torch.autograd.backward`` in the backward (as a reentrant checkpoint does,
without recomputation): the expert math keeps its own backward (the grouped GEMM's dX and
dW kernels) and only the schedule is written here.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence, Union

import torch

from ep_moe.ep.base import Exchange, PendingExchange, refuse_double_backward
from ep_moe.ep.fp8_wire import pack_fp8_rows, rows_placeholder, unpack_fp8_rows
from ep_moe.kernels.arrival import RowArrival, rows_arriving
from ep_moe.kernels.grouped_gemm import eager_or_graph_break, one_program_per_tile
from ep_moe.kernels.ops import defer_weight_grads
from ep_moe.routing import RoutingMetadata


class DeferredWeightGrads:
    """Weight gradients that the backward of the grouped GEMM (and of
    :func:`~ep_moe.kernels.ops.grouped_gemm_slot_sum`) queued instead of computing, inside
    :func:`~ep_moe.kernels.ops.defer_weight_grads`: the input gradients come first, so that work which needs only
    them (an all-to-all returning them to other ranks) can start while the dW GEMMs run.

    Only GEMMs whose weight is one of ``weights`` (leaf tensors) or a dtype cast of one
    (``.to()``, as autocast does) are deferred; every other GEMM computes its dW at once.
    ``private_leaves``: the weights are leaves only the caller sees (no hooks on them or on
    their grad accumulators, as DDP registers): a dW of the leaf itself is then stored in
    its ``.grad`` when that is empty, without the copy ``AccumulateGrad`` makes of a
    gradient its caller still references."""

    def __init__(self, weights: list[torch.Tensor], private_leaves: bool = False):
        self._weights, self._private = list(weights), private_leaves
        # (leaves, the tensors queued for them, grad_fn, whether grad_fn takes a tuple)
        self._queued: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], Callable, bool]] = []

    def owns(self, leaf: torch.Tensor) -> bool:
        """Whether GEMMs multiplying by ``leaf`` (or a cast of it) are deferred here."""
        return any(leaf is w for w in self._weights)

    def owns_weight(self, weight: torch.Tensor) -> bool:
        """Whether the dW of a GEMM multiplying by ``weight`` (a leaf or a cast of one) is queued here."""
        leaf = _leaf_of(weight)
        return leaf is not None and self.owns(leaf)

    def add(self, weight: Union[torch.Tensor, Sequence[torch.Tensor]], grad_fn: Callable) -> None:
        """Queue ``grad_fn(add_to)``, the gradient of ``weight`` (the tensor the GEMM multiplied
        by: one of the leaves or a cast of one): a new tensor for ``add_to=None``, else added
        to ``add_to`` in place and returned. For a tuple of such tensors (a weight and its
        bias, whose gradients one kernel computes), ``grad_fn`` takes and returns tuples."""
        weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
        leaves = tuple(_leaf_of(w) for w in weights)
        if any(leaf is None or not self.owns(leaf) for leaf in leaves):
            raise ValueError("DeferredWeightGrads.add: a weight is neither one of the queue's leaves nor a "
                             "dtype cast of one")
        # the leaves resolved now, while the graph holds them
        self._queued.append((leaves, weights, grad_fn, not isinstance(weight, torch.Tensor)))

    def __len__(self) -> int:
        return len(self._queued)

    def run(self) -> None:
        """Compute every queued gradient, in order, and send it into its weight's autograd
        graph (accumulated into the leaf's ``.grad``, through the cast if any). GEMMs of the
        same weight tensor (the chunks of a pipeline) sum into one buffer inside the dW
        kernel, which goes into the graph once (for private leaves, into ``.grad``). Each
        entry is dropped once done, so its saved operands are freed before the next dW runs."""
        queued, self._queued = self._queued, []
        queued.reverse()
        # ((leaf, dtype) of each tensor) -> (the leaves, the tensors first queued for them,
        # their gradients so far); saved tensors may come back as new tensors for the same
        # leaf or cast (under saved-tensor hooks). The leaves are in self._weights: their ids
        # stay theirs for the whole run.
        sums: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        while queued:
            leaves, weights, grad_fn, takes_tuple = queued.pop()
            key = tuple((id(leaf), w.dtype) for leaf, w in zip(leaves, weights))
            partial = sums.get(key)
            add_to = None if partial is None else (partial[2] if takes_tuple else partial[2][0])
            grads = grad_fn(add_to)
            sums[key] = (leaves, weights if partial is None else partial[1],
                         tuple(grads) if takes_tuple else (grads,))
            del grad_fn
        for leaves, weights, grads in sums.values():
            for leaf, weight, grad in zip(leaves, weights, grads):
                if weight.grad_fn is None:  # the leaf itself (or a saved alias of it)
                    if self._private and leaf.grad is None:
                        leaf.grad = grad  # what AccumulateGrad would store, uncopied
                    else:
                        torch.autograd.backward(leaf, grad, inputs=[leaf])
                else:
                    torch.autograd.backward(weight, grad, inputs=[leaf])


def _leaf_of(w: torch.Tensor) -> Optional[torch.Tensor]:
    """``w`` itself if it is a leaf (the leaf it stands for if it is a saved leaf that
    saved-tensor hooks gave back as a new tensor), the leaf it was cast from if it is a
    dtype cast of one (``.to()``), else None."""
    node = w.grad_fn
    if node is None:
        if w.requires_grad:  # its gradient edge is the leaf's AccumulateGrad
            return getattr(torch.autograd.graph.get_gradient_edge(w).node, "variable", w)
        return w
    if type(node).__name__.startswith("ToCopyBackward") and len(node.next_functions) == 1:
        return getattr(node.next_functions[0][0], "variable", None)
    return None


def _departing(exchange: Exchange, like: torch.Tensor):
    """``exchange.departing(like)`` where the exchange has one, else nothing."""
    departing = getattr(exchange, "departing", None)
    return contextlib.nullcontext() if departing is None else departing(like)


ExpertFn = Callable[..., torch.Tensor]
"""``expert_fn(rows_SH, weights_S, local, *params) -> out_SH``: the local experts on the
arrived rows and their top-k weights (``[S]`` or ``[S, K]``), routed by ``local`` (rows as
tokens), one output row per arrived row, differentiable. ``params`` (the experts' stacked
tensors: ``gate_up``, ``down``, their biases...) come cast to the rows' dtype. Rows that
travel in e4m3 come as ``quantized_rows=`` (a :class:`~ep_moe.kernels.fp8.QuantizedRows`),
``rows_SH`` then standing for them (:func:`~ep_moe.ep.fp8_wire.rows_placeholder`)."""


class _ExpertPipeline(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_fn: ExpertFn, local: RoutingMetadata, exchange: Exchange, arrived_weights: torch.Tensor,
                dispatched: Optional[PendingExchange], record: bool, fp8_rows: bool, send: torch.Tensor,
                send_weights: torch.Tensor, *params: torch.Tensor):
        if dispatched is None:
            if send.numel() and send.stride(0) == 0:
                raise ValueError("expert pipeline: send_rows is a placeholder (stride 0); pass the dispatch of the "
                                 "rows it stands for as dispatched")
            dispatched = exchange.dispatch(pack_fp8_rows(send) if fp8_rows else send, "rows")
        rows_in = dispatched
        # Detached stand-ins: the graph ends at these leaves, whose grads the backward returns.
        weights = [_stand_in(w, record and w.requires_grad) for w in params]
        # The graph saves its tensors through the enclosing saved-tensor hooks (an activation
        # checkpoint's, save_on_cpu's), if any; the backward unpacks them itself, in the outer
        # graph task, so a checkpoint recomputes the region once, not again in the replayed
        # backward (its own graph task).
        saved = _GraphSaved.around_outer_hooks()
        # Every dtype here is explicit: autocast would change what the exchanges carry.
        with torch.set_grad_enabled(record), saved.recording(), _autocast_off(send):
            compute_weights = [w.to(send.dtype) for w in weights]
            rows, arrival = _rows_of(rows_in, local)
            quantized = {}
            if fp8_rows:  # the GEMM reads the e4m3 rows; a placeholder takes their gradient
                if arrival is not None:
                    raise RuntimeError("expert pipeline: e4m3 rows cannot be read while they land")
                quantized["quantized_rows"] = unpack_fp8_rows(rows, send.shape[1])
                rows = rows_placeholder(rows.shape[0], send.shape[1], send.dtype, rows.device)
            rows_SH = _stand_in(rows, record and send.requires_grad)
            row_weights_S = _stand_in(arrived_weights, record and send_weights.requires_grad)
            with rows_arriving(rows_SH, arrival, must_be_read=True), _departing(exchange, rows_SH):
                out_SH = expert_fn(rows_SH, row_weights_S, local, *compute_weights, **quantized)
        rows_in.wait()  # whatever reads the rows next waits for all of them
        out = exchange.combine(out_SH.detach(), "rows").wait()
        if out.dtype != send.dtype:  # the backward's gradients would arrive in another dtype
            raise RuntimeError(f"expert pipeline: {type(exchange).__name__}.combine returned {out.dtype} rows for "
                               f"{send.dtype} ones; an exchange must keep the rows' dtype")
        ctx.local, ctx.exchange, ctx.weights, ctx.saved = local, exchange, weights, saved
        ctx.graph = (out_SH, rows_SH, row_weights_S)
        return out

    @staticmethod
    def backward(ctx, grad_back):
        refuse_double_backward()
        if ctx.graph is None:
            raise RuntimeError("ep_moe's expert pipeline frees its graph in the backward; a second "
                               "backward through the same MoE forward (retain_graph=True) is not supported")
        exchange, weights, saved = ctx.exchange, ctx.weights, ctx.saved
        # before any exchange starts: a checkpoint recomputes the region here
        saved.unpack()
        # Whether the sent rows and weights need a gradient: the same on every rank (the
        # activations of the same model), so every rank skips the same exchanges.
        need_rows, need_weights = ctx.needs_input_grad[_SEND_ARG:_SEND_ARG + 2]
        grad_in = exchange.dispatch(grad_back.contiguous(), "rows")
        if saved.replay_may_recompute:
            # a recompute inside the replay would dispatch into the landing flag while these
            # rows still land: take them whole first
            grad_in = grad_in.wait()
        weight_grads = DeferredWeightGrads(weights, private_leaves=True)  # the stand-ins
        _backward_into(ctx.graph, grad_in, weights, weight_grads, ctx.local)
        out_SH, rows_SH, row_weights_S = ctx.graph
        rows_back = exchange.combine(_grad_or_zeros(rows_SH), "rows") if need_rows else None
        # back to the senders, under the dW GEMMs
        weights_back = exchange.combine(_grad_or_zeros(row_weights_S), "weights") if need_weights else None
        with _sharing_sms((need_rows or need_weights) and exchange.uses_sms):
            weight_grads.run()
        grads = []
        for w in weights:  # hand the grads over, so autograd can keep them instead of copying
            grads.append(w.grad)
            w.grad = None
        grad_send = None if rows_back is None else rows_back.wait()
        grad_send_weights = None if weights_back is None else weights_back.wait()
        ctx.graph = ctx.weights = ctx.exchange = ctx.saved = None  # free the graph
        return (None,) * _SEND_ARG + (grad_send, grad_send_weights, *grads)


def _autocast_off(like: torch.Tensor):
    """Autocast off on ``like``'s device type (inside, every dtype is the caller's)."""
    return torch.autocast(like.device.type, enabled=False)


UNNAMED = "unnamed"
"""What :func:`_outer_hooks` returns when this torch cannot name the hooks in force."""


def _outer_hooks():
    """The (pack, unpack) saved-tensor hooks in force, None when there are none, or
    :data:`UNNAMED` when this torch cannot name them (a private API, missing before 2.8).
    Unnamed, the graph records under the hooks directly: still correct, but a checkpoint
    then recomputes its region once more, inside the replay."""
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


class _GraphSaved:
    """The tensors the expert graph saves, packed by the saved-tensor hooks that enclose the
    pipeline (``outer``; None: no hooks, tensors saved as usual) and unpacked by
    :meth:`unpack`, which the pipeline's backward calls in the outer graph task before it
    replays the graph: the replay, a backward call of its own (a new graph task), only reads
    them. An activation checkpoint thus recomputes its region once (in the outer task), and
    save_on_cpu offloads the graph's tensors as it does every other."""

    def __init__(self, outer) -> None:
        self._outer, self._pending = (None if outer is UNNAMED else outer), []
        self.replay_may_recompute = outer is UNNAMED
        """Whether a checkpoint may recompute the forward inside the replay (its dispatch
        then reuses the exchange's regions and landing flag)."""

    @classmethod
    def around_outer_hooks(cls) -> "_GraphSaved":
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
    """A detached leaf standing in for ``t`` in the expert graph: the graph ends there and
    the backward collects the leaf's grad."""
    return t.detach().requires_grad_(wants_grad)


def _rows_of(pending: PendingExchange, local: RoutingMetadata) -> tuple[torch.Tensor, Optional[RowArrival]]:
    """The rows of an exchange for the experts: at once, with how they land, when they land
    source by source (the experts' first GEMM waits for them tile by tile), else after the
    stream waits for the exchange."""
    if pending.landing is None:
        return pending.wait(), None
    return pending.landing_rows(), RowArrival(pending.landing, local.source_ends_ES)


def _backward_into(graph: tuple, grad: "torch.Tensor | PendingExchange", weights: list[torch.Tensor],
                   weight_grads: DeferredWeightGrads, local: RoutingMetadata) -> None:
    """Backward of the recorded expert graph ``(out, rows, row_weights)`` with ``grad`` (or
    what a pending exchange brings, for ``local``'s rows), its weight gradients queued in
    ``weight_grads``."""
    inputs = [t for t in graph[1:] if t.requires_grad] + [w for w in weights if w.requires_grad]
    pending = grad if isinstance(grad, PendingExchange) else None
    arrival = None
    if pending is not None:
        grad, arrival = _rows_of(pending, local)
        if arrival is not None and grad.dtype != graph[0].dtype:
            # autograd would cast them (reading the rows before they land) ahead of the GEMM
            raise RuntimeError(f"expert pipeline: output gradients arrive in {grad.dtype} for {graph[0].dtype} "
                               "outputs; they must land in the outputs' dtype")
    if inputs:
        with defer_weight_grads(weight_grads), rows_arriving(grad, arrival):
            torch.autograd.backward(graph[0], grad, inputs=inputs)
    if pending is not None:
        pending.wait()  # the deferred dW GEMMs read the gradient rows too


def _sharing_sms(share: bool):
    """GEMMs that overlap NCCL's kernels launch one program per tile, so NCCL finds SMs."""
    return one_program_per_tile() if share else contextlib.nullcontext()


_SEND_ARG = 7
"""Position of the sent rows among ``_ExpertPipeline.forward``'s arguments (the sent top-k
weights follow, then the experts' tensors)."""


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


@eager_or_graph_break  # streams, events and async collectives: eager under torch.compile
def expert_pipeline(expert_fn: ExpertFn, local: RoutingMetadata, exchange: Exchange, params: Sequence[torch.Tensor],
                    send_rows: torch.Tensor, send_weights: torch.Tensor, arrived_weights: torch.Tensor,
                    dispatched: Optional[PendingExchange] = None, fp8_rows: bool = False) -> torch.Tensor:
    """Dispatch, local experts and combine, the backward's exchanges overlapped with its
    weight-gradient GEMMs (see the module docstring). Differentiable in ``params``, the
    sent rows and the sent top-k weights.

    Args:
        expert_fn: the local experts (:data:`ExpertFn`).
        local: routing of the arrived rows to this rank's experts (rows as tokens).
        exchange: the collectives (:class:`~ep_moe.ep.base.Exchange`).
        params: the local experts' stacked tensors (``gate_up``, ``down``, biases:
            ``GroupedExperts.expert_tensors()``), passed on to ``expert_fn``.
        send_rows: [U, H] rows as the exchange sends them (grouped by destination rank for
            the all-to-all, this rank's tokens for the all-gather), or with ``fp8_rows`` and
            ``dispatched`` a placeholder for them (:func:`~ep_moe.ep.fp8_wire.rows_placeholder`:
            its shape, dtype and gradient only).
        send_weights: the top-k weights of the sent rows ([U] or [U, K]).
        arrived_weights: what the dispatch of ``send_weights`` delivered ([S] or [S, K],
            already here: they travel with the expert ids, before the rows); applied by
            ``expert_fn``. Their gradients go back to the senders with a combine that the
            backward starts right after the input gradients', so it runs under the
            weight-gradient GEMMs.
        dispatched: the dispatch of ``send_rows`` already started by the caller on this
            ``exchange`` (``exchange.dispatch(send_rows, "rows")``), so the rows travel while
            the caller still queues work (the receiver's routing); default: the pipeline
            starts it.
        fp8_rows: the rows travel in e4m3 (:mod:`ep_moe.ep.fp8_wire`; ``dispatched`` then
            carries their :func:`~ep_moe.ep.fp8_wire.pack_fp8_rows` message) and
            ``expert_fn`` gets them as ``quantized_rows``, for its FP8 up projection.

    Returns:
        [U, H] expert outputs in send order (summed over the ranks for the all-gather).
    """
    if arrived_weights.requires_grad:
        raise ValueError("expert_pipeline: arrived_weights are data (their gradient goes back to "
                         "send_weights); pass them detached")
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (*params, send_rows, send_weights))
    return _ExpertPipeline.apply(expert_fn, local, exchange, arrived_weights, dispatched, record, fp8_rows,
                                 send_rows, send_weights, *params)
