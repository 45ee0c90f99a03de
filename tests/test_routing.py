"""Router math and routing metadata against plain loops (no process group)."""

import math

import pytest
import torch

from ep_moe.routing import (
    build_rank_routing,
    build_routing_metadata,
    capacity_keep_mask,
    count_sorted,
    expert_capacity,
    rank_counts,
    route,
)

T, H, E = 13, 16, 8


def _inputs(seed=0, num_tokens=T):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, H, generator=gen), torch.randn(E, H, generator=gen)


def _loop_route(x_TH, w_EH, top_k, score_func, norm, bias_E=None):
    """Per-token reference: (ids, weights) lists."""
    ids, weights = [], []
    for x_H in x_TH:
        logits = [float(w_H @ x_H) for w_H in w_EH]
        if score_func == "softmax":
            denom = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / denom for v in logits]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        select = [s + (0.0 if bias_E is None else float(bias_E[e])) for e, s in enumerate(scores)]
        chosen = sorted(range(E), key=lambda e: -select[e])[:top_k]
        w = [scores[e] for e in chosen]
        if norm:
            w = [v / sum(w) for v in w]
        ids.append(chosen)
        weights.append(w)
    return ids, weights


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_loop(top_k, score_func, norm):
    x_TH, w_EH = _inputs(top_k)
    out = route(x_TH, w_EH, top_k=top_k, score_func=score_func, norm_topk_prob=norm)
    ids, weights = _loop_route(x_TH, w_EH, top_k, score_func, norm)
    assert out.topk_ids_TK.tolist() == ids
    torch.testing.assert_close(out.topk_weights_TK, torch.tensor(weights), atol=1e-6, rtol=1e-5)
    assert out.counts_E.tolist() == [sum(row.count(e) for row in ids) for e in range(E)]


