"""DeepSpeed's gating (``TopKGate`` in ``deepspeed/moe/sharded_moe.py``, 0.19.8) as ep_moe routing.

:class:`DeepSpeedGate` holds ``TopKGate``'s arguments; :meth:`DeepSpeedGate.route` turns
this rank's tokens and the gate weight into what :class:`ep_moe.MoELayer` dispatches (its
``route_fn`` hook): a :class:`~ep_moe.routing.RouterOutput` (expert ids, combine weights,
``l_aux`` as ``aux_loss``, ``exp_counts`` as ``counts_E``) and the keep mask. It runs
DeepSpeed's tensor operations in DeepSpeed's order on the same [T, E] tensors, so the
results are DeepSpeed's on the same device, ties included: the experts, the EP dispatch
and the kernels stay ep_moe's. It never imports DeepSpeed.

What DeepSpeed computes (``gates = softmax(x.float() @ wg.float()^T)``, capacity
``C = max(ceil(T / E * c), min_capacity)`` over this rank's T tokens, with ``c`` the
``capacity_factor`` in training and ``eval_capacity_factor`` in eval mode, computed in a
float32 tensor as DeepSpeed does):

- k=1 (``top1gating``): the argmax expert, weight the raw probability. With
  ``drop_tokens`` each expert keeps ``min(C, T)`` tokens, chosen by ``torch.topk`` over the
  dim of tokens: of uniform draws (``use_rts``, random token selection) or of the 0/1
  assignment mask (which ties break as ``torch.topk`` breaks them, not by position).
  ``used_token`` zeroes the tokens it masks out: not routed, not counted.
  ``noisy_gate_policy="RSample"`` picks the argmax of the logits plus Gumbel noise
  (training only; the weight stays the clean probability).
- k=2 (``top2gating``): the argmax, then the argmax of the other logits, plus Gumbel
  noise when ``top2_2nd_expert_sampling`` (in training and eval, as DeepSpeed). With
  ``drop_tokens`` (``C`` from ``2c``) each expert keeps its first-choice tokens in
  position order, then its second-choice ones. The two weights are divided by the sum of
  the kept ones. ``l_aux`` counts first choices only; ``exp_counts`` both.
- k>=3 (``topkgating``, ``drop_policy="probs"``): the top-k; with ``drop_tokens``
  (``C`` from ``k*c``) each expert keeps the ``min(C, T)`` tokens of highest probability.
  Weights divided by the sum of the kept ones.
- ``l_aux`` is ``E * sum_e me_e * ce_e / k`` (``me`` the mean probability, ``ce`` the
  fraction of tokens sent to e; k=2: first choices, not divided by 2), ``exp_counts``
  the assignments per expert before any drop (int64).
- ``noisy_gate_policy="Jitter"`` multiplies the gate's input by U(0.99, 1.01) in training,
  for every k. "RSample" has an effect for k=1 only, ``use_rts`` and ``used_token`` too,
  ``top2_2nd_expert_sampling`` for k=2 only: as in DeepSpeed.

Random draws. Each is drawn as DeepSpeed draws it (the same ``torch.distributions``
sampler, shape, device and order), so with the same RNG state the drop-in draws the same
numbers and leaves the generator where DeepSpeed leaves it: the Jitter's [T, H] uniforms,
then k=1's RSample Gumbel [T, E] and ``use_rts``'s uniforms [T, E] (drawn also when
dropless: nothing is dropped then, but the draw keeps the generator in step), or k=2's
Gumbel [T, E].

Where it departs from DeepSpeed, with the same results: dropless, DeepSpeed all-reduces
the largest expert count over the EP group to size its buffers, which drops nothing;
ep_moe's dispatch needs no capacity, so no collective runs here (and a k=1 token whose
random draw is exactly 0.0 is not dropped, as DeepSpeed's ``torch.topk`` may). DeepSpeed's
k=1 gate asserts that T >= ``min_capacity``; this one routes fewer tokens too, keeping all
of them (each expert has room for ``min_capacity``). ``used_token``'s nonzero entries are
the used tokens, so ``exp_counts`` stays int64 where DeepSpeed's follows a float mask's
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ep_moe.config import MAX_CAPACITY_FACTOR, MAX_EXPERTS, MAX_WIDTH, _int_rule, _is_int, _number_rule, _Rule
from ep_moe.routing import RouterOutput

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""The ``noisy_gate_policy`` values DeepSpeed's MoE accepts."""

