"""``dispatch="all_gather"``: EP without a host sync (:class:`AllGatherDispatcher`).

Every rank of the EP group receives every token of the group (``all_gather_into_tensor``),
routes the slots that chose its own experts through the grouped GEMMs, sums each token's
local slots, and the partial outputs travel back summed (``reduce_scatter_tensor``). The
backward mirrors it: all-gather of the output gradient, reduce-scatter of the gathered
inputs' gradients. The layer runs these collectives through the expert pipeline
(:mod:`ep_moe.ep.pipeline`, with :class:`GatherExchange`, or on the copy engines with
:class:`ep_moe.ep.copy_engine.CopyEngineGather`).

Why: the all-to-all dispatch (:mod:`ep_moe.ep.all_to_all`) needs every rank's split sizes on
the host, one sync per layer call, which drains the GPU's queue before the host can issue
the rest of the layer; on small experts (qwen3-sized) the host then sets the pace
(``benchmarks/PERFORMANCE_LOG.md``). Here every size is known on the host
from T alone: nothing waits for the device, so the host runs ahead as it does at EP=1.
The price is bandwidth: a rank receives all ``(P-1)*T`` foreign tokens, where the
all-to-all sends only those that picked one of its experts (for mixtral's 8 experts,
top-2, about 0.79 of them at EP=2 and 0.46 at EP=4; for 128 experts, top-8, nearly all).

Sizes. The routed rows of a rank vary with the routing; on the host the layer only knows
a bound: at most ``P*T*min(K, E/P)`` slots can choose this rank's experts (every token of
the group), or ``MoEConfig.all_gather_row_bound * T * K`` when set. The buffers are sized
by that bound and the grouped GEMMs' tile loops by the counts on the device
(``grouped_gemm(bounded_rows=True)``: the rows past the count are neither computed nor
given gradients); rows past a set bound are dropped, the last experts' last slots first,
and counted.

Every rank must pass the same number of tokens (a fixed micro-batch): checked on every
call by :class:`TokenCountCheck`, with a host sync only for a count the group has not
agreed on yet.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ep_moe.distributed import all_gather_single, reduce_scatter_single
from ep_moe.ep.base import Dispatcher, Exchange, PendingExchange
from ep_moe.ep.fp8_wire import pack_fp8_rows
from ep_moe.ep.pipeline import expert_pipeline
from ep_moe.kernels.grouped_gemm import eager_or_graph_break
from ep_moe.routing import RouterOutput, RoutingMetadata, count_sorted, sort_slots

if TYPE_CHECKING:
    from ep_moe.experts import GroupedExperts


class GatherExchange:
    """The all-gather dispatch's collectives as an :class:`ep_moe.ep.base.Exchange`, so the
    expert pipeline schedules them as it does the all-to-alls (the backward's input
    gradients travel back under the dW GEMMs): ``dispatch`` all-gathers rows (every
    rank's ``[T, ...]`` into ``[P*T, ...]``, rank-major), ``combine`` reduce-scatters them
    (this rank's ``[T, ...]`` share of the group's sum). Both start asynchronously (NCCL:
    on its stream; the current stream waits in ``PendingExchange.wait``)."""

    uses_sms = True
    """NCCL's collectives run as kernels: GEMMs that overlap them leave them SMs."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group, self.size = group, dist.get_world_size(group)

    def dispatch(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """Start the all-gather of ``x`` [T, ...] (the same T on every rank)."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        # detached: not differentiable here (the pipeline wires the gradients), and gloo's
        # work would otherwise modify views of an autograd input in place
        return PendingExchange(out, all_gather_single(out, x.detach().contiguous(), group=self.group, async_op=True))

    def combine(self, x: torch.Tensor, kind: str) -> PendingExchange:
        """Start the reduce-scatter of ``x`` [P*T, ...]."""
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        return PendingExchange(out, reduce_scatter_single(out, x.detach().contiguous(), group=self.group,
                                                           async_op=True))


class TokenCountCheck:
    """That every rank of the EP group passes the same number of tokens, checked on every
    call, with a host sync only the first time the group meets a count.

    :meth:`start` all-gathers the counts (call it before the router: the collective runs
    under it); :meth:`finish` checks them before any collective sized by the count. A rank
    reads them on the host (a sync) when its count is one the group has not agreed on yet
    (the first call, the first short last batch) and raises a clear ``ValueError`` if they
    differ. For a count agreed on before, the counts are compared on the device, which CUDA
    graphs can capture: on CUDA a device-side assert stops the rank (a peer whose count is
    new raises the error; where every rank's count is an old one, all stop at the assert),
    on the CPU it raises the same error. No rank goes on to a collective its peers do not
    join."""

    def __init__(self) -> None:
        self.agreed: set[int] = set()  # counts every rank of the group has passed at once
        self._in_flight: Optional[tuple[int, torch.Tensor, PendingExchange]] = None

    @eager_or_graph_break  # an async collective: eager under torch.compile
    def start(self, num_tokens: int, group: ProcessGroup, device: torch.device) -> None:
        """Start the all-gather of this rank's ``num_tokens`` over ``group`` (collective)."""
        mine = torch.full((1,), num_tokens, dtype=torch.int64, device=device)
        every = mine.new_empty(dist.get_world_size(group))
        work = all_gather_single(every, mine, group=group, async_op=True)
        self._in_flight = (num_tokens, mine, PendingExchange(every, work))  # mine: held until the wait

    def finish(self) -> None:
        """Wait for the counts :meth:`start` gathered and check them (see the class)."""
        if self._in_flight is None:
            raise RuntimeError("TokenCountCheck.finish() without start()")
        num_tokens, _, pending = self._in_flight
        self._in_flight = None
        every = pending.wait()
        if num_tokens in self.agreed and every.is_cuda:
            torch._assert_async(every.eq(num_tokens).all(), _unequal_tokens_message("a peer's differs"))
            return
        counts = every.tolist()
        if len(set(counts)) != 1:
            raise ValueError(_unequal_tokens_message(counts))
        self.agreed.add(num_tokens)


def _unequal_tokens_message(counts) -> str:
    return (f"MoEConfig.dispatch='all_gather' needs the same number of tokens on every rank of the EP group, "
            f"got {counts}; pad the batches to one size or use dispatch='all_to_all'")


def row_bound(bound: Optional[float], num_tokens: int, top_k: int, ep_size: int, num_local: int) -> int:
    """Routed rows a rank computes at most: ``P*T*min(K, e)`` (every slot that can choose
    its e experts), or ``ceil(bound * T * K)`` rows when ``bound`` is set, if fewer."""
    worst = ep_size * num_tokens * min(top_k, num_local)
    return worst if bound is None else min(worst, math.ceil(bound * num_tokens * top_k))


def gathered_routing(ids_GK: torch.Tensor, first_expert: int, num_local: int, max_rows: int,
                     num_sources: int = 1, first_source: int = 0,
                     source_ends: bool = True) -> tuple[RoutingMetadata, torch.Tensor]:
    """Route the gathered tokens' slots (``ids_GK`` [P*T, K] global expert ids, -1 for a
    slot the capacity dropped) to experts ``first_expert ..`` + ``num_local`` in
    ``max_rows`` rows, without a host sync. Returns the routing (counts per local expert
    with the rows past the bound left out; each row's slot and token, rows past the count
    reading token 0; each slot's row, -1 for another rank's expert or a dropped slot) and
    the number of slots dropped past the bound (0-dim int64).

    The gathered tokens come from ``num_sources`` ranks, T each, rank-major. Each expert's
    rows are sorted by source in landing order, ``first_source`` (this rank) first, then the
    next ranks, wrapping around, and ``source_ends_ES`` of the routing counts, per expert,
    its rows from the first w+1 sources in that order (what a GEMM reading the rows while
    they land needs: :mod:`ep_moe.kernels.arrival`); None without ``source_ends``."""
    num_tokens, top_k = ids_GK.shape
    offset_GK = ids_GK - first_expert  # a dropped slot (-1) is below 0 too
    local_GK = offset_GK.clamp(0, num_local - 1)
    mine_GK = local_GK == offset_GK
    slots_per_source = num_tokens // num_sources * top_k
    meta = sort_slots(local_GK, num_local, mine_GK, first_slot=first_source * slots_per_source)
    ends = torch.cumsum(meta.counts_E, 0)
    kept_ends = ends.clamp(max=max_rows)
    kept_counts = kept_ends - (ends - meta.counts_E).clamp(max=max_rows)
    token_index = meta.token_index_R[:max_rows]
    counted = torch.arange(token_index.shape[0], device=ids_GK.device) < kept_ends[-1]
    # rows of each (expert, source in landing order) pair; the bound drops each expert's last rows.
    # The sorted slots are in pair order already (by expert, then rotated slot: landing order),
    # the other ranks' slots last.
    source_ends_ES = None
    if source_ends:
        order_N = meta.slot_index_R
        landing_N = (order_N // slots_per_source - first_source) % num_sources
        pair_N = torch.where(mine_GK.flatten()[order_N], local_GK.flatten()[order_N] * num_sources + landing_N,
                             num_local * num_sources)
        per_pair = count_sorted(pair_N, num_local * num_sources).view(num_local, num_sources)
        source_ends_ES = torch.minimum(per_pair.cumsum(1), kept_counts[:, None]).to(torch.int32)
    slots = RoutingMetadata(
        counts_E=kept_counts,
        slot_index_R=meta.slot_index_R[:max_rows],
        token_index_R=token_index * counted,
        row_of_slot_N=(meta.row_of_slot_N if max_rows >= num_tokens * top_k  # no row past the bound
                       else meta.row_of_slot_N.masked_fill(meta.row_of_slot_N >= max_rows, -1)),
        num_tokens=num_tokens, top_k=top_k, source_ends_ES=source_ends_ES)
    return slots, ends[-1] - kept_ends[-1]


@dataclass
class GatheredTokens:
    """What :meth:`AllGatherDispatcher.dispatch` hands its later steps."""

    backend: str
    x_TH: torch.Tensor
    weights_TK: torch.Tensor
    exchange: Exchange
    rows_in: PendingExchange
    local: RoutingMetadata
    """The gathered slots routed to this rank's experts, in a bound of rows."""
    arrived_weights: torch.Tensor
    num_dropped: torch.Tensor
    """Slots past the row bound (0-dim int64)."""


class AllGatherDispatcher(Dispatcher):
    """``dispatch="all_gather"`` on NCCL: every rank receives every token of the group, runs
    the slots that chose its experts, and the partial sums are reduce-scattered back; no
    host sync (module docstring). Every rank must pass the same number of tokens."""

    COUNTS_BY_SOURCE = False
    """Whether the routing counts each expert's rows per source rank (``source_ends_ES``):
    GEMMs that read rows while they land, or send sums source by source, need them (the copy
    engines'); NCCL's all-gather hands every row over at once."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.token_count_check = TokenCountCheck()

    def start(self, num_tokens: int, device: torch.device) -> None:
        """The token counts travel while the router runs (:class:`TokenCountCheck`)."""
        self.token_count_check.start(num_tokens, self.group, device)

    def exchange(self, x_TH: torch.Tensor, backend: str) -> Exchange:
        """The collectives of one call: NCCL's all-gather and reduce-scatter."""
        return GatherExchange(self.group)

    @eager_or_graph_break  # async collectives, a host read for a new count: eager under torch.compile
    def dispatch(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                 backend: str) -> GatheredTokens:
        """The token count checked; every rank's expert ids and top-k weights gathered, then
        its tokens, which travel while the gathered slots are routed to this rank's experts."""
        cfg = self.config
        num_tokens, top_k = router.topk_ids_TK.shape
        self.token_count_check.finish()  # before any collective sized by the count
        ids_TK = router.topk_ids_TK.to(torch.int32)
        if keep_TK is not None:
            ids_TK = ids_TK.masked_fill(~keep_TK, -1)
        exchange = self.exchange(x_TH, backend)
        # the expert ids (as bits) and the top-k weights in one message (their gradients go
        # back through the pipeline), then the tokens
        weights_TK = router.topk_weights_TK
        packed = exchange.dispatch(torch.cat([ids_TK.view(torch.float32), weights_TK.detach().float()], 1), "ids")
        rows_in = exchange.dispatch(pack_fp8_rows(x_TH) if self.fp8_rows else x_TH, "rows")
        packed_GK = packed.wait()
        max_rows = row_bound(cfg.all_gather_row_bound, num_tokens, top_k, self.size, self.num_local)
        local, num_dropped = gathered_routing(packed_GK[:, :top_k].contiguous().view(torch.int32),
                                              self.rank * self.num_local, self.num_local, max_rows,
                                              num_sources=self.size, first_source=self.rank,
                                              source_ends=self.COUNTS_BY_SOURCE)
        return GatheredTokens(backend, x_TH, weights_TK, exchange, rows_in, local,
                              packed_GK[:, top_k:].to(weights_TK.dtype), num_dropped)

    @eager_or_graph_break
    def experts(self, routed: GatheredTokens, experts: "GroupedExperts") -> torch.Tensor:
        """The experts on the gathered slots (GEMM2 sums each token's local slots) and the
        partial sums reduce-scattered back, through the expert pipeline: [T, H]."""
        # configs for the rows a rank computes on average (what tuning targets), not the bound;
        # looked up only if the kernels run (a small eager call runs torch._grouped_mm instead)
        configs = functools.partial(experts.kernel_configs, routed.backend, routed.weights_TK.numel(), routed.x_TH)
        expert_fn = functools.partial(experts.on_routed_rows, backend=routed.backend, configs=configs,
                                      bounded_rows=True)
        return expert_pipeline(expert_fn, routed.local, routed.exchange, experts.expert_tensors(), routed.x_TH,
                               routed.weights_TK, routed.arrived_weights, routed.rows_in, fp8_rows=self.fp8_rows)

    def combine(self, routed: GatheredTokens, out: torch.Tensor) -> torch.Tensor:
        """Already one summed row per token: ``out`` itself."""
        return out

    def num_dropped(self, routed: GatheredTokens) -> torch.Tensor:
        """Slots of this rank's experts past the row bound."""
        return routed.num_dropped
