"""EP=1 (no EP group): every expert is here, nothing travels (:class:`LocalDispatcher`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ep_moe.ep.base import Dispatcher
from ep_moe.grouped_mm_experts import once_differentiable_output
from ep_moe.kernels.permute import sum_slot_rows
from ep_moe.routing import RouterOutput, RoutingMetadata, build_routing_metadata

if TYPE_CHECKING:
    from ep_moe.experts import GroupedExperts


@dataclass
class LocalTokens:
    """What :meth:`LocalDispatcher.dispatch` hands its later steps."""

    backend: str
    x_TH: torch.Tensor
    weights_N: torch.Tensor
    """The top-k weights, flattened in slot order."""
    meta: RoutingMetadata


class LocalDispatcher(Dispatcher):
    """EP=1: one gather GEMM, one scatter GEMM with the top-k weights fused in, then each
    token's K slots summed (with the experts, dropless)."""

    def dispatch(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                 backend: str) -> LocalTokens:
        """The (token, slot) pairs sorted by expert (:func:`ep_moe.routing.build_routing_metadata`).
        Dropless, the router's counts are the rows per expert, and the slot sum is a plain sum
        over each token's K rows in slot order (the experts' ``slots_per_token``), which
        needs no ``row_of_slot_N``: neither is computed again."""
        if keep_TK is None:
            meta = build_routing_metadata(router.topk_ids_TK, self.config.num_experts, counts_E=router.counts_E,
                                          inverse=False)
        else:
            meta = build_routing_metadata(router.topk_ids_TK, self.config.num_experts, keep_TK)
        return LocalTokens(backend, x_TH, router.topk_weights_TK.flatten(), meta)

    def experts(self, routed: LocalTokens, experts: "GroupedExperts") -> torch.Tensor:
        """GEMM1 gathering the tokens, GEMM2 weighting the rows: each token's K slots summed,
        [T, H] (dropless), else [R, H] in expert order."""
        meta = routed.meta
        # looked up only if the kernels run (a small eager call runs torch._grouped_mm instead)
        configs = functools.partial(experts.kernel_configs, routed.backend, meta.slot_index_R.shape[0], routed.x_TH)
        if meta.dropless:
            return experts(routed.x_TH, meta.counts_E, gather_index=meta.token_index_R,
                           scatter_index=meta.slot_index_R, row_weights=routed.weights_N,
                           backend=routed.backend, configs=configs, gather_slots=meta.slot_index_R,
                           slots_per_token=meta.top_k)
        return experts(routed.x_TH, meta.counts_E, gather_index=meta.token_index_R,
                       row_weights=routed.weights_N[meta.slot_index_R], backend=routed.backend, configs=configs)

    def combine(self, routed: LocalTokens, out: torch.Tensor) -> torch.Tensor:
        """Each token's K slots summed: [T, H] (dropless: by the experts already). On the
        torch backend as autograd's own ops, whose backward is differentiable again (double
        backward, e.g. a gradient penalty): :func:`~ep_moe.kernels.permute.sum_slot_rows`'
        is not, and would drop the second derivative's terms through it without a word."""
        if routed.meta.dropless:
            return out
        if routed.backend == "torch":
            return _sum_slot_rows_torch(out, routed.meta)
        return once_differentiable_output(sum_slot_rows(out, routed.meta, routed.backend), routed.backend)


def _sum_slot_rows_torch(rows_RH: torch.Tensor, meta: RoutingMetadata) -> torch.Tensor:
    """:func:`~ep_moe.kernels.permute.sum_slot_rows` in torch ops (the same sums, accumulated in
    fp32, or fp64 for fp64 rows; its backward the same values: each row is one slot's)."""
    row_of_slot_N = meta.row_of_slot_N
    if rows_RH.shape[0] == 0:  # every slot dropped (or no tokens): zeros, still in the graph
        return rows_RH.sum(0).expand(meta.num_tokens, -1).contiguous()
    picked_NH = rows_RH.index_select(0, row_of_slot_N.clamp_min(0)).masked_fill((row_of_slot_N < 0)[:, None], 0)
    acc_dtype = torch.float64 if rows_RH.dtype == torch.float64 else torch.float32
    return picked_NH.view(meta.num_tokens, meta.top_k, -1).sum(dim=1, dtype=acc_dtype).to(rows_RH.dtype)
