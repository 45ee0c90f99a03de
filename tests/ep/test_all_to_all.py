"""Dispatch layout math (no group) and the all-to-all exchanges on gloo (2 and 4 ranks)."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from ep_moe.distributed import group_size
from ep_moe.ep import all_to_all as dispatch
from ep_moe.ep.all_to_all import (
    NcclExchange,
    SplitSizes,
    dispatch_packed,
    exchange_rows,
    gather_counts,
    pack_rows,
    rank_splits,
    start_combine,
    start_dispatch,
    start_gather_counts,
)

NUM_LOCAL = 2  # local experts per rank in the distributed tests


def test_count_lists_give_splits():
    # counts[q][p] = [rows, slots] rank q sends rank p: 3 ranks
    counts = [[[3, 4], [0, 0], [2, 2]],
              [[1, 3], [5, 5], [0, 0]],
              [[0, 0], [4, 8], [6, 7]]]
    assert rank_splits(counts, 0) == SplitSizes(send=[3, 0, 2], recv=[3, 1, 0])
    assert rank_splits(counts, 1) == SplitSizes(send=[1, 5, 0], recv=[0, 5, 4])
    assert rank_splits(counts, 2) == SplitSizes(send=[0, 4, 6], recv=[2, 0, 6])
    assert rank_splits(counts, 2).num_recv == 8


def test_no_collective_without_group(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a collective ran at EP=1")

    monkeypatch.setattr(dist, "all_to_all_single", fail)
    monkeypatch.setattr(dispatch, "all_gather_single", fail)
    counts = torch.tensor([[3, 5]])
    assert gather_counts(counts, None) == [counts.tolist()] and group_size(None) == 1
    rows, splits = torch.randn(3, 4), SplitSizes(send=[3], recv=[3])
    assert start_combine(start_dispatch(rows, splits, None).wait(), splits, None).wait() is rows
    exchange = NcclExchange(None, splits)
    assert exchange.combine(exchange.dispatch(rows, "rows").wait(), "rows").wait() is rows


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


def _all_counts(world_size):
    """counts[p][q]: rows rank p sends to rank q; rank 1 sends nothing."""
    gen = torch.Generator().manual_seed(10 * world_size)
    counts = torch.randint(0, 4, (world_size, world_size), generator=gen)
    counts[1] = 0
    return counts


def _row_ids(counts_P, src):
    """Send buffer of rank ``src``: rows grouped by destination, id = 1000*src + 10*dest + i."""
    return torch.tensor([1000.0 * src + 10 * q + i for q in range(counts_P.numel()) for i in range(int(counts_P[q]))])


def _dispatch_worker(rank, world_size):
    """(rows, rows + 1) counts gathered in one collective; rows and a second message of
    another dtype dispatched (both in flight at once), the rows combined back."""
    rows_P = _all_counts(world_size)[rank]
    counts_PX = torch.stack([rows_P, rows_P + 1], dim=1)
    group = dist.group.WORLD
    counts = gather_counts(counts_PX, group)
    splits = rank_splits(counts, rank)
    exchange = NcclExchange(group, splits)
    send = _row_ids(rows_P, rank)[:, None].repeat(1, 3)
    pending = [exchange.dispatch(send, "rows"), exchange.dispatch(-send[:, :2].double(), "weights")]
    recv, recv_weights = [p.wait() for p in pending]
    back = exchange.combine(recv + 0.5, "rows").wait()
    # two messages of other dtypes in one exchange
    ids = send[:, :2].to(torch.int32) + 1
    weights = send[:, :3].double()
    got_ids, got_weights = dispatch_packed(pack_rows([ids, weights]), splits, group)
    # more columns than the host reads: the rest stay with the gathered tensor
    pending = start_gather_counts(torch.cat([counts_PX, 7 * counts_PX], dim=1), group, host_columns=2)
    host_counts, gathered = pending.result(), pending.gathered.clone()
    # rows there and back, differentiable: the gradient comes back the way the rows went
    rows = send.clone().requires_grad_()
    there = exchange_rows(rows, splits.recv, splits.send, group)
    back_again = exchange_rows(there * 2, splits.send, splits.recv, group)
    (back_again * send).sum().backward()
    return dict(counts=counts, splits=splits, recv=recv, recv_weights=recv_weights, back=back, send=send,
                packed=(got_ids.clone(), got_weights.clone()), host_counts=host_counts, gathered=gathered,
                there=there.detach(), back_again=back_again.detach(), rows_grad=rows.grad)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_and_combine_on_gloo(world_size):
    results = run_distributed(_dispatch_worker, world_size)
    counts = _all_counts(world_size)
    for q, res in enumerate(results):
        assert res["counts"][q] == [[int(counts[q, p]), int(counts[q, p]) + 1] for p in range(world_size)]
        assert res["counts"] == results[0]["counts"]
        splits = res["splits"]
        assert splits.send == counts[q].tolist() and splits.recv == counts[:, q].tolist()
        arrival = [1000.0 * p + 10 * q + i for p in range(world_size) for i in range(int(counts[p, q]))]
        assert res["recv"][:, 0].tolist() == arrival and res["recv"].shape[1] == 3
        assert res["recv_weights"].dtype == torch.float64
        assert res["recv_weights"][:, 1].tolist() == [-v for v in arrival]
        torch.testing.assert_close(res["back"], res["send"] + 0.5)
        got_ids, got_weights = res["packed"]
        assert got_ids.dtype == torch.int32 and got_ids[:, 1].tolist() == [v + 1 for v in arrival]
        assert got_weights.dtype == torch.float64 and got_weights[:, 2].tolist() == arrival
        assert res["host_counts"] == res["counts"]
        assert res["gathered"].shape == (world_size, world_size, 4)
        assert torch.equal(res["gathered"][..., 2:], 7 * res["gathered"][..., :2])
        assert res["gathered"][..., :2].tolist() == res["counts"]
        assert torch.equal(res["there"], res["recv"])
        torch.testing.assert_close(res["back_again"], 2 * res["send"])
        torch.testing.assert_close(res["rows_grad"], 2 * res["send"])  # d/drows sum(2 rows * send)
    assert results[1]["send"].shape[0] == 0