JITTER_EPSILON = 1e-2
"""DeepSpeed's ``multiplicative_jitter`` scale: the gate input times U(1 - eps, 1 + eps)."""

MAX_MIN_CAPACITY = 2**31 - 1
"""The largest ``min_capacity``: a floor of 2**31 slots per expert per rank is no floor."""

_CAPACITY_NEGATIVE = ("is negative; DeepSpeed's capacity max(ceil(T / E * capacity_factor), min_capacity) needs "
                      "both >= 0")
_CAPACITY_FACTOR = _number_rule(
    0.0, MAX_CAPACITY_FACTOR, _CAPACITY_NEGATIVE, above_minimum=False,
    fix="DeepSpeed's default is 1.0; from num_experts / k on every token is kept already (or pass drop_tokens=False)")
ARGUMENT_RULES: dict[str, _Rule] = {
    "hidden_size": _int_rule(1, MAX_WIDTH, "must be a positive int"),
    "num_experts": _int_rule(1, MAX_EXPERTS, "must be a positive int"),
    "ep_size": _int_rule(1, MAX_EXPERTS, "must be a positive int that divides num_experts"),
    # its range, [1, num_experts], is checked with num_experts (DeepSpeedGate)
    "k": _Rule(_is_int, "must be an int"),
    "capacity_factor": _CAPACITY_FACTOR,
    "eval_capacity_factor": _CAPACITY_FACTOR,
    "min_capacity": _int_rule(0, MAX_MIN_CAPACITY, _CAPACITY_NEGATIVE, fix="DeepSpeed's default is 4"),
    "intermediate_size": _int_rule(1, MAX_WIDTH, "must be a positive int", optional=True),
}
"""One rule per numeric argument of the DeepSpeed drop-in (``MoE`` and its gate): what
DeepSpeed takes, less what it would compute nonsense from (a NaN or infinite capacity
factor drops all but ``min_capacity`` tokens of each expert, silently)."""


def check_arguments(**values) -> None:
    """Raise ``ValueError`` naming the argument, its value, the allowed range and the fix
    for a value of ``ARGUMENT_RULES`` outside its rule (``capacity_factor=nan must be a
    finite number; allowed: 0 <= capacity_factor <= 65536; ...``)."""
    for name, value in values.items():
        ARGUMENT_RULES[name].check(name, value, prefix="", sep=" ")


