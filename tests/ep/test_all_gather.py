"""The all-gather dispatch's routing and collectives (ep_moe.gathered) on their own; the
layer's use of them is tested against EP=1 in test_layer_ep.py (gloo) and tests/gpu (NCCL)."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from ep_moe.ep.all_gather import GatherExchange, gathered_routing, row_bound


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


@pytest.mark.parametrize("cap", [None, 30])
@pytest.mark.parametrize("first_source", [0, 1, 3])
def test_gathered_routing_puts_each_experts_rows_in_landing_order(first_source, cap):
    """Rows of each expert sorted by source rank from ``first_source`` on (wrapping), then
    by slot; ``source_ends_ES`` counts them per (expert, first w+1 sources), clamped to the
    kept rows; the routing is otherwise that of the rank-major order (same rows per expert)."""
    gen = torch.Generator().manual_seed(first_source)
    sources, tokens, top_k = 4, 9, 3
    ids = torch.stack([torch.randperm(12, generator=gen)[:top_k] for _ in range(sources * tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.15] = -1
    first, num_local = 4, 4
    max_rows = cap or sources * tokens * top_k
    plain, _ = gathered_routing(ids, first, num_local, max_rows)
    slots, dropped = gathered_routing(ids, first, num_local, max_rows, num_sources=sources,
                                      first_source=first_source)
    assert torch.equal(slots.counts_E, plain.counts_E) and int(dropped) == int(_)
    count = int(slots.counts_E.sum())
    rows = slots.slot_index_R[:count]
    landing = (rows // (tokens * top_k) - first_source) % sources
    experts = ids.flatten()[rows]
    key = (experts * sources + landing) * ids.numel() + rows
    assert torch.equal(key, key.sort().values)  # by expert, landing source, slot
    assert torch.equal(slots.row_of_slot_N[rows], torch.arange(count))
    assert torch.equal(slots.token_index_R[:count], rows // top_k)
    ends, start = [], 0
    for e, n in enumerate(slots.counts_E.tolist()):
        per_source = torch.bincount(landing[start: start + n], minlength=sources)
        ends.append(per_source.cumsum(0))
        start += n
    assert torch.equal(slots.source_ends_ES, torch.stack(ends).to(torch.int32))
    assert torch.equal(slots.source_ends_ES[:, -1], slots.counts_E.to(torch.int32))
    # without the per-source counts (NCCL's all-gather): the same routing, rows and drops
    bare, bare_dropped = gathered_routing(ids, first, num_local, max_rows, num_sources=sources,
                                          first_source=first_source, source_ends=False)
    assert bare.source_ends_ES is None and int(bare_dropped) == int(dropped)
    for field in ("counts_E", "slot_index_R", "token_index_R", "row_of_slot_N"):
        assert torch.equal(getattr(bare, field), getattr(slots, field)), field


def _exchange_worker(rank: int, world_size: int) -> dict:
    exchange = GatherExchange(dist.group.WORLD)
    rows = torch.arange(6.0).view(3, 2) + 10 * rank  # [T=3, 2], rank-specific
    rows.requires_grad_()  # an autograd input: the exchange sends its data only
    gathered = exchange.dispatch(rows, "rows")
    partial = torch.arange(3.0 * world_size).view(-1, 1).repeat(1, 2) * (rank + 1)  # [P*T, 2]
    summed = exchange.combine(partial, "rows")  # both in flight at once
    return dict(gathered=gathered.wait(), summed=summed.wait())


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_exchange_all_gathers_and_reduce_scatters_rows(world_size):
    results = run_distributed(_exchange_worker, world_size)
    every = torch.cat([torch.arange(6.0).view(3, 2) + 10 * r for r in range(world_size)])
    scale = sum(r + 1 for r in range(world_size))
    for rank, res in enumerate(results):
        assert torch.equal(res["gathered"], every)  # rank-major [P*T, 2]
        assert not res["gathered"].requires_grad
        want = torch.arange(3.0 * rank, 3.0 * rank + 3).view(-1, 1).repeat(1, 2) * scale
        assert torch.equal(res["summed"], want)  # this rank's T rows, summed over the group
