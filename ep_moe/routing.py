"""Router math and routing metadata: tensor math only, no communication.

Legend of the shape suffixes used here and in ``dispatch.py`` / ``layer.py``::

    T tokens on this rank, H hidden, I expert intermediate, F gate_up outputs (2I for
    SwiGLU, else I), E experts (global), e = E / ep_size local experts, K top-k,
    N = T*K routed slots (slot n = t*K + k), R rows routed by this rank (N, or fewer
    when a capacity drops slots), P ranks of the EP group, U rows this rank sends at
    EP>1 (one per token and destination rank), S rows this rank received from all ranks

The router (:func:`route`) turns tokens into top-k expert ids and weights plus the two
auxiliary losses. :func:`build_routing_metadata` turns the ids into what the grouped
GEMM needs: per-expert counts, and for every routed row (sorted by expert, stable, so ties
keep token order) its slot and its token. What a rank sends at EP>1 is ordered per (token,
destination rank) instead (:class:`RankRouting`, :func:`build_rank_routing`). Everything stays on
the device; the only host sync is the kept-row count when a capacity drops slots.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

ScoreFunc = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]


@dataclass(frozen=True)
class RouterOutput:
    """What the router decided for the T tokens of this rank."""

    topk_ids_TK: torch.Tensor
    """Global expert id of each slot (int64), highest score first."""
    topk_weights_TK: torch.Tensor
    """Combine weight of each slot, router dtype, differentiable (renormalised if asked)."""
    topk_scores_TK: torch.Tensor
    """Raw router score of each chosen expert (softmax prob or sigmoid), detached; ranks
    slots for the ``"probs"`` drop policy."""
    counts_E: torch.Tensor
    """Slots the router assigned to each expert (int64, before any capacity drop)."""
    aux_loss: torch.Tensor
    """Load-balancing loss times its coefficient (0-dim, router dtype)."""
    z_loss: torch.Tensor
    """Router z-loss times its coefficient (0-dim, router dtype)."""


@dataclass(frozen=True)
class RoutingMetadata:
    """Layout of the routed rows: R rows sorted by global expert (stable in slot order).

    Rows of expert ``e`` are ``counts_E[e]`` consecutive rows; since experts are laid out
    rank-major (rank p owns experts ``p*e .. p*e + e - 1``), rows are also grouped by the
    rank that owns their expert.
    """

    counts_E: torch.Tensor
    """Routed (kept) rows per expert, int64; sums to R, or to fewer under a row bound
    (:func:`ep_moe.ep.all_gather.gathered_routing`: R is then the bound)."""
    slot_index_R: torch.Tensor
    """Slot ``t*K + k`` of each routed row (int64): the scatter index back to slot order."""
    token_index_R: torch.Tensor
    """Token of each routed row (int64, ``slot_index_R // K``): the gather index."""
    row_of_slot_N: Optional[torch.Tensor]
    """Routed row of each slot (int64, -1 for a dropped slot): the inverse of
    ``slot_index_R``, which :func:`ep_moe.kernels.permute.sum_slot_rows` sums by; None when
    not asked for (:func:`sort_slots`' ``inverse``)."""
    num_tokens: int
    """T."""
    top_k: int
    """K."""
    source_ends_ES: Optional[torch.Tensor] = None
    """The copy-engine all-gather only (:func:`ep_moe.ep.all_gather.gathered_routing`): [e, P] int32
    (local experts), each expert's rows from the first w+1 source ranks in landing order."""

    @property
    def num_slots(self) -> int:
        """N = T*K."""
        return self.num_tokens * self.top_k

    @property
    def dropless(self) -> bool:
        """True when every slot is routed (R == N); slot_index_R is then a permutation."""
        return self.slot_index_R.shape[0] == self.num_slots

    def first_rows(self, num_rows: int) -> "RoutingMetadata":
        """The first ``num_rows`` routed rows (the kept ones of :func:`sort_slots`)."""
        return dataclasses.replace(self, slot_index_R=self.slot_index_R[:num_rows],
                                   token_index_R=self.token_index_R[:num_rows])


def count_ids(ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """How often each id in ``[0, num_bins)`` occurs (int64). Unlike ``torch.bincount``,
    which reads the largest id back to the host on CUDA, this never syncs."""
    counts = torch.zeros(num_bins, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int64))


def count_sorted(sorted_ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """How often each id in ``[0, num_bins)`` occurs in ``sorted_ids`` (ascending), int64;
    larger ids (a sentinel for slots left out) are not counted. Binary searches for the bin
    edges, no atomics: :func:`count_ids` serializes on a bin that most ids share (the
    all-gather dispatch's sentinel takes (P-1)/P of the gathered slots), this does not."""
    edges = torch.arange(num_bins + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.diff(torch.searchsorted(sorted_ids, edges))


def route(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    *,
    top_k: int,
    score_func: ScoreFunc = "softmax",
    norm_topk_prob: bool = True,
    aux_loss_coef: float = 0.0,
    z_loss_coef: float = 0.0,
    expert_bias_E: Optional[torch.Tensor] = None,
    router_dtype: torch.dtype = torch.float32,
) -> RouterOutput:
    """Score tokens, pick top-k experts, and compute the auxiliary losses.

    ``logits_TE = x_TH @ weight_EH^T`` in ``router_dtype``; scores are ``softmax`` or
    ``sigmoid`` of the logits. ``expert_bias_E`` (aux-loss-free balancing, DeepSeek-V3) is
    added to the scores for the top-k *selection only*; the combine weights are the
    unbiased scores of the chosen experts, divided by their sum when ``norm_topk_prob``.

    Losses, over the T tokens of this rank (0 when T is 0 or the coefficient is 0):

    - aux (Switch/GShard): ``coef * E * sum_e f_e * P_e`` with ``f_e = counts_E[e] / (T*K)``
      the fraction of slots routed to e and ``P_e`` the mean over tokens of the token's
      probability of e (softmax scores; sigmoid scores divided by their per-token sum).
      It equals ``coef`` under perfectly uniform routing.
    - z (ST-MoE): ``coef * mean_t logsumexp(logits_t)^2``.
    """
    _check_route_args(x_TH, weight_EH, top_k, expert_bias_E, router_dtype)
    num_tokens, num_experts = x_TH.shape[0], weight_EH.shape[0]
    logits_TE = _router_logits(x_TH, weight_EH, router_dtype)
    if score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    elif score_func == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
    else:
        raise ValueError(f"score_func={score_func!r}: use 'softmax' or 'sigmoid'")

    # Renormalised softmax scores of the chosen experts are the softmax of their logits: that
    # K-wide softmax's backward is a kernel and a scatter, where a division by the scores' sum
    # and the top-k's scatter take eight kernels.
    softmax_of_chosen = score_func == "softmax" and norm_topk_prob
    if expert_bias_E is None and not softmax_of_chosen:  # the top-k values are the weights: no gather
        topk_weights_TK, topk_ids_TK = torch.topk(scores_TE, top_k, dim=-1)
        topk_scores_TK = topk_weights_TK.detach()
    else:
        select_TE = scores_TE.detach()
        if expert_bias_E is not None:
            select_TE = select_TE + expert_bias_E.to(router_dtype)
        topk_scores_TK, topk_ids_TK = torch.topk(select_TE, top_k, dim=-1)
        if expert_bias_E is not None:  # chosen with the bias, weighted by the scores alone
            topk_scores_TK = scores_TE.detach().gather(1, topk_ids_TK)
        topk_weights_TK = (torch.softmax(logits_TE.gather(1, topk_ids_TK), dim=-1) if softmax_of_chosen
                           else scores_TE.gather(1, topk_ids_TK))
    if norm_topk_prob and not softmax_of_chosen:  # sigmoid scores can all underflow to 0
        topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    counts_E = count_ids(topk_ids_TK.flatten(), num_experts)

    aux_loss = z_loss = logits_TE.new_zeros(())
    if num_tokens > 0 and aux_loss_coef > 0:
        probs_TE = scores_TE if score_func == "softmax" else scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
        fraction_E = counts_E.to(router_dtype) / (num_tokens * top_k)
        aux_loss = aux_loss_coef * num_experts * (fraction_E * probs_TE.mean(dim=0)).sum()
    if num_tokens > 0 and z_loss_coef > 0:
        z_loss = z_loss_coef * torch.logsumexp(logits_TE, dim=-1).square().mean()
    return RouterOutput(
        topk_ids_TK=topk_ids_TK, topk_weights_TK=topk_weights_TK, topk_scores_TK=topk_scores_TK,
        counts_E=counts_E, aux_loss=aux_loss, z_loss=z_loss,
    )


def _router_logits(x_TH: torch.Tensor, weight_EH: torch.Tensor, router_dtype: torch.dtype) -> torch.Tensor:
    """``x_TH @ weight_EH^T`` in ``router_dtype``, autocast or not (entering an autocast
    context costs host time on every call: only done when autocast is on)."""
    if not torch.is_autocast_enabled(x_TH.device.type):
        return F.linear(x_TH.to(router_dtype), weight_EH.to(router_dtype))
    with torch.autocast(x_TH.device.type, enabled=False):  # the router stays in router_dtype
        return F.linear(x_TH.to(router_dtype), weight_EH.to(router_dtype))


def _check_route_args(x_TH: torch.Tensor, weight_EH: torch.Tensor, top_k: int,
                      expert_bias_E: Optional[torch.Tensor], router_dtype: torch.dtype) -> None:
    """:func:`route`'s arguments, shapes and kinds only (no value read, no host sync)."""
    if x_TH.dim() != 2 or weight_EH.dim() != 2 or x_TH.shape[1] != weight_EH.shape[1]:
        raise ValueError(f"route: x_TH {tuple(x_TH.shape)} and weight_EH {tuple(weight_EH.shape)} must be [T, H] "
                         "and [E, H] with the same H; pass the tokens flattened to [T, H] and the router weight "
                         "as [num_experts, H]")
    num_experts = weight_EH.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k={top_k} must be in [1, {num_experts}] (weight_EH has {num_experts} "
                         "experts); lower top_k or add experts")
    if not router_dtype.is_floating_point:
        raise ValueError(f"route: router_dtype={router_dtype} must be a float dtype, normally torch.float32")
    if expert_bias_E is not None and tuple(expert_bias_E.shape) != (num_experts,):
        raise ValueError(f"route: expert_bias_E has shape {tuple(expert_bias_E.shape)}; pass one bias per "
                         f"expert, shape ({num_experts},)")


def check_routing(router: "RouterOutput", keep_TK: Optional[torch.Tensor], num_tokens: int, top_k: int,
                  num_experts: int, source: str = "route_fn") -> None:
    """Raise naming ``source`` (a routing computed outside the layer) and the fix where its
    output does not have the layout the dispatchers take: ids [T, K] of an integer dtype,
    weights [T, K], counts [E], the keep mask None or bool [T, K]. Shapes and dtypes only (no
    value read, no host sync); the ids' range is :func:`mask_out_of_range`'s."""
    if not isinstance(router, RouterOutput):
        raise TypeError(f"{source} returned a {type(router).__name__} where a RouterOutput belongs; return "
                        "(ep_moe.routing.RouterOutput(...), keep_TK or None)")
    slots = (num_tokens, top_k)
    ids, weights, counts = router.topk_ids_TK, router.topk_weights_TK, router.counts_E
    if tuple(ids.shape) != slots:
        raise ValueError(f"{source} returned topk_ids_TK of shape {tuple(ids.shape)}; return [T, top_k] = {slots} "
                         "global expert ids")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{source} returned topk_ids_TK of dtype {ids.dtype}; return integer expert ids (torch.int64)")
    if tuple(weights.shape) != slots:
        raise ValueError(f"{source} returned topk_weights_TK of shape {tuple(weights.shape)}; return one weight per "
                         f"slot, {slots}")
    if tuple(counts.shape) != (num_experts,):
        raise ValueError(f"{source} returned counts_E of shape {tuple(counts.shape)}; return the slots per expert, "
                         f"({num_experts},)")
    if keep_TK is not None and (tuple(keep_TK.shape) != slots or keep_TK.dtype != torch.bool):
        raise ValueError(f"{source} returned a keep mask of shape {tuple(keep_TK.shape)} {keep_TK.dtype}; return "
                         f"None or a {slots} bool mask")


def mask_out_of_range(router: "RouterOutput", keep_TK: Optional[torch.Tensor], num_experts: int
                      ) -> tuple["RouterOutput", Optional[torch.Tensor], torch.Tensor]:
    """A routing whose expert ids may fall outside ``[0, num_experts)`` (computed outside the
    layer) made safe to dispatch, on the device (no host sync): each such slot contributes
    nothing and touches no other token. Its id is clamped into range and the slot is left
    out: dropped by the keep mask where there is one, else given weight 0 (its row is still
    computed, by the clamped expert, and multiplied by 0). The counts are those of the
    clamped ids (what the dispatch's rows per expert must be, whatever the source counted).

    Returns the routing to dispatch, its keep mask, and ``bad_TK`` (bool [T, K], the slots out
    of range; :func:`out_of_range_message` names them)."""
    ids_TK = router.topk_ids_TK
    bad_TK = (ids_TK < 0) | (ids_TK >= num_experts)
    ids_TK = ids_TK.clamp(0, num_experts - 1)
    if keep_TK is not None:
        return dataclasses.replace(router, topk_ids_TK=ids_TK), keep_TK & ~bad_TK, bad_TK
    weights_TK = router.topk_weights_TK.masked_fill(bad_TK, 0)
    return (dataclasses.replace(router, topk_ids_TK=ids_TK, topk_weights_TK=weights_TK,
                                counts_E=count_ids(ids_TK.flatten(), num_experts)), None, bad_TK)


def out_of_range_message(source: str, num_bad: int, num_slots: int, num_experts: int, example: Optional[int],
                         where: str = "") -> str:
    """The error of ``num_bad`` of ``num_slots`` expert ids outside ``[0, num_experts)``
    (``example``: one of them, when this rank has one; ``where``: over which ranks)."""
    shown = "" if example is None else f" (e.g. {example})"
    return (f"{source} returned {num_bad} of {num_slots} expert ids outside [0, {num_experts}){shown}{where} "
            f"(EP_MOE_DEBUG is set); return global expert ids in [0, {num_experts}): leave a slot out with the "
            "keep mask (False) or a weight of 0, not with an id out of range")


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """Slots each expert keeps: ``ceil(capacity_factor * T * K / E)``."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_keep_mask(
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    *,
    num_experts: int,
    capacity: int,
    drop_policy: DropPolicy = "probs",
) -> torch.Tensor:
    """Which slots an expert with room for ``capacity`` slots keeps ([T, K] bool).

    Each expert ranks the slots routed to it and keeps the first ``capacity``:
    ``"probs"`` ranks by router score, highest first (ties: earlier slot first);
    ``"position"`` ranks by slot order ``t*K + k``, i.e. earlier tokens first.
    """
    ids_N = topk_ids_TK.flatten()
    if drop_policy == "probs":
        by_score_N = torch.argsort(-topk_scores_TK.flatten(), stable=True)
        order_N = by_score_N[torch.argsort(ids_N[by_score_N], stable=True)]
    elif drop_policy == "position":
        order_N = torch.argsort(ids_N, stable=True)
    else:
        raise ValueError(f"drop_policy={drop_policy!r}: use 'probs' or 'position'")
    sorted_ids_N = ids_N[order_N]
    counts_E = count_sorted(sorted_ids_N, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert_N = torch.arange(ids_N.numel(), device=ids_N.device) - starts_E[sorted_ids_N]
    keep_N = torch.empty_like(ids_N, dtype=torch.bool)
    keep_N[order_N] = rank_in_expert_N < capacity
    return keep_N.view_as(topk_ids_TK)


def build_routing_metadata(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    keep_TK: Optional[torch.Tensor] = None,
    num_kept: Optional[int] = None,
    *,
    counts_E: Optional[torch.Tensor] = None,
    inverse: bool = True,
) -> RoutingMetadata:
    """Sort the (token, slot) pairs by expert: counts, slot and token index of each row.

    Dropped slots (``keep_TK`` False) get the sentinel expert ``E``, sort last, and are
    cut off; how many rows remain is ``num_kept`` when the caller knows it, else read
    back from the device (a host sync, so only when slots are dropped). ``counts_E`` and
    ``inverse``: as for :func:`sort_slots`.
    """
    meta = sort_slots(topk_ids_TK, num_experts, keep_TK, counts_E=counts_E, inverse=inverse)
    if keep_TK is None:
        return meta
    return meta.first_rows(int(meta.counts_E.sum()) if num_kept is None else num_kept)  # sync unless given


def sort_slots(topk_ids_TK: torch.Tensor, num_experts: int, keep_TK: Optional[torch.Tensor] = None,
               first_slot: int = 0, *, counts_E: Optional[torch.Tensor] = None,
               inverse: bool = True) -> RoutingMetadata:
    """:func:`build_routing_metadata` before the cut, with no host sync: all N slots are
    rows, the dropped ones last (their ``row_of_slot_N`` is already -1). Only the first
    ``counts_E.sum()`` rows are routed: cut with :meth:`RoutingMetadata.first_rows` once
    that count is on the host (until then, the metadata is only good for gathers).
    ``first_slot``: each expert's rows in slot order from that slot on, wrapping around
    (the all-gather dispatch puts the rank's own tokens first). ``counts_E``: the slots per
    expert, already counted (:attr:`RouterOutput.counts_E`; only without ``keep_TK``),
    taken instead of counting them again. ``inverse=False``: no ``row_of_slot_N`` (None),
    for callers that never sum by it (two kernels fewer)."""
    if counts_E is not None and keep_TK is not None:
        raise ValueError("sort_slots: counts_E counts every slot; with a keep_TK, leave it to sort_slots")
    num_tokens, top_k = topk_ids_TK.shape
    ids_N = topk_ids_TK.flatten()
    if keep_TK is not None:
        ids_N = torch.where(keep_TK.flatten(), ids_N, num_experts)
    if first_slot % max(1, ids_N.shape[0]):  # one key per slot: expert, then rotated slot
        num_slots = ids_N.shape[0]
        rotated_N = torch.arange(num_slots, device=ids_N.device).sub_(first_slot).remainder_(num_slots)
        slot_index_N = torch.argsort(ids_N.long() * num_slots + rotated_N)
    else:
        slot_index_N = torch.argsort(ids_N, stable=True)
    row_of_slot_N = None
    if inverse:
        row_of_slot_N = torch.empty_like(slot_index_N).scatter_(
            0, slot_index_N, torch.arange(slot_index_N.shape[0], device=ids_N.device))
        if keep_TK is not None:
            row_of_slot_N.masked_fill_(~keep_TK.flatten(), -1)
    return RoutingMetadata(
        counts_E=count_sorted(ids_N[slot_index_N], num_experts) if counts_E is None else counts_E,
        slot_index_R=slot_index_N,
        token_index_R=torch.div(slot_index_N, top_k, rounding_mode="floor"),
        row_of_slot_N=row_of_slot_N,
        num_tokens=num_tokens,
        top_k=top_k,
    )


@dataclass(frozen=True)
class RankRouting:
    """Where one rank's tokens go at EP>1, each token sent once per destination rank.

    A token whose K experts live on several ranks is sent to each of those ranks once
    (not once per expert), with the K local expert ids it has there (-1 for slots that
    go elsewhere or were dropped); the receiving rank expands the row to its experts and
    sums their outputs before sending one row back. Rows sent: U = sum over tokens of
    their distinct destination ranks, at most N.

    :func:`build_rank_routing` makes it before U is on the host, with T*min(P, K) rows of
    which the first U are sent (grouped by destination rank); :meth:`first_rows` cuts it
    to U.
    """

    pairs: RoutingMetadata
    """The (token, rank) pairs as routing metadata with "experts" = ranks and top_k = P:
    ``token_index_R`` is the token of each sent row (rows grouped by destination rank,
    tokens in order), ``row_of_slot_N`` the sent row of pair ``t*P + p`` (-1: none), so
    :func:`ep_moe.kernels.permute.permute_tokens` builds the send buffer and
    :func:`~ep_moe.kernels.permute.sum_slot_rows` sums the rows that come back."""
    local_ids_UK: torch.Tensor
    """int32 [U, K]: for each sent row, the destination's local expert id of each slot
    that goes there (-1 otherwise)."""
    num_sent: torch.Tensor
    """U on the device (0-dim int64), for gathers issued before it is on the host."""

    def first_rows(self, num_rows: int) -> "RankRouting":
        """The routing of the first ``num_rows`` rows (U, from the exchanged counts)."""
        return dataclasses.replace(self, pairs=self.pairs.first_rows(num_rows),
                                   local_ids_UK=self.local_ids_UK[:num_rows])


def rank_counts(topk_ids_TK: torch.Tensor, keep_TK: Optional[torch.Tensor], experts_per_rank: int,
                ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per destination rank, on the device: ``sends_TP`` (bool [T, P], token t has a kept
    slot on rank p) and ``counts_P2`` (int64 [P, 2]: rows sent, kept slots sent)."""
    num_tokens = topk_ids_TK.shape[0]
    rank_TK = torch.div(topk_ids_TK, experts_per_rank, rounding_mode="floor")
    kept_TK = torch.ones_like(topk_ids_TK, dtype=torch.int64) if keep_TK is None else keep_TK.long()
    slots_TP = torch.zeros(num_tokens, ep_size, dtype=torch.int64, device=topk_ids_TK.device)
    slots_TP.scatter_add_(1, rank_TK, kept_TK)
    sends_TP = slots_TP > 0
    return sends_TP, torch.stack([sends_TP.sum(0), slots_TP.sum(0)], dim=1)


def build_rank_routing(topk_ids_TK: torch.Tensor, keep_TK: Optional[torch.Tensor], sends_TP: torch.Tensor,
                       experts_per_rank: int) -> RankRouting:
    """:class:`RankRouting` from :func:`rank_counts`'s ``sends_TP``, with no host sync:
    T*min(P, K) rows, of which the first U are sent (cut with :meth:`RankRouting.first_rows`)."""
    num_tokens, ep_size = sends_TP.shape
    ranks_TP = torch.arange(ep_size, device=sends_TP.device).expand(num_tokens, ep_size)
    # a token goes to at most min(P, K) ranks: rows past T * min(P, K) are never sent
    pairs = sort_slots(ranks_TP, ep_size, sends_TP).first_rows(num_tokens * min(ep_size, topk_ids_TK.shape[1]))
    rank_U = pairs.slot_index_R % ep_size
    ids_UK = topk_ids_TK.index_select(0, pairs.token_index_R)
    to_rank_UK = torch.div(ids_UK, experts_per_rank, rounding_mode="floor") == rank_U[:, None]
    if keep_TK is not None:
        to_rank_UK &= keep_TK.index_select(0, pairs.token_index_R)
    local_ids_UK = torch.where(to_rank_UK, ids_UK - rank_U[:, None] * experts_per_rank, -1)
    return RankRouting(pairs=pairs, local_ids_UK=local_ids_UK.to(torch.int32), num_sent=pairs.counts_E.sum())


def combine_slots(y_NH: torch.Tensor, top_k: int, weights_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum each token's K slots (rows in slot order), times their top-k weights ``weights_N``
    (flattened in slot order) when given, else already weighted (by the expert GEMM): [T, H]
    in y's dtype, weighted and accumulated in fp32 (fp64 for fp64 rows) and rounded once
    (under CUDA autocast a plain ``sum`` would return fp32). Weighted as [T, K, H], so that
    the gradient of the rows needs no copy back to [N, H]."""
    acc_dtype = torch.float64 if y_NH.dtype == torch.float64 else torch.float32
    y_TKH = y_NH.view(-1, top_k, y_NH.shape[1])
    if weights_N is not None:
        y_TKH = y_TKH * weights_N.to(acc_dtype).view(-1, top_k, 1)
    return y_TKH.sum(dim=1, dtype=acc_dtype).to(y_NH.dtype)
