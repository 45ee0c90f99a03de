"""The row kernel in source order. Arrival: rows that land source by source (a copy-engine
all-gather) are walked source-major, each tile waiting for its source's flag; with every
flag already raised the results must be those of the plain launch, for every tiling of
sources over experts (sources with no rows for an expert, experts with no rows, every row
from one source, sizes that are multiples of no block). Departure: a launch over one
source's window computes exactly that source's rows, and the slot-summing down projection
run source by source sends each source's token sums complete."""

from __future__ import annotations

import pytest
import torch

from ep_moe.ep.all_gather import gathered_routing
from ep_moe.kernels.arrival import Departure, Landing, RowArrival, arrival_of, rows_arriving, rows_departing
from ep_moe.kernels.config import GemmConfigs, KernelConfig
from ep_moe.kernels.grouped_gemm import launch_rows
from ep_moe.kernels.ops import grouped_gemm_slot_sum

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SMALL = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_SIZE_M=2, num_warps=4, num_stages=2)
TOL = 5e-3 if ON_GPU else 1e-5

# rows of each (expert, source) pair, sources in landing order
LAYOUTS = {
    "ragged": [[5, 0, 17], [0, 0, 0], [3, 40, 1], [16, 16, 16]],
    "one_source": [[0, 33, 0], [0, 7, 0]],
    "own_only": [[21, 0, 0, 0], [2, 0, 0, 0]],
    "one_row": [[0, 0, 1]],
}


def build(layout, rows_per_source: int, first_source: int, seed: int = 0):
    """Gather indices of a gathered [P*T, H] table (source q's rows at q*T), each expert's
    rows sorted by source in landing order from ``first_source``; ``source_ends`` as the
    routing builds it."""
    gen = torch.Generator().manual_seed(seed)
    num_sources = len(layout[0])
    index = []
    for per_source in layout:
        for w, count in enumerate(per_source):
            source = (first_source + w) % num_sources
            index.append(source * rows_per_source + torch.randint(0, rows_per_source, (count,), generator=gen))
    counts = torch.tensor(layout, dtype=torch.int32)
    return (torch.cat(index).to(torch.int32).to(DEVICE), counts.sum(1).to(torch.int32).to(DEVICE),
            counts.cumsum(1).to(torch.int32).to(DEVICE))


def landed(num_sources: int, base: int = 40) -> Landing:
    """Every source landed (the flag as the driver writes it: the low 32 bits)."""
    value = (base + num_sources - 1 + 2 ** 31) % 2 ** 32 - 2 ** 31
    return Landing(torch.full((1,), value, dtype=torch.int32, device=DEVICE), base, num_sources)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("first_source", [0, 2])
