"""Shared helpers of the layer tests (tests/test_layer.py, tests/test_config.py,
tests/ep/test_layer_ep.py): the small config every test builds on, the float64 loop
reference of the documented forward (``naive_moe``), and the forward/backward runner and
gradient collection used to compare a layer against EP=1."""

import math

import torch
import torch.nn.functional as F

from ep_moe import MoEConfig, MoELayer
from ep_moe.layer import moe_aux_loss
from ep_moe.parallel import is_expert_param

H, I, E = 16, 8, 8
BASE = dict(hidden_size=H, intermediate_size=I, num_experts=E, aux_loss_coef=0.1, z_loss_coef=0.01,
            init_std=0.5, backend="torch")
ATOL = 1e-5


def _config(**overrides) -> MoEConfig:
    return MoEConfig(**{**BASE, **overrides})


# ---------------------------------------------------------------------------------------
# Independent reference: one token, one slot at a time, float64.


def _mlp(x_H, w_up, w_down, activation):
    h = w_up @ x_H
    if activation == "swiglu":
        a = F.silu(h[: h.shape[0] // 2]) * h[h.shape[0] // 2:]
    elif activation == "gelu":
        a = F.gelu(h)
    else:
        a = F.relu(h)
    return w_down @ a


def naive_moe(x, params, cfg: MoEConfig, bias_E=None):
    """Loop reference of the documented forward. ``params``: router [E, H], gate_up.{g},
    down.{g}, optional shared_up / shared_down. Returns (y, aux, z, counts, dropped)."""
    x_TH = x.reshape(-1, cfg.hidden_size)
    num_tokens, top_k, num_experts = x_TH.shape[0], cfg.top_k, cfg.num_experts
    slots = []  # (t, e, weight, score)
    probs, lse = [], []
    for t in range(num_tokens):
        logits = params["router"] @ x_TH[t]
        scores = torch.softmax(logits, 0) if cfg.score_func == "softmax" else torch.sigmoid(logits)
        probs.append(scores / scores.sum())
        lse.append(torch.log(torch.exp(logits).sum()))
        select = [float(scores[e].detach()) + (0.0 if bias_E is None else float(bias_E[e]))
                  for e in range(num_experts)]
        chosen = sorted(range(num_experts), key=lambda e: -select[e])[:top_k]
        denom = sum(scores[e] for e in chosen) if cfg.norm_topk_prob else 1.0
        slots.extend((t, e, scores[e] / denom, float(scores[e].detach())) for e in chosen)
    keep = [True] * len(slots)
    if cfg.capacity_factor is not None:
        capacity = math.ceil(cfg.capacity_factor * num_tokens * top_k / num_experts)
        for e in range(num_experts):
            mine = [n for n, s in enumerate(slots) if s[1] == e]
            if cfg.drop_policy == "probs":
                mine.sort(key=lambda n: -slots[n][3])
            for n in mine[capacity:]:
                keep[n] = False
    rows = [torch.zeros(cfg.hidden_size, dtype=x_TH.dtype) for _ in range(num_tokens)]
    for (t, e, w, _), kept in zip(slots, keep):
        if kept:
            rows[t] = rows[t] + w * _mlp(x_TH[t], params[f"gate_up.{e}"], params[f"down.{e}"], cfg.activation)
    if "shared_up" in params:
        rows = [r + _mlp(x_TH[t], params["shared_up"], params["shared_down"], cfg.activation)
                for t, r in enumerate(rows)]
    y = torch.stack(rows).reshape(x.shape) if rows else x.new_zeros(x.shape)
    counts = [sum(1 for s in slots if s[1] == e) for e in range(num_experts)]
    aux = z = torch.zeros((), dtype=x_TH.dtype)
    if num_tokens:
        aux = cfg.aux_loss_coef * num_experts * sum(
            counts[e] / (num_tokens * top_k) * sum(p[e] for p in probs) / num_tokens for e in range(num_experts))
        z = cfg.z_loss_coef * sum(v ** 2 for v in lse) / num_tokens
    return y, aux, z, counts, keep.count(False)


def _naive_params(layer: MoELayer):
    sd = layer.state_dict()
    params = {"router": sd["router.weight"]}
    for g in range(layer.config.num_experts):
        params[f"gate_up.{g}"] = sd[f"experts.gate_up.{g}"]
        params[f"down.{g}"] = sd[f"experts.down.{g}"]
    if layer.shared_experts is not None:
        params["shared_up"] = sd["shared_experts.gate_up.weight"]
        params["shared_down"] = sd["shared_experts.down.weight"]
    return {k: v.double().requires_grad_() for k, v in params.items()}


def _grad(leaf):
    """A leaf's gradient; zeros when it took no part (an expert no token chose)."""
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad


def _run_layer(layer, x, g, stats_of=None):
    """Forward and backward of ``sum(y * g) + aux + z`` through ``layer`` (a module or a
    function of x; then ``stats_of`` is the MoE layer whose losses and stats count)."""
    stats_of = layer if stats_of is None else stats_of
    x = x.clone().requires_grad_()
    y = layer(x)
    ((y * g).sum() + moe_aux_loss(stats_of)).backward()
    s = stats_of.last_stats
    return dict(y=y.detach(), dx=x.grad, aux=s.aux_loss.detach(), z=s.z_loss.detach(),
                counts=s.tokens_per_expert, dropped=s.num_dropped)


def _param_grads(layer):
    """Gradients keyed like the state dict (global expert ids)."""
    grads = {name: _grad(p).clone() for name, p in layer.named_parameters() if not is_expert_param(p)}
    for name in ("gate_up", "down"):
        stacked = _grad(getattr(layer.experts, name))
        for j, g in enumerate(layer.experts.global_ids()):
            grads[f"experts.{name}.{g}"] = stacked[j]
    return grads


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=1e-5)


def assert_matches_naive(layer: MoELayer, x: torch.Tensor, g: torch.Tensor, bias_E=None, atol=ATOL, rtol=1e-5):
    """One forward and backward of ``sum(y * g) + aux + z`` through ``layer`` (EP=1) against
    :func:`naive_moe` in float64: the output, the losses, the counts and drops, and the
    gradients of x, the router, every expert and the shared experts. Returns the number of
    dropped slots."""
    cfg = layer.config
    x = x.detach().requires_grad_()  # its layout kept (a view of the caller's tensor)
    y = layer(x)
    stats = layer.last_stats
    ((y * g).sum() + moe_aux_loss(layer)).backward()
    params = _naive_params(layer)
    x64 = x.detach().double().requires_grad_()
    y_ref, aux_ref, z_ref, counts_ref, dropped_ref = naive_moe(x64, params, cfg, bias_E)
    ((y_ref * g.double()).sum() + aux_ref + z_ref).backward()

    def close(actual, expected):
        torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)

    assert y.shape == x.shape and y.dtype == x.dtype
    close(y, y_ref)
    close(stats.aux_loss, aux_ref)
    close(stats.z_loss, z_ref)
    assert stats.tokens_per_expert.tolist() == counts_ref
    assert int(stats.num_dropped) == dropped_ref
    close(x.grad, x64.grad)
    close(layer.router.weight.grad, _grad(params["router"]))
    for j, g_id in enumerate(layer.experts.global_ids()):
        close(_grad(layer.experts.gate_up)[j], _grad(params[f"gate_up.{g_id}"]))
        close(_grad(layer.experts.down)[j], _grad(params[f"down.{g_id}"]))
    if layer.shared_experts is not None:
        close(layer.shared_experts.gate_up.weight.grad, params["shared_up"].grad)
        close(layer.shared_experts.down.weight.grad, params["shared_down"].grad)
    return dropped_ref
