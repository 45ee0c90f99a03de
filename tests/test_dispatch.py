"""Dispatch layout math (no group) and the all-to-all exchanges on gloo (2 and 4 ranks)."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from ep_moe.dispatch import (
    SplitSizes,
    combine_rows,
    dispatch_rows,
    exchange_counts,
    expert_major_order,
    group_size,
    split_sizes,
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


def test_split_sizes_sums_per_rank():
    splits = split_sizes(torch.tensor([1, 2, 3, 0]), torch.tensor([2, 0, 1, 1]), ep_size=2)
    assert splits == SplitSizes(send=[3, 3], recv=[2, 2])
    assert splits.num_recv == 4


def test_no_collective_without_group(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a collective ran at EP=1")

    monkeypatch.setattr(dist, "all_to_all_single", fail)
    counts_E = torch.tensor([2, 1])
    rows = torch.randn(3, 4, requires_grad=True)
    splits = split_sizes(counts_E, exchange_counts(counts_E, None), ep_size=1)
    assert group_size(None) == 1 and splits == SplitSizes(send=[3], recv=[3])
    out = combine_rows(dispatch_rows(rows, splits, None) * 2, splits, None)
    out.sum().backward()
    torch.testing.assert_close(out, rows * 2)
    torch.testing.assert_close(rows.grad, torch.full_like(rows, 2.0))


def _all_counts(world_size):
    """counts[p][E]: rows rank p sends to each global expert; rank 1 sends nothing."""
    gen = torch.Generator().manual_seed(world_size)
    counts = torch.randint(0, 4, (world_size, world_size * NUM_LOCAL), generator=gen)
    counts[1] = 0
    return counts


def _row_ids(counts_E, src):
    """Send buffer of rank ``src``: rows sorted by expert, id = 1000*src + 10*expert + i."""
    return torch.tensor([1000.0 * src + 10 * e + i for e in range(counts_E.numel()) for i in range(int(counts_E[e]))])


def _dispatch_worker(rank, world_size):
    counts_E = _all_counts(world_size)[rank]
    send_RH = _row_ids(counts_E, rank)[:, None].repeat(1, 3).requires_grad_()
    group = dist.group.WORLD
    recv_counts = exchange_counts(counts_E, group)
    splits = split_sizes(counts_E, recv_counts, world_size)
    recv_SH = dispatch_rows(send_RH, splits, group)
    order_S, m_sizes_e = expert_major_order(recv_counts, world_size, splits.num_recv)
    back_RH = combine_rows(recv_SH + 0.5, splits, group)
    (recv_SH * (2 * recv_SH.detach() + rank)).sum().backward()
    return dict(recv_counts=recv_counts, splits=splits, recv=recv_SH.detach(), order=order_S,
                m_sizes=m_sizes_e, back=back_RH.detach(), send=send_RH.detach(), grad=send_RH.grad)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_and_combine_on_gloo(world_size):
    counts = _all_counts(world_size)
    results = run_distributed(_dispatch_worker, world_size)
    for q, res in enumerate(results):
        mine = slice(q * NUM_LOCAL, (q + 1) * NUM_LOCAL)
        assert res["recv_counts"].tolist() == counts[:, mine].flatten().tolist()
        assert res["splits"].send == counts[q].view(world_size, NUM_LOCAL).sum(1).tolist()
        assert res["splits"].recv == counts[:, mine].sum(1).tolist()
        arrival = [1000.0 * p + 10 * e + i for p in range(world_size) for e in range(mine.start, mine.stop)
                   for i in range(int(counts[p, e]))]
        assert res["recv"][:, 0].tolist() == arrival
        expert_major = [1000.0 * p + 10 * e + i for e in range(mine.start, mine.stop) for p in range(world_size)
                        for i in range(int(counts[p, e]))]
        assert res["recv"][res["order"], 0].tolist() == expert_major
        assert res["m_sizes"].tolist() == counts[:, mine].sum(0).tolist()
        torch.testing.assert_close(res["back"], res["send"] + 0.5)
        dest_rank = torch.tensor([e // NUM_LOCAL for e in range(counts.shape[1]) for _ in range(int(counts[q, e]))])
        torch.testing.assert_close(res["grad"], 2 * res["send"] + dest_rank[:, None].float())
    assert results[1]["send"].shape[0] == 0