def test_expert_bias_changes_selection_not_weights():
    x_TH, w_EH = _inputs(1)
    bias_E = torch.zeros(E)
    bias_E[5] = 10.0
    out = route(x_TH, w_EH, top_k=2, score_func="sigmoid", norm_topk_prob=False, expert_bias_E=bias_E)
    ids, weights = _loop_route(x_TH, w_EH, 2, "sigmoid", False, bias_E)
    assert (out.topk_ids_TK[:, 0] == 5).all()
    assert out.topk_ids_TK.tolist() == ids
    torch.testing.assert_close(out.topk_weights_TK, torch.tensor(weights), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_and_z_loss_formulas(score_func):
    x_TH, w_EH = _inputs(2)
    top_k, aux_coef, z_coef = 3, 0.1, 0.01
    out = route(x_TH, w_EH, top_k=top_k, score_func=score_func, aux_loss_coef=aux_coef, z_loss_coef=z_coef)
    ids, _ = _loop_route(x_TH, w_EH, top_k, score_func, True)
    logits = (x_TH.double() @ w_EH.double().t()).tolist()
    probs = []
    for row in logits:
        s = [math.exp(v) for v in row] if score_func == "softmax" else [1 / (1 + math.exp(-v)) for v in row]
        probs.append([v / sum(s) for v in s])
    aux = aux_coef * E * sum(
        (sum(r.count(e) for r in ids) / (T * top_k)) * (sum(p[e] for p in probs) / T) for e in range(E))
    z = z_coef * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / T
    assert out.aux_loss.item() == pytest.approx(aux, rel=1e-5)
    assert out.z_loss.item() == pytest.approx(z, rel=1e-5)


def _loop_losses(x_TH, w_EH, counts_E, top_k, score_func, aux_coef, z_coef):
    """Float64 aux and z losses token by token from their formulas, differentiable in x and
    the router weight; ``counts_E`` (the router's choice) is a constant, as in the layer."""
    num_tokens, num_experts = x_TH.shape[0], w_EH.shape[0]
    aux = z = torch.zeros((), dtype=torch.float64)
    for x_H in x_TH:
        logits_E = torch.stack([w_H @ x_H for w_H in w_EH])
        exp_E = logits_E.exp()
        scores_E = exp_E / exp_E.sum() if score_func == "softmax" else 1 / (1 + (-logits_E).exp())
        probs_E = scores_E / scores_E.sum()
        aux = aux + sum(float(counts_E[e]) / (num_tokens * top_k) * probs_E[e] for e in range(num_experts))
        z = z + exp_E.sum().log() ** 2
    return aux_coef * num_experts * aux / num_tokens, z_coef * z / num_tokens


@pytest.mark.parametrize("router_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_and_z_loss_gradients(score_func, router_dtype):
    """The gradients of each loss in x and the router weight, against the float64 loop:
    a loss cut off from the graph (detached probabilities) or scaled wrongly fails here."""
    x_TH, w_EH = _inputs(6)
    x_TH.requires_grad_()
    w_EH.requires_grad_()
    top_k, aux_coef, z_coef = 2, 0.3, 0.05
    out = route(x_TH, w_EH, top_k=top_k, score_func=score_func, aux_loss_coef=aux_coef, z_loss_coef=z_coef,
                router_dtype=router_dtype)
    x64, w64 = x_TH.detach().double().requires_grad_(), w_EH.detach().double().requires_grad_()
    aux_ref, z_ref = _loop_losses(x64, w64, out.counts_E, top_k, score_func, aux_coef, z_coef)
    for loss, ref in ((out.aux_loss, aux_ref), (out.z_loss, z_ref)):
        got = torch.autograd.grad(loss, (x_TH, w_EH), allow_unused=True, retain_graph=True)
        want = torch.autograd.grad(ref, (x64, w64), retain_graph=True)
        for g, w in zip(got, want):
            assert g is not None, "the loss has no gradient"
            torch.testing.assert_close(g.double(), w, atol=1e-7, rtol=1e-5)
            assert w.abs().max() > 1e-4  # a gradient worth checking


def test_uniform_routing_aux_loss_equals_coef():
    # Equal logits -> P_e = 1/E; top_k = E sends every token to every expert -> f_e = 1/E.
    out = route(torch.zeros(5, H), torch.zeros(E, H), top_k=E, aux_loss_coef=0.5)
    assert out.counts_E.tolist() == [5] * E
    assert out.aux_loss.item() == pytest.approx(0.5)


def test_losses_zero_without_tokens_or_coef():
    x_TH, w_EH = _inputs(3, num_tokens=0)
    out = route(x_TH, w_EH, top_k=2, aux_loss_coef=1.0, z_loss_coef=1.0)
    assert out.topk_ids_TK.shape == (0, 2) and out.counts_E.tolist() == [0] * E
    assert out.aux_loss.item() == 0 and out.z_loss.item() == 0
    x_TH, w_EH = _inputs(3)
    out = route(x_TH, w_EH, top_k=2)
    assert out.aux_loss.item() == 0 and out.z_loss.item() == 0


@pytest.mark.parametrize("case", ["random", "one_bin", "sentinels", "empty"])
def test_count_sorted_matches_bincount_without_the_sentinels(case):
    """Bin counts of sorted ids by binary search: ids past the bins (the sentinel of left-out
    slots) are not counted, empty bins are 0, whatever the skew."""
    gen = torch.Generator().manual_seed(3)
    ids = {"random": torch.randint(0, 7, (50,), generator=gen), "one_bin": torch.full((40,), 2),
           "sentinels": torch.cat([torch.randint(0, 7, (10,), generator=gen), torch.full((30,), 7)]),
           "empty": torch.zeros(0, dtype=torch.int64)}[case]
    want = torch.bincount(ids[ids < 7], minlength=7)
    for dtype in (torch.int64, torch.int32):
        got = count_sorted(ids.sort().values.to(dtype), 7)
        assert got.dtype == torch.int64 and got.tolist() == want.tolist()


def test_metadata_sorted_stably_by_expert():
    ids_TK = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    meta = build_routing_metadata(ids_TK, num_experts=5)
    assert meta.counts_E.tolist() == [2, 3, 1, 2, 0]
    # expert 0: slots 3 (t1,k1), 6 (t3,k0); expert 1: 1, 2, 7; expert 2: 5; expert 3: 0, 4
    assert meta.slot_index_R.tolist() == [3, 6, 1, 2, 7, 5, 0, 4]
    assert meta.token_index_R.tolist() == [1, 3, 0, 1, 3, 2, 0, 2]
    assert meta.dropless and meta.num_slots == 8


def test_metadata_with_drops_cuts_dropped_slots():
    ids_TK = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    keep_TK = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    meta = build_routing_metadata(ids_TK, num_experts=5, keep_TK=keep_TK)
    assert meta.counts_E.tolist() == [2, 2, 1, 1, 0]
    assert meta.slot_index_R.tolist() == [3, 6, 2, 7, 5, 0]
    assert not meta.dropless


def _loop_keep(ids_TK, scores_TK, capacity, policy):
    keep = [[False] * ids_TK.shape[1] for _ in range(ids_TK.shape[0])]
    for e in range(E):
        slots = [(t, k) for t in range(ids_TK.shape[0]) for k in range(ids_TK.shape[1]) if ids_TK[t, k] == e]
        if policy == "probs":
            slots.sort(key=lambda s: -float(scores_TK[s]))
        for t, k in slots[:capacity]:
            keep[t][k] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity", [0, 1, 3, 100])
def test_capacity_keep_mask_matches_loop(policy, capacity):
    x_TH, w_EH = _inputs(4)
    out = route(x_TH * 3, w_EH, top_k=2)
    keep_TK = capacity_keep_mask(out.topk_ids_TK, out.topk_scores_TK, num_experts=E,
                                 capacity=capacity, drop_policy=policy)
    assert keep_TK.tolist() == _loop_keep(out.topk_ids_TK, out.topk_scores_TK, capacity, policy)
    kept_per_expert = torch.bincount(out.topk_ids_TK[keep_TK], minlength=E)
    assert (kept_per_expert <= capacity).all()


def test_expert_capacity_formula():
    assert expert_capacity(1.0, 13, 2, 8) == 4  # ceil(26 / 8)
    assert expert_capacity(1.25, 16, 2, 8) == 5
    assert expert_capacity(0.5, 0, 2, 8) == 0


def test_row_of_slot_inverts_slot_index():
    gen = torch.Generator().manual_seed(5)
    ids_TK = torch.randint(0, E, (T, 3), generator=gen)
    keep_TK = torch.rand(T, 3, generator=gen) > 0.3
    for keep in (None, keep_TK):
        meta = build_routing_metadata(ids_TK, E, keep)
        rows = torch.arange(meta.slot_index_R.shape[0])
        assert torch.equal(meta.row_of_slot_N[meta.slot_index_R], rows)
        kept_N = torch.ones(T * 3, dtype=torch.bool) if keep is None else keep.flatten()
        assert torch.equal(meta.row_of_slot_N >= 0, kept_N)


@pytest.mark.parametrize("ep_size,dropped", [(2, False), (4, False), (4, True)])
def test_rank_routing_sends_each_token_once_per_rank(ep_size, dropped):
    gen = torch.Generator().manual_seed(ep_size)
    per_rank, top_k = E // ep_size, 3
    ids_TK = torch.rand(T, E, generator=gen).topk(top_k, dim=1).indices
    keep_TK = (torch.rand(T, top_k, generator=gen) > 0.4) if dropped else None
    kept = torch.ones(T, top_k, dtype=torch.bool) if keep_TK is None else keep_TK
    sends_TP, counts_P2 = rank_counts(ids_TK, keep_TK, per_rank, ep_size)
    rows = sends_TP.sum().item()
    padded = build_rank_routing(ids_TK, keep_TK, sends_TP, per_rank)  # before U is on the host
    assert padded.num_sent.item() == rows and padded.local_ids_UK.shape == (T * min(ep_size, top_k), top_k)
    r = padded.first_rows(rows)
    # Loop: for each destination rank, its tokens in order, with their local ids there.
    want_tokens, want_ids = [], []
    for p in range(ep_size):
        for t in range(T):
            here = [(int(e) - p * per_rank if int(e) // per_rank == p and kept[t, k] else -1)
                    for k, e in enumerate(ids_TK[t])]
            if any(i >= 0 for i in here):
                want_tokens.append(t)
                want_ids.append(here)
    assert r.pairs.token_index_R.tolist() == want_tokens
    assert r.local_ids_UK.tolist() == want_ids and r.local_ids_UK.dtype == torch.int32
    rank_of_row = [p for p in range(ep_size) for t in range(T) if sends_TP[t, p]]
    assert counts_P2[:, 0].tolist() == [rank_of_row.count(p) for p in range(ep_size)]
    assert counts_P2[:, 1].tolist() == [int(((ids_TK // per_rank == p) & kept).sum()) for p in range(ep_size)]
    for u, (t, p) in enumerate(zip(want_tokens, rank_of_row)):  # the slot sum finds each row
        assert r.pairs.row_of_slot_N[t * ep_size + p] == u
    assert (r.pairs.row_of_slot_N >= 0).sum() == rows
