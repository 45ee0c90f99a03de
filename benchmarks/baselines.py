"""The MoE layers ep_moe is measured against, built the way users build them today.

- :class:`PlainEPMoE`: a torchtitan-style expert-parallel layer (``torchtitan/models/
  common/moe.py`` and ``token_dispatcher.py``): fp32 router, argsort permute, count
  exchange, ``all_to_all_single`` with uneven splits (functional collectives, autograd),
  a second permute to expert-major order, ``torch._grouped_mm`` SwiGLU experts, the
  reverse path and a weighted combine. No fusion: three index copies each way.
- :func:`deepspeed_moe_like`: DeepSpeed's ``deepspeed.moe.layer.MoE`` (dropless, SwiGLU
  experts) with the weights of an :class:`ep_moe.MoELayer`.

Shape suffixes follow the legend in :mod:`ep_moe.routing`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ep_moe import MoELayer


class PlainEPMoE(nn.Module):
    """torchtitan-style EP MoE with SwiGLU experts and softmax top-k (renormalised) routing.

    Weights as in :class:`ep_moe.MoELayer` (``router.weight`` [E, H], ``w_gate_up``
    [e, 2I, H] with gate rows first, ``w_down`` [e, H, I]); ``torch._grouped_mm`` reads
    them as [e, K, N] through a transpose. Rank p of ``ep_group`` owns experts
    ``p*e .. p*e+e-1``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 ep_group: Optional[ProcessGroup] = None, *, device=None, dtype=None) -> None:
        super().__init__()
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        factory = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w_gate_up = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size,
                                                  **factory))
        self.w_down = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size, **factory))

    @classmethod
    @torch.no_grad()
    def like(cls, layer: MoELayer) -> "PlainEPMoE":
        """A plain layer with ``layer``'s configuration, group and (local) weights."""
        cfg, weight = layer.config, layer.experts.gate_up
        plain = cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k, layer.ep_group,
                    device=weight.device, dtype=weight.dtype)
        plain.router.weight.copy_(layer.router.weight)
        plain.w_gate_up.copy_(layer.experts.gate_up)
        plain.w_down.copy_(layer.experts.down)
        return plain

    def _experts(self, x_SH: torch.Tensor, m_sizes_e: torch.Tensor) -> torch.Tensor:
        """SwiGLU over expert-major rows with two ``torch._grouped_mm`` calls."""
        offsets_e = torch.cumsum(m_sizes_e, 0, dtype=torch.int32)
        h_SF = torch._grouped_mm(x_SH, self.w_gate_up.transpose(-2, -1), offs=offsets_e)
        gate_SI, up_SI = h_SF.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate_SI) * up_SI, self.w_down.transpose(-2, -1), offs=offsets_e)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]: route, permute, dispatch, experts, combine."""
        num_tokens, top_k = x_TH.shape[0], self.top_k
        scores_TE = torch.softmax(F.linear(x_TH.float(), self.router.weight.float()), dim=-1)
        topk_scores_TK, topk_ids_TK = torch.topk(scores_TE, top_k, dim=-1)
        weights_TK = topk_scores_TK / topk_scores_TK.sum(dim=-1, keepdim=True)

        ids_N = topk_ids_TK.flatten()
        order_N = torch.argsort(ids_N, stable=True)
        counts_E = torch.bincount(ids_N, minlength=self.num_experts)
        x_NH = x_TH[order_N // top_k]  # index copy 1: tokens in expert order

        if self.ep_size == 1:
            y_NH = self._experts(x_NH, counts_E)
        else:
            y_NH = self._dispatch_experts_combine(x_NH, counts_E)

        out_NH = torch.empty_like(y_NH).index_copy(0, order_N, y_NH)  # back to slot order
        out_TKH = out_NH.view(num_tokens, top_k, -1).float() * weights_TK.unsqueeze(-1)
        return out_TKH.sum(dim=1).to(x_TH.dtype)

    def _dispatch_experts_combine(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Count exchange, all-to-all, expert-major permute, experts, and the way back."""
        group, ep_size = self.ep_group, self.ep_size
        recv_counts_Pe = funcol.all_to_all_single(counts_E, None, None, group).view(ep_size, -1)
        send_P = counts_E.view(ep_size, -1).sum(1)
        splits = torch.cat([send_P, recv_counts_Pe.sum(1)]).tolist()  # host sync: split sizes
        send, recv = splits[:ep_size], splits[ep_size:]
        x_SH = funcol.all_to_all_single_autograd(x_NH, recv, send, group)
        x_SH = funcol.wait_tensor(x_SH)
        local_expert_S = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=x_NH.device).repeat(ep_size), recv_counts_Pe.flatten(),
            output_size=sum(recv))
        perm_S = torch.argsort(local_expert_S, stable=True)
        y_SH = self._experts(x_SH[perm_S], recv_counts_Pe.sum(0))  # index copy 2: expert-major
        y_SH = torch.empty_like(y_SH).index_copy(0, perm_S, y_SH)  # index copy 3: back to rank-major
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(y_SH, send, recv, group))


class SwiGLUExpert(nn.Module):
    """DeepSpeed expert module: ``down(silu(gate(x)) * up(x))``, bias-free, HF names."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.no_grad()
def deepspeed_moe_like(layer: MoELayer) -> nn.Module:
    """``deepspeed.moe.layer.MoE`` with ``layer``'s shape, EP size and weights: dropless,
    deterministic top-k (no second-expert sampling), SwiGLU experts. At EP > 1
    ``deepspeed.init_distributed`` must have run; DeepSpeed builds its own EP group with
    the same consecutive-rank layout as ep_moe, so local expert j matches."""
    from deepspeed.moe.layer import MoE

    cfg, weight = layer.config, layer.experts.gate_up
    inter = cfg.intermediate_size
    # DeepSpeed deep-copies the expert e times: build it on the meta device, then allocate once.
    expert = SwiGLUExpert(cfg.hidden_size, inter, device="meta", dtype=weight.dtype)
    ds = MoE(cfg.hidden_size, expert, num_experts=cfg.num_experts, ep_size=layer.ep_size, k=cfg.top_k,
             drop_tokens=False, top2_2nd_expert_sampling=False)
    ds = ds.to_empty(device=weight.device).to(weight.dtype)
    if layer.ep_size > 1:
        ds.set_deepspeed_parallelism()
    ds.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
    for j, ds_expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
        ds_expert.gate_proj.weight.copy_(layer.experts.gate_up[j, :inter])
        ds_expert.up_proj.weight.copy_(layer.experts.gate_up[j, inter:])
        ds_expert.down_proj.weight.copy_(layer.experts.down[j])
    return ds