@dataclass(frozen=True)
class DeepSpeedGate:
    """``TopKGate``'s arguments (DeepSpeed's ``MoE`` defaults); checked on construction as
    DeepSpeed checks them, and where DeepSpeed would fail later or compute nonsense
    (:data:`ARGUMENT_RULES`: a capacity factor must be finite, in [0, 65536])."""

    num_experts: int
    """E, experts over the EP group."""
    k: int = 1
    """Experts per token (1 <= k <= E)."""
    capacity_factor: float = 1.0
    """Capacity per expert in training, a multiple of T*k/E (``drop_tokens`` only)."""
    eval_capacity_factor: float = 1.0
    """The same in eval mode."""
    min_capacity: int = 4
    """Capacity floor per expert (``drop_tokens`` only)."""
    noisy_gate_policy: Optional[str] = None
    """None/"None", "Jitter" (input jitter, any k) or "RSample" (Gumbel-noised top-1)."""
    drop_tokens: bool = True
    """Drop the assignments past each expert's capacity."""
    use_rts: bool = True
    """k=1: which tokens an expert over capacity keeps is random (else ``torch.topk``'s)."""
    top2_2nd_expert_sampling: bool = True
    """k=2: the second expert is sampled with Gumbel noise on the logits."""

    def __post_init__(self) -> None:
        check_arguments(num_experts=self.num_experts, k=self.k, capacity_factor=self.capacity_factor,
                        eval_capacity_factor=self.eval_capacity_factor, min_capacity=self.min_capacity)
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={self.noisy_gate_policy!r} is not one of DeepSpeed's "
                             f"{NOISY_GATE_POLICIES} (DeepSpeed: 'Unsupported noisy_gate_policy'); pass one of them")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"k={self.k} must be in [1, num_experts={self.num_experts}]: each token goes to k "
                             "distinct experts; lower k or add experts")

    def route(self, x_TH: torch.Tensor, weight_EH: torch.Tensor, *, training: bool,
              used_token: Optional[torch.Tensor] = None) -> tuple[RouterOutput, Optional[torch.Tensor]]:
        """DeepSpeed's routing of this rank's tokens ``x_TH`` [T, H] with gate weight
        ``weight_EH`` [E, H] (``wg.weight``): the router output and the keep mask ([T, k]
        bool, None when no slot can be dropped). ``training`` picks the capacity factor and
        the noise; ``used_token`` (k=1 only, T entries, nonzero = used) masks tokens out."""
        x_TH = x_TH.float()
        if self.noisy_gate_policy == "Jitter" and training:
            x_TH = multiplicative_jitter(x_TH)
        logits_TE = F.linear(x_TH, weight_EH.float())
        factor = self.capacity_factor if training else self.eval_capacity_factor
        if self.k == 1:
            used_T = None if used_token is None else _used_mask(used_token, x_TH.shape[0])
            return self._top1(logits_TE, factor, used_T, rsample=self.noisy_gate_policy == "RSample" and training)
        if self.k == 2:
            return self._top2(logits_TE, factor)
        return self._topk(logits_TE, factor)

    def _top1(self, logits_TE: torch.Tensor, factor: float, used_T: Optional[torch.Tensor], rsample: bool
              ) -> tuple[RouterOutput, Optional[torch.Tensor]]:
        """``top1gating``."""
        num_tokens, num_experts = logits_TE.shape
        noisy_TE = logits_TE + gumbel_rsample(logits_TE.shape, logits_TE.device) if rsample else None
        gates_TE = F.softmax(logits_TE, dim=1)
        ids_T = torch.argmax(gates_TE if noisy_TE is None else noisy_TE, dim=1)
        mask_TE = F.one_hot(ids_T, num_classes=num_experts)
        if used_T is not None:
            mask_TE = used_T[:, None] * mask_TE
        counts_E = mask_TE.sum(dim=0).detach()
        l_aux = torch.sum(gates_TE.mean(dim=0) * mask_TE.float().mean(dim=0)) * num_experts
        # drawn also when dropless (and then unused), as DeepSpeed draws it
        rank_TE = mask_TE * _uniform(mask_TE.shape, logits_TE.device) if self.use_rts else mask_TE
        if self.drop_tokens:
            kept = min(capacity(num_tokens, num_experts, factor, self.min_capacity), num_tokens)
            top_idx = torch.topk(rank_TE, k=kept, dim=0)[1]
            mask_TE = mask_TE * torch.zeros_like(mask_TE).scatter_(0, top_idx, 1)
        keep_T1 = None if not self.drop_tokens and used_T is None else mask_TE.sum(dim=1, keepdim=True) > 0
        weights_T1 = (gates_TE * mask_TE).sum(dim=1, keepdim=True)
        return _output(ids_T[:, None], weights_T1, gates_TE, counts_E, l_aux), keep_T1

    def _top2(self, logits_TE: torch.Tensor, factor: float) -> tuple[RouterOutput, Optional[torch.Tensor]]:
        """``top2gating``."""
        num_tokens, num_experts = logits_TE.shape
        gates_TE = F.softmax(logits_TE, dim=1)
        ids1_T = torch.argmax(gates_TE, dim=1)
        mask1_TE = F.one_hot(ids1_T, num_classes=num_experts)
        if self.top2_2nd_expert_sampling:  # Gumbel-max: the second expert sampled from the rest
            logits_TE = logits_TE + gumbel_rsample(logits_TE.shape, logits_TE.device)
        ids2_T = torch.argmax(logits_TE.masked_fill(mask1_TE.bool(), float("-inf")), dim=1)
        mask2_TE = F.one_hot(ids2_T, num_classes=num_experts)
        l_aux = torch.mean(gates_TE.mean(dim=0) * mask1_TE.float().mean(dim=0)) * num_experts * num_experts
        counts_E = torch.sum(mask1_TE + mask2_TE, dim=0).detach()
        if self.drop_tokens:  # position order, every first choice before the second ones
            cap = capacity(num_tokens, num_experts, factor * 2, self.min_capacity)
            locations1_TE = torch.cumsum(mask1_TE, dim=0) - 1
            locations2_TE = torch.cumsum(mask2_TE, dim=0) - 1 + torch.sum(mask1_TE, dim=0, keepdim=True)
            mask1_TE = mask1_TE * torch.lt(locations1_TE, cap)
            mask2_TE = mask2_TE * torch.lt(locations2_TE, cap)
        gates1_T = torch.einsum("se,se->s", gates_TE, mask1_TE.float())
        gates2_T = torch.einsum("se,se->s", gates_TE, mask2_TE.float())
        denom_T = torch.clamp(gates1_T + gates2_T, min=torch.finfo(gates1_T.dtype).eps)
        weights_T2 = torch.stack([gates1_T / denom_T, gates2_T / denom_T], dim=1)
        keep_T2 = torch.stack([mask1_TE.any(dim=1), mask2_TE.any(dim=1)], dim=1) if self.drop_tokens else None
        ids_T2 = torch.stack([ids1_T, ids2_T], dim=1)
        return _output(ids_T2, weights_T2, gates_TE, counts_E, l_aux), keep_T2

    def _topk(self, logits_TE: torch.Tensor, factor: float) -> tuple[RouterOutput, Optional[torch.Tensor]]:
        """``topkgating`` with its ``drop_policy="probs"``, the one ``TopKGate`` uses."""
        num_tokens, num_experts = logits_TE.shape
        gates_TE = F.softmax(logits_TE, dim=1)
        top_gate_TK, ids_TK = torch.topk(gates_TE, k=self.k, dim=1)
        mask_TE = torch.zeros_like(gates_TE, dtype=torch.bool).scatter_(1, ids_TK, 1)
        counts_E = torch.sum(mask_TE, dim=0).detach()
        l_aux = torch.mean(gates_TE.mean(dim=0) * mask_TE.float().mean(dim=0)) * num_experts * num_experts / self.k
        if self.drop_tokens:  # each expert keeps its tokens of highest probability
            cap = capacity(num_tokens, num_experts, factor * self.k, self.min_capacity)
            chosen_TE = torch.zeros_like(gates_TE).scatter(1, ids_TK, top_gate_TK)
            top_idx = torch.topk(chosen_TE, k=min(cap, num_tokens), dim=0, sorted=False)[1]
            mask_TE = mask_TE & torch.zeros_like(gates_TE, dtype=torch.bool).scatter_(0, top_idx, True)
        masked_TE = gates_TE * mask_TE
        denom_T1 = torch.clamp(torch.sum(masked_TE, dim=-1, keepdim=True), min=torch.finfo(masked_TE.dtype).eps)
        weights_TK = (masked_TE / denom_T1).gather(1, ids_TK)
        keep_TK = mask_TE.gather(1, ids_TK) if self.drop_tokens else None
        return _output(ids_TK, weights_TK, gates_TE, counts_E, l_aux), keep_TK


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity``: ``max(ceil(T / E * capacity_factor), min_capacity)``,
    the factor in a tensor of the default dtype (float32), so ``ceil`` rounds as DeepSpeed's."""
    cap = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return int(torch.maximum(cap, torch.tensor(min_capacity).to(torch.int64)))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = JITTER_EPSILON) -> torch.Tensor:
    """DeepSpeed's ``multiplicative_jitter``: ``x`` times U(1 - eps, 1 + eps) drawn per element."""
    low = torch.tensor(1.0 - epsilon, device=x.device)
    high = torch.tensor(1.0 + epsilon, device=x.device)
    return x * torch.distributions.uniform.Uniform(low=low, high=high).rsample(x.shape)


