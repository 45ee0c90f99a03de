"""The copy-engine all-gather's flag protocols, on the CPU: P ranks as threads over plain
buffers (a workspace double whose stream operations run at once, a flag wait blocking the
thread), so where each rank stages and pulls from, and how the flags move, is checked
without GPUs. The layer on top of it runs in tests/ep/test_layer_ep.py (gloo, file workspaces);
the real symmetric-memory path in tests/gpu/test_ep_nccl.py."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from ep_moe.ep.copy_engine import CopyEngineGather
from ep_moe.ep.copy_engine import workspace as copy_engine
from ep_moe.kernels.arrival import take_departure
from workspace_doubles import HostWorkspace


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers = [torch.zeros(0, dtype=torch.uint8) for _ in range(size)]
        self.changed = threading.Condition()
        self.barrier = threading.Barrier(size, timeout=30)  # a failing rank breaks it: no hang
        self.before_pull = lambda rank, source: None  # a hook: e.g. slow down one rank's pulls
        self.before_inbox_read = lambda rank: None  # a hook: e.g. slow down one rank's reading of its inbox


class _ThreadWorkspace(HostWorkspace):
    """A workspace over ``_World``'s buffers: a flag write is immediate, and a flag wait
    blocks the thread."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.size, self.capacity = world, rank, world.size, 0
        self.stream, self._buffers, self._allocation, self._captured, self._retired = None, [], None, False, []

    def _allocate(self, nbytes: int) -> list[torch.Tensor]:
        self.world.buffers[self.rank] = torch.full((nbytes,), 255, dtype=torch.uint8)  # garbage
        self.world.barrier.wait()  # collective: every buffer exists before anyone uses it
        return self.world.buffers

    def _quiesce(self) -> None:
        self.world.barrier.wait()

    def _signal(self, stream, rank, index, value):
        with self.world.changed:
            self.flag(rank, index)[0] = value
            self.world.changed.notify_all()

    def _await(self, stream, index, value, equal):
        word = self.flag(self.rank, index)
        with self.world.changed:
            if not self.world.changed.wait_for(lambda: word.item() == value or (not equal and word.item() > value),
                                               timeout=30):
                raise TimeoutError(f"rank {self.rank} waited for flag {index} {'==' if equal else '>='} {value}")
        if copy_engine._STAGED <= index < copy_engine._STAGED + copy_engine._MAX_RANKS:
            self.world.before_pull(self.rank, index - copy_engine._STAGED)

    def await_inbox(self) -> None:
        super().await_inbox()
        self.world.before_inbox_read(self.rank)


