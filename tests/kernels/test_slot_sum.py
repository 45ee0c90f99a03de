"""grouped_gemm_slot_sum (down projection + per-token slot sum, the backward reading the
token gradients through the routed rows' token index) against a float64 reference:
output and the gradients of the rows, the weights and the row weights; zero-row experts,
dropped slots, tokens with no slot here, sizes that are multiples of no block; and its dW
queued under defer_weight_grads equals the direct one."""

from __future__ import annotations

import pytest
import torch

from ep_moe.kernels.ops import DeferredWeightGrads, defer_weight_grads, grouped_gemm_slot_sum
from ep_moe.routing import build_routing_metadata
from test_grouped_gemm import DEVICE, DTYPES, TOL, configs_for, rel_err

TOP_K = 3


def _problem(dtype, num_tokens, num_experts, n, k, seed):
    """Routing of ``num_tokens`` tokens' K slots over ``num_experts`` experts with some slots
    dropped (id -1, as at an EP receiver) and expert 1 empty; the routed rows' inputs,
    weights and row weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (num_tokens, TOP_K), generator=gen)
    ids[ids == 1] = 0  # expert 1 gets no rows
    ids[torch.rand(num_tokens, TOP_K, generator=gen) < 0.3] = -1  # slots that went elsewhere
    ids[0] = -1  # a token with no slot here
    kept = ids >= 0
    meta = build_routing_metadata(ids.clamp(min=0).to(DEVICE), num_experts, kept.to(DEVICE),
                                  num_kept=int(kept.sum()))
    rows = meta.slot_index_R.shape[0]
    a = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(num_experts, n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    row_weights = torch.rand(rows, generator=gen).to(DEVICE)
    return meta, a, w, row_weights


def _reference(meta, a, w, row_weights):
    a, w, rw = a.double(), w.double(), row_weights.double()
    experts = torch.repeat_interleave(torch.arange(w.shape[0], device=a.device), meta.counts_E)
    rows = torch.einsum("rk,rnk->rn", a, w[experts]) * rw[:, None]
    out = torch.zeros(meta.num_tokens, w.shape[1], dtype=torch.float64, device=a.device)
    return out.index_add(0, meta.token_index_R, rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,n,k", [(23, 37, 45), (1, 24, 20), (70, 40, 33)])
def test_matches_reference_and_gradients(dtype, num_tokens, n, k):
    meta, a, w, row_weights = _problem(dtype, num_tokens, 4, n, k, seed=num_tokens)
    a.requires_grad_()
    w.requires_grad_()
    row_weights.requires_grad_()
    out = grouped_gemm_slot_sum(a, w, meta.counts_E, row_weights, meta.token_index_R, meta.row_of_slot_N, TOP_K,
                                configs_for(dtype))
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, w, row_weights), dy)

    ref_inputs = [t.detach().double().requires_grad_() for t in (a, w, row_weights)]
    ref = _reference(meta, *ref_inputs)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dy.double())
    assert out.dtype == dtype and out.shape == (num_tokens, n)
    assert rel_err(out, ref) < TOL[dtype]
    assert not out[0].any()  # the token with no slot here
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOL[dtype]
    assert not grads[1][1].any()  # the empty expert's dW


def test_deferred_weight_grad_equals_direct():
    meta, a, w, row_weights = _problem(torch.float32, 29, 3, 24, 20, seed=5)
    w.requires_grad_()
    out = grouped_gemm_slot_sum(a, w, meta.counts_E, row_weights, meta.token_index_R, meta.row_of_slot_N, TOP_K,
                                configs_for(torch.float32))
    dy = torch.randn_like(out)
    (direct,) = torch.autograd.grad(out, w, dy, retain_graph=True)
    queue = DeferredWeightGrads([w])
    with defer_weight_grads(queue):
        out.backward(dy)
    assert w.grad is None and len(queue) == 1  # queued, not computed
    queue.run()
    torch.testing.assert_close(w.grad, direct)