def gumbel_rsample(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """DeepSpeed's ``gumbel_rsample``: standard Gumbel noise."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """U(0, 1) as DeepSpeed's random token selection draws it."""
    low, high = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.uniform.Uniform(low=low, high=high).rsample(shape)


def _used_mask(used_token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``used_token`` as a 0/1 int64 vector of the T tokens."""
    if used_token.numel() != num_tokens:
        raise ValueError(f"used_token has {used_token.numel()} elements (shape {tuple(used_token.shape)}) but the "
                         f"input has {num_tokens} tokens; pass one entry per token, nonzero for the used ones")
    return (used_token.reshape(-1) != 0).to(torch.int64)


def _output(ids_TK: torch.Tensor, weights_TK: torch.Tensor, gates_TE: torch.Tensor, counts_E: torch.Tensor,
            l_aux: torch.Tensor) -> RouterOutput:
    """The routing as ep_moe's :class:`RouterOutput` (``z_loss`` 0: DeepSpeed has none)."""
    return RouterOutput(topk_ids_TK=ids_TK, topk_weights_TK=weights_TK,
                        topk_scores_TK=gates_TE.detach().gather(1, ids_TK), counts_E=counts_E.to(torch.int64),
                        aux_loss=l_aux, z_loss=l_aux.new_zeros(()))


__all__ = ["ARGUMENT_RULES", "DeepSpeedGate", "capacity", "check_arguments", "gumbel_rsample", "multiplicative_jitter"]
