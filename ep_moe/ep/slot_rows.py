"""The all-to-all's format for small eager calls: one row per kept slot, weighted and
summed by its sender. Tensor math only; :class:`ep_moe.ep.all_to_all.AllToAllDispatcher`
runs the exchanges.

A small eager call waits on the host, which spends about 10 us per torch op. The
all-to-all's main format sends each token once per destination rank, with its local
expert ids and top-k weights packed beside it, and runs the expert pipeline, whose backward
overlaps the returning gradients with the weight-gradient GEMMs: worth it for large calls,
twice the torch ops of a plain ``torch._grouped_mm`` layer for a few tokens. Where every
rank of the EP group votes for it (:func:`wants_slot_rows`: a call the small-call path of
:mod:`ep_moe.grouped_mm_experts` would take), the call runs this format instead:

1. :func:`sort_slot_rows`: the sender sorts its slots by expert, hence by destination rank
   (dropped slots last), and gathers their rows, before the split sizes are on the host,
   which then cut them to the kept ones;
2. :func:`slot_counts`: the counts all-gather carries, beside the main format's split
   sizes, each rank's vote and its kept slots per expert, so every receiver knows the local
   expert of each arriving row from the counts alone: no expert ids or weights travel;
3. :func:`arrived_expert_order`: the receiver's experts run on the arrived rows in expert
   order (a stable sort by expert; the experts gather and scatter by it), unweighted, one
   output row per arrived row;
4. :func:`combine_slot_rows`: back at the sender, the rows go to their slots and each
   token's K slots are summed times their top-k weights, in fp32 and rounded once (as the
   EP=1 small-call path does).

Both exchanges are differentiable all-to-alls; autograd does the rest, deterministic (every
index op of the backward writes each row once). Shape suffixes follow the legend in
:mod:`ep_moe.routing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ep_moe.grouped_mm_experts import rows_of_slots, small_eager_call
from ep_moe.routing import RouterOutput, RoutingMetadata, combine_slots, sort_slots

VOTE = 2
"""Column of the gathered counts holding each rank's vote (after rows and kept slots)."""
EXPERT_COUNTS = 3
"""First column of the gathered counts holding the kept slots per local expert."""


SLOT_ROWS_MAX_SLOTS = 2048
"""Most routed slots (T*K) a rank votes for the slot rows with. The format sends a token once
per slot, up to K times where the main format sends it once per destination rank: bytes that
grow with the call, where the host ops it saves do not. Measured up to 256 tokens of top-8."""


def wants_slot_rows(x_TH: torch.Tensor, num_slots: int) -> bool:
    """This rank's vote: at most :data:`SLOT_ROWS_MAX_SLOTS` routed slots, and a
    :func:`ep_moe.grouped_mm_experts.small_eager_call`: bf16 on a GPU where
    ``torch._grouped_mm`` runs, no graph capture. Under ``torch.compile`` the all-to-all's
    steps run eagerly (graph breaks), so compiled calls vote too. The receivers' experts
    choose their own path (:func:`ep_moe.grouped_mm_experts.use_grouped_mm`) for the rows
    they get."""
    return num_slots <= SLOT_ROWS_MAX_SLOTS and small_eager_call(x_TH, num_slots, torch.is_grad_enabled())


@dataclass(frozen=True)
class SlotRows:
    """A sender's slots in expert order (:func:`sort_slot_rows`), the kept first."""

    meta: RoutingMetadata
    """:func:`ep_moe.routing.sort_slots`' metadata, uncut (every slot a row, the dropped last)."""
    rows_NH: torch.Tensor
    """The row of each of meta's slots, in its order (differentiable)."""
    weights_TK: torch.Tensor
    """The router's top-k weights (differentiable), applied by :func:`combine_slot_rows`."""


def sort_slot_rows(x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                   num_experts: int) -> SlotRows:
    """Step 1: the slots sorted by expert (stable; dropped slots last) and their rows, with
    no host sync. Dropless, the router's counts are the rows per expert."""
    meta = sort_slots(router.topk_ids_TK, num_experts, keep_TK,
                      counts_E=router.counts_E if keep_TK is None else None, inverse=False)
    return SlotRows(meta, rows_of_slots(x_TH, meta.top_k, meta.slot_index_R, meta.token_index_R),
                    router.topk_weights_TK)


def slot_counts(counts_P2: torch.Tensor, slots: Optional[SlotRows], num_local: int) -> torch.Tensor:
    """Step 2: the counts a rank gathers, int64 [P, 3 + e]: per destination rank p, the main
    format's rows and kept slots (``counts_P2``, :func:`ep_moe.routing.rank_counts`), this
    rank's vote (1 when ``slots`` is given) and its kept slots for each of p's ``num_local``
    experts (zeros without a vote: unread then)."""
    ep_size = counts_P2.shape[0]
    if slots is None:
        return torch.cat([counts_P2, counts_P2.new_zeros(ep_size, 1 + num_local)], dim=1)
    return torch.cat([counts_P2, counts_P2.new_ones(ep_size, 1), slots.meta.counts_E.view(ep_size, num_local)],
                     dim=1)


def arrived_expert_order(counts_Pe: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: (rows per local expert [e], the arrived rows' order by expert [S]) from the
    kept slots each source sent to each local expert (``counts_Pe``: rows arrive grouped by
    source, each source's sorted by expert); ``num_rows``: S, their sum, known on the host."""
    num_sources, num_local = counts_Pe.shape
    expert_S = torch.repeat_interleave(torch.arange(num_local, device=counts_Pe.device).repeat(num_sources),
                                       counts_Pe.reshape(-1), output_size=num_rows)
    return counts_Pe.sum(0), torch.argsort(expert_S, stable=True)


def combine_slot_rows(rows_back: torch.Tensor, meta: RoutingMetadata, weights_TK: torch.Tensor) -> torch.Tensor:
    """Step 4: the experts' rows for the kept slots (in meta's order, cut to them) placed at
    their slots (dropped slots zero) and each token's K slots summed times their top-k
    weights: [T, H]."""
    num_slots = meta.num_slots
    new = rows_back.new_empty if meta.dropless else rows_back.new_zeros
    y_NH = new((num_slots, rows_back.shape[1])).index_copy_(0, meta.slot_index_R, rows_back)
    return combine_slots(y_NH, meta.top_k, weights_TK.reshape(-1))
