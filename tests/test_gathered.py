"""The all-gather dispatch's routing (ep_moe.gathered) on its own; the layer's use of it is
tested against EP=1 in test_layer.py (gloo) and tests/gpu (NCCL)."""

import pytest
import torch

from ep_moe.gathered import gathered_routing, row_bound


def test_row_bound_is_the_worst_case_or_the_cap():
    assert row_bound(None, num_tokens=10, top_k=8, ep_size=4, num_local=32) == 4 * 10 * 8
    assert row_bound(None, num_tokens=10, top_k=8, ep_size=4, num_local=2) == 4 * 10 * 2  # K > e
    assert row_bound(1.5, num_tokens=10, top_k=8, ep_size=4, num_local=32) == 120
    assert row_bound(9.0, num_tokens=10, top_k=8, ep_size=4, num_local=32) == 320  # never above the worst


def _routing_case(seed: int):
    """[P*T, K] global ids over 12 experts, some slots dropped (-1); this rank holds 4..7."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(12, generator=gen)[:3] for _ in range(23)])
    ids[torch.rand(ids.shape, generator=gen) < 0.15] = -1
    return ids, 4, 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gathered_routing_takes_this_ranks_slots_in_expert_order(seed):
    ids, first, num_local = _routing_case(seed)
    mine = (ids >= first) & (ids < first + num_local)
    count = int(mine.sum())
    slots, dropped = gathered_routing(ids, first, num_local, max_rows=3 * 23)
    assert int(dropped) == 0
    assert slots.counts_E.tolist() == [int((ids == first + e).sum()) for e in range(num_local)]
    rows = slots.slot_index_R[:count]
    assert sorted(rows.tolist()) == mine.flatten().nonzero().flatten().tolist()
    experts = ids.flatten()[rows]
    assert torch.equal(experts, experts.sort(stable=True).values)  # by expert, then slot order
    assert torch.equal(slots.token_index_R[:count], rows // 3)
    assert (slots.token_index_R[count:] == 0).all()  # rows past the count read token 0
    assert torch.equal(slots.row_of_slot_N[rows], torch.arange(count))
    assert (slots.row_of_slot_N[~mine.flatten()] == -1).all()


def test_gathered_routing_drops_past_the_bound_and_counts_them():
    ids, first, num_local = _routing_case(3)
    full, _ = gathered_routing(ids, first, num_local, max_rows=3 * 23)
    count = int(full.counts_E.sum())
    cap = count - 5
    slots, dropped = gathered_routing(ids, first, num_local, max_rows=cap)
    assert int(dropped) == 5 and int(slots.counts_E.sum()) == cap
    assert slots.slot_index_R.shape[0] == cap
    ends = torch.cumsum(full.counts_E, 0).clamp(max=cap)
    assert torch.equal(torch.cumsum(slots.counts_E, 0), ends)  # the last experts lose their last slots
    kept = full.slot_index_R[:cap]
    assert torch.equal(slots.slot_index_R, kept)
    assert torch.equal(slots.row_of_slot_N[kept], torch.arange(cap))
    assert (slots.row_of_slot_N[full.slot_index_R[cap:count]] == -1).all()
