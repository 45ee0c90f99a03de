"""The slot-row format's tensor math (ep_moe.ep.slot_rows) against plain loops: the vote, the
counts row, the receiver's expert order, the sender's weighted slot sum. The format end to
end at EP=2/4 is in tests/ep/test_layer_ep.py."""

import pytest
import torch

from ep_moe import grouped_mm_experts
from ep_moe.ep.slot_rows import (
    EXPERT_COUNTS,
    SLOT_ROWS_MAX_SLOTS,
    VOTE,
    arrived_expert_order,
    combine_slot_rows,
    slot_counts,
    sort_slot_rows,
    wants_slot_rows,
)
from ep_moe.routing import RouterOutput, count_ids


@pytest.mark.parametrize("grad", [True, False])
def test_vote_up_to_the_slot_limit_where_the_small_call_path_runs(monkeypatch, grad):
    x = torch.randn(4, 8)
    monkeypatch.setattr(grouped_mm_experts, "_eager_bf16_where_it_runs", lambda x: True)
    with torch.set_grad_enabled(grad):
        assert wants_slot_rows(x, 0) and wants_slot_rows(x, SLOT_ROWS_MAX_SLOTS)
        assert not wants_slot_rows(x, SLOT_ROWS_MAX_SLOTS + 1)
    monkeypatch.setattr(grouped_mm_experts, "_eager_bf16_where_it_runs", lambda x: False)
    assert not wants_slot_rows(x, 1)


def _router(ids_TK: torch.Tensor, num_experts: int) -> RouterOutput:
    weights = torch.rand(ids_TK.shape, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    return RouterOutput(ids_TK, weights, weights, count_ids(ids_TK.flatten(), num_experts), zero, zero)


def test_counts_carry_the_vote_and_the_kept_slots_per_expert():
    ids_TK = torch.tensor([[0, 3], [3, 2], [1, 3]])  # 4 experts on 2 ranks
    keep_TK = torch.tensor([[True, True], [False, True], [True, True]])
    counts_P2 = torch.tensor([[9, 8], [7, 6]])
    slots = sort_slot_rows(torch.randn(3, 5), _router(ids_TK, 4), keep_TK, 4)
    counts = slot_counts(counts_P2, slots, 2)
    assert counts.tolist() == [[9, 8, 1, 1, 1], [7, 6, 1, 1, 2]]  # expert 3's dropped slot not counted
    assert counts[:, EXPERT_COUNTS:].sum() == keep_TK.sum() and VOTE == 2
    assert slot_counts(counts_P2, None, 2).tolist() == [[9, 8, 0, 0, 0], [7, 6, 0, 0, 0]]


def test_sorted_slot_rows_are_each_slots_token_in_expert_order():
    gen = torch.Generator().manual_seed(0)
    ids_TK = torch.randint(0, 6, (7, 3), generator=gen)
    x = torch.randn(7, 5, generator=gen)
    slots = sort_slot_rows(x, _router(ids_TK, 6), None, 6)
    order = sorted(range(21), key=lambda n: (int(ids_TK.flatten()[n]), n))  # stable by expert
    assert slots.meta.slot_index_R.tolist() == order
    assert torch.equal(slots.rows_NH, x[[n // 3 for n in order]])


def test_arrived_rows_in_expert_order():
    counts_Pe = torch.tensor([[2, 0, 1], [1, 3, 0]])  # source 0: e0 e0 e2; source 1: e0 e1 e1 e1
    m_sizes_e, order_S = arrived_expert_order(counts_Pe, 7)
    assert m_sizes_e.tolist() == [3, 3, 1]
    assert order_S.tolist() == [0, 1, 3, 4, 5, 6, 2]
    m_sizes_e, order_S = arrived_expert_order(torch.zeros(2, 3, dtype=torch.int64), 0)
    assert m_sizes_e.tolist() == [0, 0, 0] and order_S.numel() == 0


@pytest.mark.parametrize("drops", [False, True])
def test_returned_rows_weighted_and_summed_per_token(drops):
    gen = torch.Generator().manual_seed(1)
    num_tokens, top_k, hidden = 5, 3, 4
    ids_TK = torch.randint(0, 4, (num_tokens, top_k), generator=gen)
    keep_TK = torch.rand(num_tokens, top_k, generator=gen) > 0.3 if drops else None
    router = _router(ids_TK, 4)
    slots = sort_slot_rows(torch.randn(num_tokens, hidden, dtype=torch.float64), router, keep_TK, 4)
    num_kept = num_tokens * top_k if keep_TK is None else int(keep_TK.sum())
    meta = slots.meta.first_rows(num_kept)
    back = torch.randn(num_kept, hidden, dtype=torch.float64, generator=gen)  # the experts' rows, slot order of meta
    got = combine_slot_rows(back, meta, router.topk_weights_TK)
    want = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for row, slot in enumerate(meta.slot_index_R.tolist()):
        want[slot // top_k] += router.topk_weights_TK.flatten()[slot] * back[row]
    torch.testing.assert_close(got, want)