def _run_ranks(size: int, fn, world: _World = None) -> list:
    """``fn(rank, workspace)`` on ``size`` threads; results in rank order, errors re-raised."""
    world = world or _World(size)
    results, errors = [None] * size, []

    def target(rank):
        try:
            results[rank] = fn(rank, _ThreadWorkspace(world, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _flag_words(workspace) -> torch.Tensor:
    """The handshake flags of ``workspace``'s rank (staged, free, arrived, inbox free), a copy."""
    return workspace.world.buffers[workspace.rank][4 * copy_engine._STAGED: 4 * copy_engine._LANDED].view(
        torch.int32).clone()


@pytest.mark.parametrize("size,rows", [(2, 5), (4, 3)])
def test_gather_and_reduce_scatter_leave_the_flags_as_they_found_them(size, rows, fake_groups):
    """Rounds of a layer call's copy-engine exchanges (the forward's all-gather of the rows
    and reduce-scatter of their sums, the backward's all-gather of the output gradients),
    repeated on the same regions: each rank gets every rank's rows in rank order (its
    landing flag ends at P-1) and the sum of every rank's partial sums of its tokens, sent
    source by source (as the down projection does) in even rounds and whole in odd ones;
    after each round the handshake flags are back where they started, as a CUDA graph's
    replay needs."""

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(size), workspace, rows, 3 * 4)
        start = _flag_words(workspace)
        workspace.world.barrier.wait()  # before any peer signals
        got, summed, grads, flags_after = [], [], [], []
        for rnd in range(4):
            pending = exchange.dispatch(_gather_rows(rank, 0, rnd, rows), "rows")
            got.append(pending.wait())
            assert int(pending.landing.flag.item()) == size - 1 and pending.landing.num_sources == size
            assert pending.landing.base == 0
            partial = _partial_sums(rank, 0, rnd, size, rows)
            with exchange.departing(partial):
                departure = take_departure() if rnd % 2 == 0 else None
                if departure is not None:  # what grouped_gemm_slot_sum does with it
                    assert departure.order == tuple(range(1, size)) + (0,)  # the peers' sums first
                    for position in departure.order:
                        departure.out[departure.tokens(position)] = partial[departure.tokens(position)]
                        departure.send(position)
            summed.append(exchange.combine(partial if departure is None else departure.out, "rows").wait())
            grads.append(exchange.dispatch(_gather_rows(rank, 1, rnd, rows), "rows").wait())  # the backward's
            workspace.world.barrier.wait()  # every rank done pulling and summing
            flags_after.append(_flag_words(workspace))
            workspace.world.barrier.wait()  # before any peer's next round signals
        return start, got, summed, grads, flags_after

    for me, (start, got, summed, grads, flags_after) in enumerate(_run_ranks(size, rank_fn)):
        assert int(start.sum()) == 2 * copy_engine._MAX_RANKS  # every region and inbox free
        for rnd in range(4):
            assert torch.equal(got[rnd], torch.cat([_gather_rows(q, 0, rnd, rows) for q in range(size)])), rnd
            assert torch.equal(grads[rnd], torch.cat([_gather_rows(q, 1, rnd, rows) for q in range(size)])), rnd
            want = sum(_partial_sums(q, 0, rnd, size, rows)[me * rows: (me + 1) * rows] for q in range(size))
            assert torch.equal(summed[rnd], want), rnd
        for flags in flags_after:
            assert torch.equal(flags, start)


def test_combine_refuses_an_output_other_than_the_sums_sent(fake_groups):
    """Sums sent source by source from inside the down projection: combining anything else
    (an expert function that changed the output after the GEMM) is an error, not a silent
    reduce of the unchanged sums."""

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(1), workspace, 4, 3 * 4)
        partial = _partial_sums(rank, 0, 0, 1, 4)
        with exchange.departing(partial):
            departure = take_departure()
            departure.out.copy_(partial)
            departure.send(0)
        with pytest.raises(RuntimeError, match="output as it is"):
            exchange.combine(2 * departure.out, "rows")
        return True

    assert _run_ranks(1, rank_fn) == [True]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("source_by_source", [True, False], ids=["departing", "whole"])
def test_combine_returns_the_rows_dtype_under_autocast(monkeypatch, fake_groups, dtype, source_by_source):
    """CUDA's autocast runs ``torch.sum`` in fp32 (emulated here: the CPU's does not): the
    forward's sums still come back in the rows' dtype, summed in fp32, so the backward's
    output gradients land in that dtype too."""
    size, rows = 4, 3
    plain_sum = torch.sum

    def autocast_sum(*args, dtype=None, **kwargs):
        return plain_sum(*args, dtype=torch.float32 if dtype is None else dtype, **kwargs)

    monkeypatch.setattr(torch, "sum", autocast_sum)

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(size), workspace, rows, 3 * dtype.itemsize)
        partial = _partial_sums(rank, 0, 0, size, rows).to(dtype)
        with torch.autocast("cpu", dtype=dtype):
            with exchange.departing(partial):
                departure = take_departure() if source_by_source else None
                if departure is not None:
                    for position in departure.order:
                        departure.out[departure.tokens(position)] = partial[departure.tokens(position)]
                        departure.send(position)
            return exchange.combine(partial if departure is None else departure.out, "rows").wait()

    for me, summed in enumerate(_run_ranks(size, rank_fn)):
        want = sum(_partial_sums(q, 0, 0, size, rows)[me * rows: (me + 1) * rows] for q in range(size))
        assert summed.dtype == dtype and torch.equal(summed, want.to(dtype))


