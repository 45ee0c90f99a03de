"""The copy-engine exchanges' layout and flag protocols, on the CPU: P ranks as threads
over plain buffers (a workspace double whose stream operations run at once, a flag wait
blocking the thread), so where each rank stages and pulls from, and how the flags move,
is checked without GPUs; the chunked pipeline runs on top of it and must match the
computation without any exchange. The real symmetric-memory path runs in
tests/gpu/test_ep_nccl.py."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from ep_moe import copy_engine
from ep_moe.copy_engine import CopyEngineExchange, CopyEngineGather, segment_layout
from ep_moe.dispatch import SplitSizes
from ep_moe.kernels.arrival import take_departure
from ep_moe.pipeline import ChunkPlan, expert_pipeline
from ep_moe.routing import build_routing_metadata
from workspace_doubles import HostWorkspace


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers = [torch.zeros(0, dtype=torch.uint8) for _ in range(size)]
        self.changed = threading.Condition()
        self.barrier = threading.Barrier(size, timeout=30)  # a failing rank breaks it: no hang
        self.before_pull = lambda rank, source: None  # a hook: e.g. slow down one rank's pulls


class _ThreadWorkspace(HostWorkspace):
    """A workspace over ``_World``'s buffers: a flag write is immediate, and a flag wait
    blocks the thread."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.size, self.capacity, self.epoch = world, rank, world.size, 0, 0
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
        if copy_engine._STAGED <= index < copy_engine._FREE:
            self.world.before_pull(self.rank, (index - copy_engine._STAGED) % copy_engine._MAX_RANKS)


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


def _matrices(size: int, chunks: int) -> list[list[list[int]]]:
    """matrices[c][q][p]: rows q sends p; rank 1 sends nothing in chunk 0."""
    gen = torch.Generator().manual_seed(size)
    mats = torch.randint(0, 5, (chunks, size, size), generator=gen)
    mats[0, 1] = 0
    return mats.tolist()


def _rows(matrix, rank, width, dtype):
    """Rank ``rank``'s send rows grouped by destination; value = 1000*src + 10*dest + i."""
    vals = [1000.0 * rank + 10 * p + i for p in range(len(matrix)) for i in range(matrix[rank][p])]
    return torch.tensor(vals, dtype=dtype)[:, None].repeat(1, width)


def test_segment_layout():
    matrix = [[1, 2, 0], [0, 0, 4], [3, 1, 2]]
    assert segment_layout(matrix, 1) == [(0, 1, 2), (2, 3, 1)]
    assert segment_layout(matrix, 2) == [(1, 0, 4), (2, 4, 2)]


@pytest.mark.parametrize("size", [2, 4])
def test_dispatch_and_combine_land_like_all_to_all(size):
    matrices = _matrices(size, 2)

    def rank_fn(rank, workspace):
        exchange = CopyEngineExchange(workspace, matrices, {"rows": 3 * 4, "weights": 2 * 8})
        exchange.begin()
        sent = [(_rows(m, rank, 3, torch.float32), _rows(m, rank, 2, torch.float64)) for m in matrices]
        staged = exchange.staging(0, "rows", sent[0][0].shape[0], (3,), torch.float32)
        staged.copy_(sent[0][0])  # written in place: sent without a copy
        sent[0] = (staged, sent[0][1])
        pending = [(exchange.dispatch(r, c, "rows"), exchange.dispatch(w, c, "weights"))
                   for c, (r, w) in enumerate(sent)]  # every dispatch in flight, then combines
        arrived = [(r.wait(), w.wait()) for r, w in pending]
        back = [exchange.combine(r + 0.5, c, "rows").wait() for c, (r, _) in enumerate(arrived)]
        sent = [(r.clone(), w) for r, w in sent]  # the staged rows get overwritten below
        exchange.begin()  # a second session reuses the regions once every peer is done
        again = exchange.dispatch(-sent[1][0], 1, "rows").wait()
        return sent, arrived, back, again

    results = _run_ranks(size, rank_fn)
    for c, matrix in enumerate(matrices):
        for me, (sent, arrived, back, again) in enumerate(results):
            order = [1000.0 * q + 10 * me + i for q in range(size) for i in range(matrix[q][me])]
            assert arrived[c][0][:, 0].tolist() == order and arrived[c][0].shape[1] == 3
            assert arrived[c][1][:, 1].tolist() == order and arrived[c][1].dtype == torch.float64
            torch.testing.assert_close(back[c], sent[c][0] + 0.5)
            if c == 1:
                assert again[:, 0].tolist() == [-v for v in order]


