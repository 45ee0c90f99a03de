"""grouped_gemm_slot_sum (down projection + per-token slot sum, the backward reading the
token gradients through the routed rows' token index) against a float64 reference:
output and the gradients of the rows, the weights and the row weights, alone or any
subset of them; empty experts (first, middle, last), all rows on one expert, dropped
slots, tokens with no slot here, one token, sizes that are multiples of no block; strided
inputs; equal to the unfused path it replaces (grouped GEMM with row weights, then the
slot-sum kernel); and its dW queued under defer_weight_grads (one GEMM or two on the same
weights) equals the direct one."""

from __future__ import annotations

import pytest
import torch

from ep_moe.ep.pipeline import DeferredWeightGrads
from ep_moe.kernels.ops import defer_weight_grads, grouped_gemm, grouped_gemm_slot_sum
from ep_moe.kernels.permute import sum_slot_rows
from ep_moe.routing import build_routing_metadata
from test_grouped_gemm import DEVICE, DTYPES, TOL, configs_for, rel_err, row_dot_err

TOP_K = 3
NUM_EXPERTS = 4


def _problem(dtype, num_tokens, n, k, seed, routing="mixed", weights_dtype=torch.float32):
    """Routing of ``num_tokens`` tokens' K slots over 4 experts; ``routing``: ``"mixed"``
    (expert 1 empty, some slots dropped (id -1, as at an EP receiver), token 0 without a
    slot here when there are several tokens) or ``"one_expert"`` (every slot on expert 2:
    experts 0, 1 and 3 empty). The routed rows' inputs, weights and row weights."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "one_expert":
        ids = torch.full((num_tokens, TOP_K), 2)
    else:
        ids = torch.randint(0, NUM_EXPERTS, (num_tokens, TOP_K), generator=gen)
        ids[ids == 1] = 0  # expert 1 gets no rows
        ids[torch.rand(num_tokens, TOP_K, generator=gen) < 0.3] = -1  # slots that went elsewhere
        ids[-1, 0] = 3  # the last token keeps a slot here: even a lone token has rows
        if num_tokens > 1:
            ids[0] = -1  # a token with no slot here
    kept = ids >= 0
    meta = build_routing_metadata(ids.clamp(min=0).to(DEVICE), NUM_EXPERTS, kept.to(DEVICE),
                                  num_kept=int(kept.sum()))
    rows = meta.slot_index_R.shape[0]
    a = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(NUM_EXPERTS, n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    row_weights = torch.rand(rows, generator=gen).to(DEVICE, weights_dtype)
    return meta, a, w, row_weights


def _slot_sum(meta, a, w, row_weights, dtype):
    return grouped_gemm_slot_sum(a, w, meta.counts_E, row_weights, meta.token_index_R, meta.row_of_slot_N, TOP_K,
                                 configs_for(dtype))


def _unweighted_rows(meta, a, w):
    """Each routed row times its expert's weights, in float64."""
    experts = torch.repeat_interleave(torch.arange(w.shape[0], device=a.device), meta.counts_E)
    return torch.einsum("rk,rnk->rn", a.double(), w.double()[experts])


def _reference(meta, a, w, row_weights):
    rows = _unweighted_rows(meta, a, w) * row_weights.double()[:, None]
    out = torch.zeros(meta.num_tokens, w.shape[1], dtype=torch.float64, device=a.device)
    return out.index_add(0, meta.token_index_R, rows)


def _check_against_reference(meta, a, w, row_weights, dtype, wants_grad=(True, True, True)):
    """Output and the gradients of the inputs that want one against float64."""
    inputs = [t.requires_grad_(want) for t, want in zip((a, w, row_weights), wants_grad)]
    out = _slot_sum(meta, *inputs, dtype)
    dy = torch.randn_like(out)
    graded = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(out, graded, dy)
    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    ref = _reference(meta, *ref_inputs)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_inputs if t.requires_grad], dy.double())
    assert out.dtype == dtype and out.shape == (meta.num_tokens, w.shape[1])
    assert rel_err(out, ref) < TOL[dtype]
    for got, want, t in zip(grads, ref_grads, graded):
        assert got.dtype == t.dtype and got.shape == t.shape
        if t is row_weights:  # one dot per row: <dy of its token, its unweighted output row>
            y_rows = _unweighted_rows(meta, a.detach(), w.detach())
            assert row_dot_err(got, want, dy[meta.token_index_R], y_rows) < TOL[dtype], "d_row_weights"
        else:
            assert rel_err(got, want) < TOL[dtype]
    return out, dict(zip([id(t) for t in graded], grads))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,n,k", [(23, 37, 45), (1, 24, 20), (70, 40, 33)])
