"""Dispatch layout math (no group) and the all-to-all exchanges on gloo (2 and 4 ranks)."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from ep_moe.dispatch import (
    SplitSizes,
    counts_to_host,
    exchange_counts,
    group_size,
    start_combine,
    start_dispatch,
)

NUM_LOCAL = 2  # local experts per rank in the distributed tests


def test_counts_to_host_in_one_transfer():
    send = torch.tensor([[[3, 4], [0, 0]], [[1, 2], [5, 5]]])
    recv = torch.tensor([[[2, 2], [1, 3]], [[0, 0], [4, 8]]])
    assert counts_to_host(send, recv) == (send.tolist(), recv.tolist())


def test_no_collective_without_group(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a collective ran at EP=1")

    monkeypatch.setattr(dist, "all_to_all_single", fail)
    counts = torch.tensor([[[3, 5]]])
    assert exchange_counts(counts, None) is counts and group_size(None) == 1
    rows, splits = torch.randn(3, 4), SplitSizes(send=[3], recv=[3])
    assert start_combine(start_dispatch(rows, splits, None).wait(), splits, None).wait() is rows


def _all_counts(world_size, chunk):
    """counts[p][q]: rows rank p sends to rank q in ``chunk``; rank 1 sends nothing."""
    gen = torch.Generator().manual_seed(10 * world_size + chunk)
    counts = torch.randint(0, 4, (world_size, world_size), generator=gen)
    counts[1] = 0
    return counts


def _row_ids(counts_P, src):
    """Send buffer of rank ``src``: rows grouped by destination, id = 1000*src + 10*dest + i."""
    return torch.tensor([1000.0 * src + 10 * q + i for q in range(counts_P.numel()) for i in range(int(counts_P[q]))])


def _dispatch_worker(rank, world_size):
    """Two chunks: (rows, rows + 1) counts of both exchanged in one collective, rows
    dispatched (both in flight at once) and combined back."""
    rows_CP = torch.stack([_all_counts(world_size, c)[rank] for c in range(2)])
    counts_CPX = torch.stack([rows_CP, rows_CP + 1], dim=2)
    group = dist.group.WORLD
    send, recv = counts_to_host(counts_CPX, exchange_counts(counts_CPX, group))
    splits = [SplitSizes(send=[n for n, _ in send[c]], recv=[n for n, _ in recv[c]]) for c in range(2)]
    sends = [_row_ids(rows_CP[c], rank)[:, None].repeat(1, 3) for c in range(2)]
    pending = [start_dispatch(sends[c], splits[c], group) for c in range(2)]
    recvs = [p.wait() for p in pending]
    backs = [start_combine(r + 0.5, s, group).wait() for r, s in zip(recvs, splits)]
    return dict(recv_counts=recv, splits=splits, recv=recvs, back=backs, send=sends)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_and_combine_on_gloo(world_size):
    results = run_distributed(_dispatch_worker, world_size)
    for chunk in range(2):
        counts = _all_counts(world_size, chunk)
        for q, res in enumerate(results):
            assert res["recv_counts"][chunk] == [[int(counts[p, q]), int(counts[p, q]) + 1]
                                                 for p in range(world_size)]
            splits = res["splits"][chunk]
            assert splits.send == counts[q].tolist() and splits.recv == counts[:, q].tolist()
            arrival = [1000.0 * p + 10 * q + i for p in range(world_size) for i in range(int(counts[p, q]))]
            assert res["recv"][chunk][:, 0].tolist() == arrival
            torch.testing.assert_close(res["back"][chunk], res["send"][chunk] + 0.5)
    assert results[1]["send"][0].shape[0] == 0