def test_wrong_row_size_is_refused():
    def rank_fn(rank, workspace):
        exchange = CopyEngineExchange(workspace, [[[1, 1], [1, 1]]], {"rows": 3 * 4})
        exchange.begin()
        with pytest.raises(ValueError, match="expected 2 rows of 12 bytes"):
            exchange.dispatch(torch.zeros(2, 4), 0, "rows")

    _run_ranks(2, rank_fn)


TOP_K, EXPERTS = 2, 3


def _expert_fn(rows_SH, weights_SK, plan, gate_up, down):
    local = plan.local
    h = (rows_SH[local.token_index_R] @ gate_up.T).tanh() @ down.T
    h = h * weights_SK.flatten()[local.slot_index_R, None]
    return torch.zeros(rows_SH.shape[0], h.shape[1], dtype=h.dtype).index_add(0, local.token_index_R, h)


@pytest.mark.parametrize("size,layers", [(2, 1), (4, 1), (4, 2)])
def test_pipeline_over_copy_engine_matches_local_computation(size, layers):
    """Each rank sends random rows to every rank (2 chunks); a rank's experts see the rows
    of every source. With two layers, the second sends what the first returned, so the
    workspace serves forward 1, forward 2, backward 2, backward 1 in turn. Outputs and
    every gradient must equal the direct computation, which the test rebuilds from every
    rank's inputs."""
    matrices = _matrices(size, 2)
    gen = torch.Generator().manual_seed(7)

    def per_rank_chunk(rows_of, cols, fn=torch.randn):
        return [[fn(rows_of(m, p), cols, generator=gen, dtype=torch.float64) for m in matrices]
                for p in range(size)]

    sent_count, recv_count = (lambda m, q: sum(m[q])), (lambda m, p: sum(m[q][p] for q in range(size)))
    weights = [[(torch.randn(6, 4, generator=gen, dtype=torch.float64),
                 torch.randn(4, 6, generator=gen, dtype=torch.float64)) for _ in range(size)]
               for _ in range(layers)]
    inputs = per_rank_chunk(sent_count, 4)
    # the top-k weights of the rows a rank receives arrive before the pipeline; what each
    # rank sent of them: rank q's rows for p, in the order p received them
    arrived = [per_rank_chunk(recv_count, TOP_K, torch.rand) for _ in range(layers)]

    def sent_part(per_dest, c, q):  # rank q's rows of chunk c, from each destination's arrival-order tensor
        m = matrices[c]
        return torch.cat([per_dest[p][c][sum(m[r][p] for r in range(q)):][:m[q][p]] for p in range(size)])

    sent_weights = [[[sent_part(layer, c, q) for c in range(len(matrices))] for q in range(size)]
                    for layer in arrived]
    ids = [[[torch.randint(0, EXPERTS, (recv_count(m, p), TOP_K), generator=gen) for m in matrices]
            for p in range(size)] for _ in range(layers)]
    grads = per_rank_chunk(sent_count, 4)

    def plans_of(layer, rank):
        return [ChunkPlan(SplitSizes(send=m[rank], recv=[m[q][rank] for q in range(size)]),
                          build_routing_metadata(ids[layer][rank][c], EXPERTS)) for c, m in enumerate(matrices)]

    def rank_fn(rank, workspace):
        experts = [[w.clone().requires_grad_() for w in weights[layer][rank]] for layer in range(layers)]
        wts = [[w.clone().requires_grad_() for w in sent_weights[layer][rank]] for layer in range(layers)]
        rows = first = [r.clone().requires_grad_() for r in inputs[rank]]
        for layer in range(layers):
            exchange = CopyEngineExchange(workspace, matrices, {"rows": 4 * 8, "weights": TOP_K * 8})
            exchange.begin()
            rows = expert_pipeline(_expert_fn, plans_of(layer, rank), exchange, *experts[layer], rows, wts[layer],
                                   arrived[layer][rank])
        torch.autograd.backward(rows, grads[rank])
        leaves = [t for layer in range(layers) for t in (*experts[layer], *wts[layer])] + first
        return [o.detach() for o in rows], [t.grad for t in leaves]

    results = _run_ranks(size, rank_fn)
    # Direct computation: rank p's experts on the rows of every source, then back.
    experts = [[[t.clone().requires_grad_() for t in pair] for pair in per] for per in weights]
    arrived_leaves = [[[w.clone().requires_grad_() for w in per] for per in layer] for layer in arrived]
    sent = first = [[r.clone().requires_grad_() for r in per] for per in inputs]
    for layer in range(layers):
        outs = [[{} for _ in matrices] for _ in range(size)]
        for c, m in enumerate(matrices):
            for p in range(size):
                segs = [(q, sum(m[q][:p]), m[q][p]) for q in range(size)]
                rows_p = torch.cat([sent[q][c][s: s + n] for q, s, n in segs])
                out_p = _expert_fn(rows_p, arrived_leaves[layer][p][c], plans_of(layer, p)[c], *experts[layer][p])
                for (q, _, _), piece in zip(segs, out_p.split([n for _, _, n in segs])):
                    outs[q][c][p] = piece
        sent = [[torch.cat([outs[q][c][p] for p in range(size)]) for c in range(len(matrices))] for q in range(size)]
    torch.autograd.backward([o for per in sent for o in per], [g for per in grads for g in per])
    for q, (got_outs, got_grads) in enumerate(results):
        for c in range(len(matrices)):
            torch.testing.assert_close(got_outs[c], sent[q][c])
        want_grads = []
        for layer in range(layers):
            want_grads += [t.grad for t in experts[layer][q]]
            arrived_grads = [[w.grad for w in per] for per in arrived_leaves[layer]]
            want_grads += [sent_part(arrived_grads, c, q) for c in range(len(matrices))]
        want_grads += [r.grad for r in first[q]]
        assert len(got_grads) == len(want_grads)
        for got, want in zip(got_grads, want_grads):
            torch.testing.assert_close(got, want)