def test_matches_reference_and_gradients(dtype, num_tokens, n, k):
    meta, a, w, row_weights = _problem(dtype, num_tokens, n, k, seed=num_tokens)
    assert meta.slot_index_R.shape[0] > 0  # one token too: it has slots here
    out, grads = _check_against_reference(meta, a, w, row_weights, dtype)
    if num_tokens > 1:
        assert not out[0].any()  # the token with no slot here
    assert not grads[id(w)][1].any()  # the empty expert's dW


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_all_rows_on_one_expert(dtype):
    meta, a, w, row_weights = _problem(dtype, 13, 24, 20, seed=3, routing="one_expert")
    assert meta.counts_E.tolist() == [0, 0, 13 * TOP_K, 0]
    _, grads = _check_against_reference(meta, a, w, row_weights, dtype)
    assert not grads[id(w)][[0, 1, 3]].any()


@pytest.mark.parametrize("wants_grad", [(True, False, False), (False, False, True), (False, True, False),
                                        (True, True, False)], ids=["a", "row_weights", "w", "a+w"])
def test_gradients_of_some_inputs(wants_grad):
    meta, a, w, row_weights = _problem(torch.float32, 19, 24, 20, seed=7)
    _check_against_reference(meta, a, w, row_weights, torch.float32, wants_grad)


def test_half_row_weights_and_strided_inputs():
    """fp16 row weights get an fp16 gradient; a transposed ``a`` and row weights that are
    a strided view give the same results as contiguous copies."""
    meta, a, w, row_weights = _problem(torch.float16, 21, 24, 20, seed=11, weights_dtype=torch.float16)
    a_strided = a.t().contiguous().t()
    rw_strided = torch.stack([row_weights, torch.full_like(row_weights, 100.0)], dim=1)[:, 0]
    assert not a_strided.is_contiguous() and not rw_strided.is_contiguous()
    _check_against_reference(meta, a_strided, w, rw_strided, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_equals_the_unfused_path(dtype):
    """The same numbers as grouped_gemm with row weights followed by the slot-sum kernel."""
    meta, a, w, row_weights = _problem(dtype, 26, 40, 33, seed=13)
    dy = torch.randn(meta.num_tokens, w.shape[1], device=DEVICE, dtype=dtype)
    results = []
    for fused in (True, False):
        inputs = [t.detach().clone().requires_grad_() for t in (a, w, row_weights)]
        if fused:
            out = _slot_sum(meta, *inputs, dtype)
        else:
            rows = grouped_gemm(inputs[0], inputs[1], meta.counts_E, row_weights=inputs[2],
                                configs=configs_for(dtype), backend="triton")
            out = sum_slot_rows(rows, meta, backend="triton")
        results.append((out, *torch.autograd.grad(out, inputs, dy)))
    for fused, unfused in zip(*results):
        torch.testing.assert_close(fused, unfused, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)


def test_deferred_weight_grad_equals_direct():
    meta, a, w, row_weights = _problem(torch.float32, 29, 24, 20, seed=5)
    w.requires_grad_()
    out = _slot_sum(meta, a, w, row_weights, torch.float32)
    dy = torch.randn_like(out)
    (direct,) = torch.autograd.grad(out, w, dy, retain_graph=True)
    queue = DeferredWeightGrads([w])
    with defer_weight_grads(queue):
        out.backward(dy)
    assert w.grad is None and len(queue) == 1  # queued, not computed
    queue.run()
    torch.testing.assert_close(w.grad, direct)


def test_two_deferred_gemms_on_one_weight_add_up():
    """Two slot sums on the same weights (two chunks): their queued dWs sum into one grad."""
    first, a1, w, rw1 = _problem(torch.float32, 17, 24, 20, seed=21)
    second, a2, _, rw2 = _problem(torch.float32, 12, 24, 20, seed=22)
    w.requires_grad_()
    out = _slot_sum(first, a1, w, rw1, torch.float32).sum() + _slot_sum(second, a2, w, rw2, torch.float32).square().sum()
    (direct,) = torch.autograd.grad(out, w, retain_graph=True)
    queue = DeferredWeightGrads([w])
    with defer_weight_grads(queue):
        out.backward()
    assert w.grad is None and len(queue) == 2
    queue.run()
    torch.testing.assert_close(w.grad, direct, rtol=1e-5, atol=1e-6)
