"""Dispatch layout math (no group) and the all-to-all exchanges on gloo (2 and 4 ranks)."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from ep_moe import dispatch
from ep_moe.dispatch import (
    NcclExchange,
    SplitSizes,
    chunk_splits,
    dispatch_packed,
    pack_rows,
    gather_counts,
    group_size,
    row_matrices,
    start_combine,
    start_dispatch,
)

NUM_LOCAL = 2  # local experts per rank in the distributed tests


def test_count_lists_give_splits_and_matrices():
    # counts[q][c][p] = [rows, slots] rank q sends rank p in chunk c: 2 ranks, 2 chunks
    counts = [[[[3, 4], [0, 0]], [[1, 2], [5, 5]]],
              [[[2, 2], [1, 3]], [[0, 0], [4, 8]]]]
    assert chunk_splits(counts, 0, 0) == SplitSizes(send=[3, 0], recv=[3, 2])
    assert chunk_splits(counts, 1, 1) == SplitSizes(send=[0, 4], recv=[5, 4])
    assert row_matrices(counts) == [[[3, 0], [2, 1]], [[1, 5], [0, 4]]]


def test_no_collective_without_group(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a collective ran at EP=1")

    monkeypatch.setattr(dist, "all_to_all_single", fail)
    monkeypatch.setattr(dispatch, "all_gather_single", fail)
    counts = torch.tensor([[[3, 5]]])
    assert gather_counts(counts, None) == [counts.tolist()] and group_size(None) == 1
    rows, splits = torch.randn(3, 4), SplitSizes(send=[3], recv=[3])
    assert start_combine(start_dispatch(rows, splits, None).wait(), splits, None).wait() is rows
    exchange = NcclExchange(None, [splits])
    assert exchange.combine(exchange.dispatch(rows, 0, "rows").wait(), 0, "rows").wait() is rows


def test_packed_rows_unpack_as_views():
    """Parts of odd byte widths (int16 x 3 = 6 bytes) are padded so each unpacks as a view."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(-5, 5, (7, 3), generator=gen, dtype=torch.int16)
    weights = torch.randn(7, 2, 2, generator=gen, dtype=torch.float64)
    flags = torch.rand(7, 1, generator=gen) > 0.5
    packed = pack_rows([ids, weights, flags])
    assert packed.data.dtype == torch.uint8 and packed.data.shape == (7, 8 + 32 + 8)
    for cut in (packed, packed.first_rows(4), packed.first_rows(0)):
        got = cut.unpack()
        rows = cut.data.shape[0]
        for part, want in zip(got, (ids, weights, flags)):
            assert part.dtype == want.dtype and torch.equal(part, want[:rows])
            assert part.untyped_storage().data_ptr() == cut.data.untyped_storage().data_ptr()


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
    """Two chunks: (rows, rows + 1) counts of both gathered in one collective, rows
    dispatched (both in flight at once) and combined back."""
    rows_CP = torch.stack([_all_counts(world_size, c)[rank] for c in range(2)])
    counts_CPX = torch.stack([rows_CP, rows_CP + 1], dim=2)
    group = dist.group.WORLD
    counts = gather_counts(counts_CPX, group)
    splits = [chunk_splits(counts, rank, c) for c in range(2)]
    exchange = NcclExchange(group, splits)
    sends = [_row_ids(rows_CP[c], rank)[:, None].repeat(1, 3) for c in range(2)]
    pending = [exchange.dispatch(sends[c], c, "rows") for c in range(2)]
    recvs = [p.wait() for p in pending]
    backs = [exchange.combine(r + 0.5, c, "rows").wait() for c, r in enumerate(recvs)]
    # two messages of other dtypes in one exchange
    ids = sends[0][:, :2].to(torch.int32) + 1
    weights = sends[0][:, :3].double()
    got_ids, got_weights = dispatch_packed(pack_rows([ids, weights]), splits[0], group)
    return dict(counts=counts, splits=splits, recv=recvs, back=backs, send=sends,
                packed=(got_ids.clone(), got_weights.clone()))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_and_combine_on_gloo(world_size):
    results = run_distributed(_dispatch_worker, world_size)
    for chunk in range(2):
        counts = _all_counts(world_size, chunk)
        for q, res in enumerate(results):
            assert res["counts"][q][chunk] == [[int(counts[q, p]), int(counts[q, p]) + 1]
                                               for p in range(world_size)]
            assert res["counts"] == results[0]["counts"]
            splits = res["splits"][chunk]
            assert splits.send == counts[q].tolist() and splits.recv == counts[:, q].tolist()
            arrival = [1000.0 * p + 10 * q + i for p in range(world_size) for i in range(int(counts[p, q]))]
            assert res["recv"][chunk][:, 0].tolist() == arrival
            torch.testing.assert_close(res["back"][chunk], res["send"][chunk] + 0.5)
            if chunk == 0:
                got_ids, got_weights = res["packed"]
                assert got_ids.dtype == torch.int32 and got_ids[:, 1].tolist() == [v + 1 for v in arrival]
                assert got_weights.dtype == torch.float64 and got_weights[:, 2].tolist() == arrival
    assert results[1]["send"][0].shape[0] == 0