def _flag_words(workspace) -> torch.Tensor:
    """The all-gather's handshake flags of ``workspace``'s rank (staged and free), a copy."""
    return workspace.world.buffers[workspace.rank][4 * copy_engine._STAGED: 4 * copy_engine._LANDED].view(
        torch.int32).clone()


@pytest.mark.parametrize("size,chunks", [(2, 1), (4, 3)])
def test_gather_and_reduce_scatter_leave_the_flags_as_they_found_them(size, chunks, fake_groups):
    """Rounds of every chunk's all-gather and reduce-scatter (as a forward and a backward
    use the same regions, repeated): each rank gets every rank's rows in rank order (its
    landing flag ends at P-1) and the sum of every rank's partial sums of its tokens, sent
    source by source (as the down projection does) in even rounds and whole in odd ones;
    after each round the handshake flags are back where they started, as a CUDA graph's
    replay needs."""
    rows = [5, 3, 4][:chunks]

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(size), workspace, rows, 3 * 4)
        start = _flag_words(workspace)
        workspace.world.barrier.wait()  # before any peer signals
        got, summed, flags_after = [], [], []
        for rnd in range(4):
            pending = [exchange.dispatch(_gather_rows(rank, c, rnd, n), c, "rows") for c, n in enumerate(rows)]
            got.append([p.wait() for p in pending])
            assert all(int(p.landing.flag.item()) == size - 1 and p.landing.num_sources == size for p in pending)
            summed.append([])
            for c, n in enumerate(rows):
                partial = _partial_sums(rank, c, rnd, size, n)
                with exchange.departing(c, partial):
                    departure = take_departure() if rnd % 2 == 0 else None
                    if departure is not None:  # what grouped_gemm_slot_sum does with it
                        for position in departure.order:
                            departure.out[departure.tokens(position)] = partial[departure.tokens(position)]
                            departure.send(position)
                summed[-1].append(exchange.combine(partial if departure is None else departure.out, c, "rows").wait())
            workspace.world.barrier.wait()  # every rank done pulling and summing
            flags_after.append(_flag_words(workspace))
            workspace.world.barrier.wait()  # before any peer's next round signals
        return start, got, summed, flags_after

    for me, (start, got, summed, flags_after) in enumerate(_run_ranks(size, rank_fn)):
        assert int(start.sum()) == 2 * copy_engine._MAX_CHUNKS * copy_engine._MAX_RANKS  # every region free
        for rnd, per_chunk in enumerate(got):
            for c, out in enumerate(per_chunk):
                want = torch.cat([_gather_rows(q, c, rnd, rows[c]) for q in range(size)])
                assert torch.equal(out, want), (rnd, c)
                n = rows[c]
                want = sum(_partial_sums(q, c, rnd, size, n)[me * n: (me + 1) * n] for q in range(size))
                assert torch.equal(summed[rnd][c], want), (rnd, c)
        for flags in flags_after:
            assert torch.equal(flags, start)