def _partial_sums(rank: int, message: int, rnd: int, size: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s partial sums for every rank's ``n`` tokens (small integers: exact sums)."""
    gen = torch.Generator().manual_seed(1000 * rnd + 100 * message + rank)
    return torch.randint(-8, 8, (size * n, 3), generator=gen).float()


class _FakeGroup:
    """Stands in for the process group: only its size is read (through the patched
    ``dist.get_world_size`` of the ``fake_groups`` fixture), no collective runs."""

    def __init__(self, size: int) -> None:
        self.size = size


@pytest.fixture
def fake_groups(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group.size)


def _gather_rows(rank: int, message: int, rnd: int, n: int) -> torch.Tensor:
    return (1000.0 * rnd + 100 * rank + 10 * message + torch.arange(n, dtype=torch.float32))[:, None].repeat(1, 3)


def test_gather_restages_a_region_only_after_every_peer_pulled_it(fake_groups):
    """Rank 1 pulls late: rank 0's next dispatch must wait for it rather than overwrite the
    rows rank 1 has not copied yet."""
    world = _World(2)
    world.before_pull = lambda rank, source: time.sleep(0.3) if rank == 1 else None

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(2), workspace, 4, 3 * 4)
        return [exchange.dispatch(_gather_rows(rank, 0, rnd, 4), "rows").wait() for rnd in range(3)]

    results = _run_ranks(2, rank_fn, world)
    for got in results:
        for rnd, out in enumerate(got):
            assert torch.equal(out, torch.cat([_gather_rows(q, 0, rnd, 4) for q in range(2)])), rnd


def test_gather_without_landing_hands_the_rows_over_whole(fake_groups):
    """``landing=False`` (the reference GEMMs, which cannot wait source by source): the same
    rows and handshake, but the exchange gives them only after the whole transfer."""

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(2), workspace, 4, 3 * 4, landing=False)
        start = _flag_words(workspace)
        workspace.world.barrier.wait()  # before any peer signals
        got = []
        for rnd in range(2):
            pending = exchange.dispatch(_gather_rows(rank, 0, rnd, 4), "rows")
            assert pending.landing is None
            with pytest.raises(RuntimeError, match="do not land source by source"):
                pending.landing_rows()
            got.append(pending.wait())
        workspace.world.barrier.wait()  # every rank done pulling
        return got, torch.equal(_flag_words(workspace), start)

    for got, flags_at_rest in _run_ranks(2, rank_fn):
        assert flags_at_rest
        for rnd, out in enumerate(got):
            assert torch.equal(out, torch.cat([_gather_rows(q, 0, rnd, 4) for q in range(2)])), rnd


def test_reduce_scatter_pushes_only_after_the_receiver_read_its_inbox(fake_groups):
    """Rank 1 reads its inbox late: rank 0's next push into it must wait for it rather than
    overwrite the sums rank 1 has not added yet."""
    world = _World(2)
    world.before_inbox_read = lambda rank: time.sleep(0.3) if rank == 1 else None

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(2), workspace, 4, 3 * 4)
        summed = []
        for rnd in range(3):
            partial = _partial_sums(rank, 0, rnd, 2, 4)
            with exchange.departing(partial):
                pass  # no GEMM sent them: the combine sends the finished sums
            summed.append(exchange.combine(partial, "rows").wait())
        return summed

    for me, summed in enumerate(_run_ranks(2, rank_fn, world)):
        for rnd, got in enumerate(summed):
            assert torch.equal(got, sum(_partial_sums(q, 0, rnd, 2, 4)[me * 4: (me + 1) * 4] for q in range(2))), rnd


@pytest.mark.parametrize("captured", [True, False], ids=["captured", "eager"])
def test_growing_keeps_the_buffers_a_captured_graph_replays_into(captured):
    """A CUDA graph holds the workspace's addresses: growing after a capture keeps the old
    buffers alive (every rank's view of them), and without one lets them go."""
    def rank_fn(rank, workspace):
        workspace.reserve(1000)
        old = [weakref.ref(b) for b in workspace._buffers]
        workspace._capturing = lambda: captured
        workspace.reserve(500)  # fits: no growth, and (captured) a graph now holds these buffers
        workspace._capturing = lambda: False
        workspace.reserve(4 * workspace.capacity)
        workspace.world.barrier.wait()  # every rank grew: the shared list holds only new buffers
        gc.collect()
        return [ref() is not None for ref in old], workspace._captured

    for alive, still_captured in _run_ranks(2, rank_fn):
        assert alive == [captured, captured] and not still_captured


def test_growing_while_a_graph_is_captured_is_refused():
    def rank_fn(rank, workspace):
        workspace.reserve(100)
        workspace._capturing = lambda: True
        with pytest.raises(RuntimeError, match=f"must grow to {4 * workspace.capacity} bytes while a CUDA graph"):
            workspace.reserve(4 * workspace.capacity)

    _run_ranks(2, rank_fn)