@pytest.mark.parametrize("base", [40, 2 ** 31 - 2, 2 ** 32 + 5], ids=["small", "wraps", "past_32_bits"])
def test_arrival_order_computes_every_row_as_the_plain_launch(layout, first_source, base):
    counts = LAYOUTS[layout]
    num_sources, rows_per_source, n, k = len(counts[0]), 29, 37, 45
    load_idx, m_sizes, source_ends = build(counts, rows_per_source, first_source % num_sources)
    num_rows, experts = load_idx.shape[0], len(counts)
    a = torch.randn(num_sources * rows_per_source, k, device=DEVICE)
    w = torch.randn(experts, n, k, device=DEVICE) / k ** 0.5
    scale = torch.rand(num_rows, device=DEVICE)
    plain = torch.full((num_rows, n), float("nan"), device=DEVICE)
    launch_rows(a, w, plain, m_sizes, SMALL, transpose_w=True, load_idx=load_idx, scale=scale)
    ordered = torch.full_like(plain, float("nan"))
    with rows_arriving(a, RowArrival(landed(num_sources, base), source_ends)):
        assert arrival_of(a) is not None
        launch_rows(a, w, ordered, m_sizes, SMALL, transpose_w=True, load_idx=load_idx, scale=scale)
    assert arrival_of(a) is None
    assert torch.equal(ordered, plain)  # same tiles, same reduction order
    ref = torch.cat([seg @ w[e].double().t() for e, seg in
                     enumerate(torch.split(a.double()[load_idx.long()], m_sizes.tolist()))]) * scale.double()[:, None]
    assert ((ordered.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item() < TOL


def test_arrival_order_in_the_slot_sums_backward_launch():
    """The dX launch of the slot sum's backward (gradient rows read per routed row, a row
    dot for the top-k weights) in arrival order: the same dX and dots."""
    counts = LAYOUTS["ragged"]
    num_sources, rows_per_source, n, k = 3, 23, 40, 33
    load_idx, m_sizes, source_ends = build(counts, rows_per_source, 1, seed=1)
    num_rows = load_idx.shape[0]
    dy = torch.randn(num_sources * rows_per_source, k, device=DEVICE)
    w = torch.randn(len(counts), k, n, device=DEVICE)
    act = torch.randn(num_rows, n, device=DEVICE)
    scale = torch.rand(num_rows, device=DEVICE)

    def run():
        da = torch.full((num_rows, n), float("nan"), device=DEVICE)
        dots = launch_rows(dy, w, da, m_sizes, SMALL, transpose_w=False, load_idx=load_idx, scale=scale,
                           per_routed_row=True, dot_with=act)
        return da, dots

    plain = run()
    with rows_arriving(dy, RowArrival(landed(num_sources), source_ends)):
        ordered = run()
    for got, want in zip(ordered, plain):
        assert torch.equal(got, want)


def test_source_table_of_the_wrong_shape_is_rejected():
    load_idx, m_sizes, source_ends = build(LAYOUTS["ragged"], 8, 0)
    a = torch.randn(24, 32, device=DEVICE)
    w = torch.randn(4, 32, 32, device=DEVICE)
    out = torch.empty(load_idx.shape[0], 32, device=DEVICE)
    with rows_arriving(a, RowArrival(landed(2), source_ends)):
        with pytest.raises(ValueError, match="source_ends"):
            launch_rows(a, w, out, m_sizes, SMALL, transpose_w=True, load_idx=load_idx)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_source_window_computes_exactly_its_rows(layout):
    counts = LAYOUTS[layout]
    num_sources, rows_per_source, n, k = len(counts[0]), 29, 37, 45
    load_idx, m_sizes, source_ends = build(counts, rows_per_source, 1 % num_sources)
    num_rows = load_idx.shape[0]
    a = torch.randn(num_sources * rows_per_source, k, device=DEVICE)
    w = torch.randn(len(counts), n, k, device=DEVICE) / k ** 0.5
    scale = torch.rand(num_rows, device=DEVICE)
    plain = torch.full((num_rows, n), float("nan"), device=DEVICE)
    launch_rows(a, w, plain, m_sizes, SMALL, transpose_w=True, load_idx=load_idx, scale=scale)
    # each routed row's source position, from the layout
    position = torch.cat([torch.full((c,), p) for per_source in counts for p, c in enumerate(per_source)])
    windowed = torch.full_like(plain, float("nan"))
    for source in reversed(range(num_sources)):  # any order
        launch_rows(a, w, windowed, m_sizes, SMALL, transpose_w=True, load_idx=load_idx, scale=scale,
                    source_window=(source_ends, source))
        done = (position >= source).to(DEVICE)
        # other tiles than the plain launch's (per segment): the same rows up to rounding
        torch.testing.assert_close(windowed[done], plain[done], rtol=1e-5, atol=1e-5)
        assert windowed[~done].isnan().all(), f"source {source}'s window wrote rows of other sources"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_sources,first_source", [(2, 1), (4, 2)])
def test_slot_sum_sent_source_by_source_matches_the_whole(dtype, num_sources, first_source):
    """The down projection with its slot sum run per source (peers first, own last) into a
    departure: the same token sums as one launch, each source's complete when it is sent
    (tokens on one expert, experts with none, a bound that drops rows)."""
    tokens, top_k, num_local, hidden, inter = 13, 2, 3, 40, 24
    gen = torch.Generator().manual_seed(num_sources)
    ids = torch.randint(0, 2 * num_local, (num_sources * tokens, top_k), generator=gen)
    ids[:tokens] = 0  # the first source's tokens all on expert 0
    ids[-1] = -1  # a dropped slot pair
    max_rows = int(0.9 * (ids >= 0).sum())
    slots, _ = gathered_routing(ids.to(DEVICE), 0, num_local, max_rows, num_sources, first_source)
    rows = slots.token_index_R.shape[0]
    a = torch.randn(rows, inter, device=DEVICE, dtype=dtype)
    w = (torch.randn(num_local, hidden, inter, device=DEVICE) / inter ** 0.5).to(dtype)
    row_weights = torch.rand(rows, device=DEVICE)
    configs = GemmConfigs(SMALL, SMALL, SMALL)
    args = (a, w, slots.counts_E, row_weights, slots.token_index_R, slots.row_of_slot_N, top_k, configs, True)
    whole = grouped_gemm_slot_sum(*args)
    close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    sent = []

    def send(position):
        tokens_sent = departure.tokens(position)
        sent.append(position)
        torch.testing.assert_close(departure.out[tokens_sent], whole[tokens_sent], **close)

    departure = Departure(torch.full_like(whole, float("nan")), tuple(range(1, num_sources)) + (0,), first_source,
                          send)
    with rows_departing(departure):
        got = grouped_gemm_slot_sum(*args, source_ends=slots.source_ends_ES)
    assert departure.used and departure.complete and got is departure.out and sent == list(departure.order)
    torch.testing.assert_close(got, whole, **close)


def test_a_departure_needs_the_source_table():
    departure = Departure(torch.empty(4, 8, device=DEVICE), (1, 0), 0, lambda position: None)
    with rows_departing(departure), pytest.raises(ValueError, match="one column per source"):
        grouped_gemm_slot_sum(torch.empty(2, 8, device=DEVICE), torch.empty(1, 8, 8, device=DEVICE),
                              torch.tensor([2], device=DEVICE), torch.ones(2, device=DEVICE),
                              torch.zeros(2, dtype=torch.int32, device=DEVICE),
                              torch.zeros(4, dtype=torch.int32, device=DEVICE), 2)