def test_combine_refuses_an_output_other_than_the_sums_sent(fake_groups):
    """Sums sent source by source from inside the down projection: combining anything else
    (an expert function that changed the output after the GEMM) is an error, not a silent
    reduce of the unchanged sums."""

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(1), workspace, [4], 3 * 4)
        partial = _partial_sums(rank, 0, 0, 1, 4)
        with exchange.departing(0, partial):
            departure = take_departure()
            departure.out.copy_(partial)
            departure.send(0)
        with pytest.raises(RuntimeError, match="output as it is"):
            exchange.combine(2 * departure.out, 0, "rows")
        return True

    assert _run_ranks(1, rank_fn) == [True]


def _partial_sums(rank: int, chunk: int, rnd: int, size: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s partial sums for every rank's ``n`` tokens (small integers: exact sums)."""
    gen = torch.Generator().manual_seed(1000 * rnd + 100 * chunk + rank)
    return torch.randint(-8, 8, (size * n, 3), generator=gen).float()


class _FakeGroup:
    """Stands in for the process group: only its size is read (through the patched
    ``dist.get_world_size`` of the ``fake_groups`` fixture), no collective runs."""

    def __init__(self, size: int) -> None:
        self.size = size


@pytest.fixture
def fake_groups(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group.size)


def _gather_rows(rank: int, chunk: int, rnd: int, n: int) -> torch.Tensor:
    return (1000.0 * rnd + 100 * rank + 10 * chunk + torch.arange(n, dtype=torch.float32))[:, None].repeat(1, 3)


def test_gather_restages_a_region_only_after_every_peer_pulled_it(fake_groups):
    """Rank 1 pulls late: rank 0's next dispatch on the same chunk must wait for it rather
    than overwrite the rows rank 1 has not copied yet."""
    world = _World(2)
    world.before_pull = lambda rank, source: time.sleep(0.3) if rank == 1 else None

    def rank_fn(rank, workspace):
        exchange = CopyEngineGather(_FakeGroup(2), workspace, [4], 3 * 4)
        return [exchange.dispatch(_gather_rows(rank, 0, rnd, 4), 0, "rows").wait() for rnd in range(3)]

    results = _run_ranks(2, rank_fn, world)
    for got in results:
        for rnd, out in enumerate(got):
            assert torch.equal(out, torch.cat([_gather_rows(q, 0, rnd, 4) for q in range(2)])), rnd


def test_gather_refuses_more_chunks_than_it_has_flags_for(fake_groups):
    def rank_fn(rank, workspace):
        with pytest.raises(ValueError, match="at most 32 chunks, got 33; lower MoEConfig.overlap_chunks"):
            CopyEngineGather(_FakeGroup(2), workspace, [1] * 33, 4)

    _run_ranks(2, rank_fn)


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
