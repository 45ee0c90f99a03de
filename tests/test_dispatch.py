"""Dispatch layout math (no group) and the all-to-all exchanges on gloo (2 and 4 ranks)."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from ep_moe.dispatch import (
    SplitSizes,
    exchange_counts,
    expert_major_order,
    group_size,
    split_sizes,
    start_combine,
    start_dispatch,
)

NUM_LOCAL = 2  # local experts per rank in the distributed tests


def test_expert_major_order_example():
    # 3 source ranks, 2 local experts: arrival rows [src0: e0 e1 e1 | src1: e1 | src2: e0 e0]
    recv_counts = torch.tensor([1, 2, 0, 1, 2, 0])
    order_S, m_sizes_e = expert_major_order(recv_counts, ep_size=3, num_rows=6)
    assert order_S.tolist() == [0, 4, 5, 1, 2, 3]
    assert m_sizes_e.tolist() == [3, 3]


@pytest.mark.parametrize("ep_size,num_local", [(1, 4), (2, 3), (4, 2)])
def test_expert_major_order_matches_loop(ep_size, num_local):
    recv_counts = torch.randint(0, 4, (ep_size * num_local,), generator=torch.Generator().manual_seed(ep_size))
    num_rows = int(recv_counts.sum())
    order_S, m_sizes_e = expert_major_order(recv_counts, ep_size, num_rows)
    starts = torch.cumsum(recv_counts, 0) - recv_counts
    expected = [int(starts[p * num_local + j]) + i
                for j in range(num_local) for p in range(ep_size)
                for i in range(int(recv_counts[p * num_local + j]))]
    assert order_S.tolist() == expected
    assert m_sizes_e.tolist() == recv_counts.view(ep_size, num_local).sum(0).tolist()


def test_split_sizes_sums_per_rank_for_each_chunk():
    counts_CE = torch.tensor([[1, 2, 3, 0], [0, 0, 5, 1]])
    recv_CE = torch.tensor([[2, 0, 1, 1], [0, 0, 0, 3]])
    splits = split_sizes(counts_CE, recv_CE, ep_size=2)
    assert splits == [SplitSizes(send=[3, 3], recv=[2, 2]), SplitSizes(send=[0, 6], recv=[0, 3])]
    assert splits[0].num_recv == 4


def test_no_collective_without_group(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a collective ran at EP=1")

    monkeypatch.setattr(dist, "all_to_all_single", fail)
    counts_CE = torch.tensor([[2, 1]])
    rows = torch.randn(3, 4)
    (splits,) = split_sizes(counts_CE, exchange_counts(counts_CE, None), ep_size=1)
    assert group_size(None) == 1 and splits == SplitSizes(send=[3], recv=[3])
    assert start_combine(start_dispatch(rows, splits, None).wait(), splits, None).wait() is rows


def _all_counts(world_size, chunk):
    """counts[p][E]: rows rank p sends to each global expert in ``chunk``; rank 1 sends nothing."""
    gen = torch.Generator().manual_seed(10 * world_size + chunk)
    counts = torch.randint(0, 4, (world_size, world_size * NUM_LOCAL), generator=gen)
    counts[1] = 0
    return counts


def _row_ids(counts_E, src):
    """Send buffer of rank ``src``: rows sorted by expert, id = 1000*src + 10*expert + i."""
    return torch.tensor([1000.0 * src + 10 * e + i for e in range(counts_E.numel()) for i in range(int(counts_E[e]))])


def _dispatch_worker(rank, world_size):
    """Two chunks: counts of both exchanged in one collective, rows dispatched (both in
    flight at once) and combined back."""
    counts_CE = torch.stack([_all_counts(world_size, c)[rank] for c in range(2)])
    group = dist.group.WORLD
    recv_counts_CE = exchange_counts(counts_CE, group)
    splits = split_sizes(counts_CE, recv_counts_CE, world_size)
    sends = [_row_ids(counts_CE[c], rank)[:, None].repeat(1, 3) for c in range(2)]
    pending = [start_dispatch(sends[c], splits[c], group) for c in range(2)]
    recvs = [p.wait() for p in pending]
    backs = [start_combine(recv + 0.5, s, group).wait() for recv, s in zip(recvs, splits)]
    orders = [expert_major_order(recv_counts_CE[c], world_size, splits[c].num_recv) for c in range(2)]
    return dict(recv_counts=recv_counts_CE, splits=splits, recv=recvs, order=orders, back=backs, send=sends)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_and_combine_on_gloo(world_size):
    results = run_distributed(_dispatch_worker, world_size)
    for chunk in range(2):
        counts = _all_counts(world_size, chunk)
        for q, res in enumerate(results):
            mine = slice(q * NUM_LOCAL, (q + 1) * NUM_LOCAL)
            splits, recv, (order, m_sizes) = res["splits"][chunk], res["recv"][chunk], res["order"][chunk]
            assert res["recv_counts"][chunk].tolist() == counts[:, mine].flatten().tolist()
            assert splits.send == counts[q].view(world_size, NUM_LOCAL).sum(1).tolist()
            assert splits.recv == counts[:, mine].sum(1).tolist()
            arrival = [1000.0 * p + 10 * e + i for p in range(world_size) for e in range(mine.start, mine.stop)
                       for i in range(int(counts[p, e]))]
            assert recv[:, 0].tolist() == arrival
            expert_major = [1000.0 * p + 10 * e + i for e in range(mine.start, mine.stop)
                            for p in range(world_size) for i in range(int(counts[p, e]))]
            assert recv[order, 0].tolist() == expert_major
            assert m_sizes.tolist() == counts[:, mine].sum(0).tolist()
            torch.testing.assert_close(res["back"][chunk], res["send"][chunk] + 0.5)
    assert results[1]["send"][0].shape[0] == 0
