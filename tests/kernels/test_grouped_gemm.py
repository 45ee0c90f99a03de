"""Grouped GEMM kernels against a float64 reference.

On the CPU these run in the Triton interpreter (float32, float16); on a GPU the same tests
run in bfloat16 too. Every case draws fresh random inputs; outputs of the raw launchers are
poisoned with NaN first, so a row or column the kernel forgets to write fails the test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_moe import GemmConfigs, KernelConfig, grouped_gemm
from ep_moe.kernels.grouped_gemm import (
    launch_dw,
    launch_grid,
    launch_rows,
    num_programs_for,
    one_program_per_tile,
    smem_limit_for,
)
from ep_moe.ep.pipeline import DeferredWeightGrads
from ep_moe.kernels.config import TMA_MIN_ROWS
from ep_moe.kernels.ops import defer_weight_grads, layer_grouped_gemm
from ep_moe.kernels.permute import launch_gather_rows
from ep_moe.kernels.reference import grouped_gemm_reference

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Relative Frobenius error allowed per dtype (fp32 on the GPU: tf32 if torch.backends.cuda.matmul.allow_tf32,
# which these tests leave off, so ieee; the margin is for users' settings).
TOL = {torch.float32: 5e-3 if ON_GPU else 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# Small blocks in the interpreter keep ragged tiles in play at small sizes; on the GPU the
# defaults (and TMA where available) are what users run.
SMALL = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_SIZE_M=2, num_warps=4, num_stages=2)


def configs_for(dtype: torch.dtype, use_tma: bool | None = None) -> GemmConfigs:
    """Configs under test: the shipped defaults for dtype on the GPU (TMA forced on or off
    when asked), small blocks in the interpreter."""
    if not ON_GPU:
        return GemmConfigs(forward=SMALL, dx=SMALL, dw=SMALL)
    configs = GemmConfigs.defaults(torch.finfo(dtype).bits // 8, smem_limit_for(DEVICE))
    if use_tma is None:
        return configs
    return GemmConfigs(**{p: dataclasses.replace(configs.for_pass(p), use_tma=use_tma)
                          for p in ("forward", "dx", "dw")})


# On the GPU every case runs with TMA loads on and off (both paths ship).
TMA_VARIANTS = {"tma": True, "pointers": False} if ON_GPU else {"interpreter": None}
CONFIGS = configs_for(torch.float32)


# (m_sizes, N, K): zero-row experts, everything on one expert, one row, one expert, no
# rows at all, and sizes that are multiples of no block.
CASES = {
    "ragged": ([5, 0, 17, 3], 37, 45),
    "all_on_one": ([0, 23, 0], 40, 33),
    "one_row": ([0, 1], 24, 20),
    "one_expert": ([19], 29, 64),
    "no_rows": ([0, 0, 0], 24, 20),
}
if ON_GPU:
    CASES["large"] = ([300, 0, 1000, 7, 129, 2048, 1, 515], 1536, 2048)
    CASES["tma_tails"] = ([77, 0, 700, 1, 300], 1000, 2888)  # 16-byte rows, no block multiple


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def row_dot_err(got: torch.Tensor, ref: torch.Tensor, dy_rows: torch.Tensor, y_rows: torch.Tensor) -> float:
    """Error of per-row dot products ``<dy_rows[r], y_rows[r]>`` (a row weight's gradient)
    against the norm of their terms, not of the dots: a dot may cancel to near zero (one
    row: the whole vector), while rounding errs in proportion to the terms."""
    terms = (dy_rows.double().abs() * y_rows.double().abs()).sum(1)
    return ((got.double() - ref.double()).norm() / terms.norm().clamp_min(1e-30)).item()


def make_problem(case: str, dtype: torch.dtype, gather: bool, scatter: bool, weights: bool):
    sizes, n, k = CASES[case]
    num_rows = sum(sizes)
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    # A gathered x has fewer rows than the problem, so rows repeat and some go unused.
    x_rows = max(1, (num_rows * 2) // 3) if gather else num_rows
    x = torch.randn(x_rows, k, device=DEVICE).to(dtype)
    w = (torch.randn(len(sizes), n, k, device=DEVICE) / k**0.5).to(dtype)
    gather_index = torch.randint(0, x_rows, (num_rows,), device=DEVICE) if gather else None
    scatter_index = torch.randperm(num_rows, device=DEVICE) if scatter else None
    row_weights = torch.rand(num_rows, device=DEVICE, dtype=torch.float32) if weights else None
    return x, w, m_sizes, gather_index, scatter_index, row_weights


def check_op(case, dtype, gather, scatter, weights, use_tma=None):
    configs = configs_for(dtype, use_tma)
    x, w, m_sizes, g, s, rw = make_problem(case, dtype, gather, scatter, weights)
    leaves = [x.requires_grad_(), w.requires_grad_()] + ([rw.requires_grad_()] if weights else [])
    y = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw,
                     configs=configs, backend="triton")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)

    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    rw64 = leaves64[2] if weights else None
    y_ref = grouped_gemm_reference(leaves64[0], leaves64[1], m_sizes, gather_index=g,
                                   scatter_index=s, row_weights=rw64)
    grads_ref = torch.autograd.grad(y_ref, leaves64, dy.double())

    assert y.dtype == dtype and y.shape == y_ref.shape
    tol = TOL[dtype]
    assert rel_err(y, y_ref) < tol, "forward"
    for name, got, ref in zip(("dx", "dw"), grads, grads_ref):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, ref) < tol, name
    if weights:
        # each row weight's gradient is one dot product, <dy row, unweighted output row>
        y0_ref = grouped_gemm_reference(leaves64[0], leaves64[1], m_sizes, gather_index=g, scatter_index=s)
        assert torch.isfinite(grads[2]).all(), "d_row_weights"
        assert row_dot_err(grads[2], grads_ref[2], dy, y0_ref) < tol, "d_row_weights"


@pytest.mark.parametrize("gather", [False, True], ids=["", "gather"])
@pytest.mark.parametrize("scatter", [False, True], ids=["", "scatter"])
@pytest.mark.parametrize("weights", [False, True], ids=["", "weights"])
def test_every_permutation_mode(gather, scatter, weights):
    check_op("ragged", torch.float32, gather, scatter, weights)


@pytest.mark.usefixtures("tma_from_any_rows")
@pytest.mark.parametrize("variant", list(TMA_VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_edge_shapes(case, dtype, variant):
    check_op(case, dtype, gather=True, scatter=True, weights=True, use_tma=TMA_VARIANTS[variant])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_layout(dtype):
    check_op("ragged", dtype, gather=False, scatter=False, weights=False)


def test_nondeterministic_dx_matches():
    x, w, m_sizes, g, _, _ = make_problem("ragged", torch.float32, True, False, False)
    x.requires_grad_()
    outs = []
    for deterministic in (True, False):
        y = grouped_gemm(x, w, m_sizes, gather_index=g, configs=CONFIGS,
                         deterministic=deterministic, backend="triton")
        outs.append(torch.autograd.grad(y, x, torch.ones_like(y))[0])
    assert rel_err(outs[1], outs[0]) < TOL[torch.float32]


@pytest.mark.parametrize("rows_of_x", [17, 25], ids=["permutation", "subset"])
def test_unique_gather_matches_sorted_path(rows_of_x):
    sizes = [5, 0, 9, 3]
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x = torch.randn(rows_of_x, 45, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 37, 45, device=DEVICE)
    g = torch.randperm(rows_of_x, device=DEVICE)[:sum(sizes)]
    grads = []
    for unique in (False, True):
        y = grouped_gemm(x, w, m_sizes, gather_index=g, configs=CONFIGS, unique_gather=unique,
                         backend="triton")
        grads.append(torch.autograd.grad(y, x, torch.ones_like(y))[0])
    assert torch.equal(grads[1] == 0, grads[0] == 0)  # rows never read stay zero
    assert rel_err(grads[1], grads[0]) < TOL[torch.float32]


def test_unique_gather_rejects_repeats():
    a = _args()
    with pytest.raises(ValueError, match="unique_gather=True"):
        grouped_gemm(a["x"], a["w"], a["m_sizes"], gather_index=torch.tensor([0, 0, 1, 2, 3, 4]),
                     unique_gather=True)


def test_gathered_rows_never_read_get_zero_grad():
    sizes = [4, 4]
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x = torch.randn(10, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(2, 8, 16, device=DEVICE)
    g = torch.tensor([0, 0, 2, 2, 4, 4, 6, 6], device=DEVICE)
    y = grouped_gemm(x, w, m_sizes, gather_index=g, configs=CONFIGS, backend="triton")
    dx = torch.autograd.grad(y, x, torch.randn_like(y))[0]
    read = torch.zeros(10, dtype=torch.bool, device=DEVICE)
    read[g] = True
    assert torch.equal(dx[~read], torch.zeros_like(dx[~read]))
    assert (dx[read].abs().sum(1) > 0).all()


@pytest.fixture
def nan_filled_empty():
    """torch.empty fills with NaN (deterministic mode), so rows a kernel leaves unwritten
    show up in whatever reads them."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("mode", ["sort", "atomic", "unique", "rows"])
def test_bounded_rows_past_the_counts_are_left_out(mode, nan_filled_empty):
    """``bounded_rows``: M = 32 rows of which m_sizes counts 25; the 7 past them are not
    computed and get no gradient, so everything equals the 25-row problem's, and their
    row-weight gradients are 0. Their gather entries name rows that the counted rows read
    too, so a dX row that leaked would change dx."""
    sizes, extra = [5, 0, 17, 3], 7
    counted, num_rows = sum(sizes), sum(sizes) + extra
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x_rows = {"sort": 20, "atomic": 20, "unique": 40, "rows": num_rows}[mode]
    x = torch.randn(x_rows, 45, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 37, 45, device=DEVICE, requires_grad=True)
    rw = torch.rand(num_rows, device=DEVICE, requires_grad=True)
    g = None
    if mode in ("sort", "atomic"):
        g = torch.randint(0, x_rows, (num_rows,), device=DEVICE)
        g[counted:] = g[:extra]
    elif mode == "unique":
        g = torch.randperm(x_rows, device=DEVICE)[:num_rows]
    kwargs = dict(gather_index=g, configs=CONFIGS, backend="triton", deterministic=mode != "atomic",
                  unique_gather=mode == "unique")
    y = grouped_gemm(x, w, m_sizes, row_weights=rw, bounded_rows=True, **kwargs)
    dy = torch.randn_like(y)
    dx, dw, drw = torch.autograd.grad(y[:counted], (x, w, rw), dy[:counted])

    x_ref = x if g is not None else x[:counted]
    ref_kwargs = {**kwargs, "gather_index": None if g is None else g[:counted]}
    y_ref = grouped_gemm(x_ref, w, m_sizes, row_weights=rw[:counted], **ref_kwargs)
    dx_ref, dw_ref, drw_ref = torch.autograd.grad(y_ref, (x, w, rw), dy[:counted])
    assert torch.equal(y[:counted], y_ref)
    assert torch.equal(drw[counted:], torch.zeros(extra, device=DEVICE))
    for got, ref in ((dx, dx_ref), (dw, dw_ref), (drw, drw_ref)):
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) < TOL[torch.float32]


def test_bounded_rows_in_the_reference_are_zeros():
    sizes = [3, 0, 4]
    x, w = torch.randn(9, 8), torch.randn(3, 5, 8)
    y = grouped_gemm_reference(x, w, torch.tensor(sizes))
    assert torch.equal(y[7:], torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"m_sizes sums to 7 but there are 9 routed rows .*bounded_rows=True"):
        grouped_gemm(x, w, torch.tensor(sizes), backend="torch")
    with pytest.raises(ValueError, match=r"m_sizes sums to 10 but there are 9 routed rows"):
        grouped_gemm(x, w, torch.tensor([3, 3, 4]), backend="torch", bounded_rows=True)
    with pytest.raises(ValueError, match="bounded_rows=True does not take a scatter_index"):
        grouped_gemm(x, w, torch.tensor(sizes), scatter_index=torch.arange(9), bounded_rows=True)


def test_strided_row_weights_match_contiguous_ones():
    """Row weights that are a strided view (a column of a [M, 2] tensor) weight the right rows."""
    x, w, m_sizes, g, s, rw = make_problem("ragged", torch.float32, gather=True, scatter=True, weights=True)
    strided = torch.stack([rw, torch.full_like(rw, 100.0)], dim=1)[:, 0]
    assert not strided.is_contiguous()
    got = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=strided, configs=CONFIGS,
                       backend="triton")
    want = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw, configs=CONFIGS,
                        backend="triton")
    torch.testing.assert_close(got, want)


def test_row_dots_by_load_row_need_one_routed_row_per_row_of_a():
    """launch_rows strides the dots by the routed-row count: dots indexed by load row are
    refused when a has another number of rows (they would land in the wrong tile's row)."""
    x, w, m_sizes, g, s, rw = make_problem("ragged", torch.float32, True, True, True)
    out = torch.empty(g.shape[0], w.shape[1], device=DEVICE)
    assert x.shape[0] != g.shape[0]
    with pytest.raises(ValueError, match="per_routed_row=True"):
        launch_rows(x, w, out, m_sizes, CONFIGS.forward, transpose_w=True, load_idx=g, dot_with=out)


# --- raw launchers on poisoned outputs: every output element must be written --------------

@pytest.mark.parametrize("case", ["ragged", "all_on_one"])
def test_launchers_write_every_element(case):
    x, w, m_sizes, g, s, rw = make_problem(case, torch.float32, True, True, True)
    num_rows, n, k = g.shape[0], w.shape[1], w.shape[2]
    x64, w64 = x.double(), w.double()
    ref_rows = torch.cat([seg @ w64[e].t() for e, seg in
                          enumerate(torch.split(x64[g], m_sizes.tolist()))])

    out = torch.full((num_rows, n), float("nan"), device=DEVICE)
    launch_rows(x, w, out, m_sizes, CONFIGS.forward, transpose_w=True, load_idx=g,
                store_idx=s, scale=rw)
    expected = torch.empty_like(ref_rows)
    expected[s] = ref_rows * rw.double()[s, None]
    assert rel_err(out, expected) < TOL[torch.float32]

    weighted = launch_gather_rows(out, s, rw)
    assert rel_err(weighted, out.double()[s] * rw.double()[s, None]) < TOL[torch.float32]

    dy = torch.randn(num_rows, n, device=DEVICE)
    dx_rows = torch.full((num_rows, k), float("nan"), device=DEVICE)
    launch_rows(dy, w, dx_rows, m_sizes, CONFIGS.dx, transpose_w=False)
    ref_dx = torch.cat([seg @ w64[e] for e, seg in enumerate(torch.split(dy.double(), m_sizes.tolist()))])
    assert rel_err(dx_rows, ref_dx) < TOL[torch.float32]

    dw = torch.full_like(w, float("nan"))
    launch_dw(dy, launch_gather_rows(x, g), dw, m_sizes, CONFIGS.dw)
    ref_dw = torch.stack([a.t() @ b for a, b in zip(torch.split(dy.double(), m_sizes.tolist()),
                                                   torch.split(x64[g], m_sizes.tolist()))])
    assert torch.isfinite(dw).all()
    assert rel_err(dw, ref_dw) < TOL[torch.float32]


def test_empty_experts_get_zero_dw():
    m_sizes = torch.tensor([0, 6, 0], dtype=torch.int32, device=DEVICE)
    x = torch.randn(6, 20, device=DEVICE)
    dy = torch.randn(6, 24, device=DEVICE)
    dw = torch.full((3, 24, 20), float("nan"), device=DEVICE)
    launch_dw(dy, x, dw, m_sizes, CONFIGS.dw)
    assert torch.equal(dw[0], torch.zeros_like(dw[0])) and torch.equal(dw[2], torch.zeros_like(dw[2]))


@pytest.mark.usefixtures("tma_from_any_rows")
@pytest.mark.parametrize("dw_layout", ["contiguous", "transposed", "float32"])
@pytest.mark.parametrize("group", [1, 3, 5])
@pytest.mark.parametrize("variant", list(TMA_VARIANTS))
def test_dw_tile_groups_write_every_tile(group, variant, dw_layout):
    """dW's tiles go GROUP_SIZE_M N tiles at a time within an expert: with a group that does
    not divide the N tiles (a last, partial group), N and K not multiples of their blocks and
    an expert of several whole row steps and a ragged tail, every element of every expert is
    written with its own value; also into a transposed weight's dW (GPT-OSS's layout: pointer
    stores) and into an fp32 dW from 16-bit rows (FP8 experts' fp32 master weights: no TMA
    store, whose buffer would not fit at that width)."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    config = dataclasses.replace(configs_for(dtype, TMA_VARIANTS[variant]).dw, GROUP_SIZE_M=group)
    if not ON_GPU:  # the interpreter: small blocks (the GPU runs the default's, its shared memory in play)
        config = dataclasses.replace(config, BLOCK_N=32, BLOCK_K=32)
    n, k = 3 * config.BLOCK_N + 16, 2 * config.BLOCK_K + 8  # 4 N tiles, 3 K tiles, both ragged
    m_sizes = torch.tensor([0, 37, 2 * config.BLOCK_M + 21], dtype=torch.int32, device=DEVICE)
    rows = int(m_sizes.sum())
    dy, x = torch.randn(rows, n, device=DEVICE).to(dtype), torch.randn(rows, k, device=DEVICE).to(dtype)
    if dw_layout == "transposed":
        dw = torch.full((3, k, n), float("nan"), device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        dw = torch.full((3, n, k), float("nan"), device=DEVICE,
                        dtype=torch.float32 if dw_layout == "float32" else dtype)
    launch_dw(dy, x, dw, m_sizes, config)
    ref = torch.stack([a.t() @ b for a, b in zip(torch.split(dy.double(), m_sizes.tolist()),
                                                 torch.split(x.double(), m_sizes.tolist()))])
    assert torch.isfinite(dw).all()
    assert rel_err(dw, ref) < TOL[dtype]


@pytest.mark.usefixtures("tma_from_any_rows")
@pytest.mark.parametrize("variant", list(TMA_VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dw_accumulates_into_what_it_holds(dtype, variant):
    """accumulate=True adds the product to dw (empty experts keep their values), one
    rounding: the sum of two row sets' dW equals their reference sum."""
    config = configs_for(dtype, TMA_VARIANTS[variant]).dw
    x, w, m_sizes, _, _, _ = make_problem("ragged", dtype, False, False, False)
    dy = torch.randn(x.shape[0], w.shape[1], device=DEVICE).to(dtype)
    held = torch.randn_like(w)
    dw = held.clone()
    launch_dw(dy, x, dw, m_sizes, config, accumulate=True)
    ref = held.double() + torch.stack([a.t() @ b for a, b in zip(torch.split(dy.double(), m_sizes.tolist()),
                                                                 torch.split(x.double(), m_sizes.tolist()))])
    assert rel_err(dw, ref) < TOL[dtype]
    assert torch.equal(dw[1], held[1])  # expert 1 has no rows


def test_one_program_per_tile_launches_every_tile_and_keeps_results():
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, w, m_sizes, g, s, rw = make_problem("ragged", dtype, True, True, True)
    leaves = [x.requires_grad_(), w.requires_grad_(), rw.requires_grad_()]

    def run():
        y = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw,
                         configs=CONFIGS, backend="triton")
        return (y, *torch.autograd.grad(y, leaves, torch.ones_like(y)))

    full = run()
    with one_program_per_tile():
        assert launch_grid(DEVICE, 1000) == ((1000,), 1 << 30)
        per_tile = run()
    assert launch_grid(DEVICE, 1000) == ((min(1000, num_programs_for(DEVICE)),), num_programs_for(DEVICE))
    for a, b in zip(per_tile, full):  # same tiles, same reduction order: bitwise equal
        assert torch.equal(a, b)


def test_deferred_weight_grads_come_after_the_input_grads_and_equal_direct_ones():
    """Inside defer_weight_grads the backward gives dx and the row-weight grad at once and
    queues dW of the weights the queue owns; running the queue sends dW through the cast to
    the fp32 leaf, bitwise equal to the direct backward."""
    x, w32, m_sizes, g, s, rw = make_problem("ragged", torch.float16, True, True, True)
    w32 = w32.float()
    leaves = [x.requires_grad_(), w32.requires_grad_(), rw.requires_grad_()]
    configs = configs_for(torch.float16)

    def backward(scale=None):
        w = w32 if scale is None else w32 * scale
        y = grouped_gemm(x, w.to(torch.float16), m_sizes, gather_index=g, scatter_index=s,
                         row_weights=rw, configs=configs, backend="triton")
        y.backward(torch.ones_like(y))

    backward()
    want = [t.grad.clone() for t in leaves]
    # Not deferred: a queue that does not own the weight, a weight that is more than a cast.
    for queue, scale in ((DeferredWeightGrads([x]), None), (DeferredWeightGrads([w32]), 1.0)):
        for t in leaves:
            t.grad = None
        with defer_weight_grads(queue):
            backward(scale)
        assert len(queue) == 0 and torch.equal(w32.grad, want[1])
    for t in leaves:
        t.grad = None
    queue = DeferredWeightGrads([w32])
    with defer_weight_grads(queue):
        backward()
    assert len(queue) == 1 and w32.grad is None
    assert torch.equal(x.grad, want[0]) and torch.equal(rw.grad, want[2])
    queue.run()
    assert len(queue) == 0 and w32.grad.dtype == torch.float32
    assert torch.equal(w32.grad, want[1])


# --- torch.compile --------------------------------------------------------------------

@pytest.mark.parametrize("weight_layout, grads_of", [("contiguous", "x, w, rw"), ("transposed", "x, w, rw"),
                                                     ("transposed", "w")])
def test_torch_compile_matches_eager(weight_layout, grads_of):
    """Inductor's graph with the custom ops against eager; a weight stored transposed (as
    transformers' GPT-OSS stores its experts) gets its dW in its own strides, which the fake
    impl must tell Inductor (it checks a custom op's output strides where it keeps them, as
    when the weight alone takes a gradient)."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, w, m_sizes, g, s, rw = make_problem("ragged", dtype, True, True, True)
    if weight_layout == "transposed":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)  # [E, N, K] values, K-major storage
    configs = configs_for(dtype)  # resolved outside the compiled region, as the layer does

    def f(x, w, rw):
        y = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw,
                         configs=configs, backend="triton")
        return torch.nn.functional.silu(y) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    names = grads_of.split(", ")
    leaves = [t.clone().requires_grad_(name in names) for name, t in zip(("x", "w", "rw"), (x, w, rw))]
    leaves_c = [t.clone().requires_grad_(name in names) for name, t in zip(("x", "w", "rw"), (x, w, rw))]
    eager = f(*leaves)
    got = compiled(*leaves_c)
    # Inductor fuses the elementwise tail (one rounding instead of two in bfloat16).
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(got, eager) < tol
    dy = torch.randn_like(eager)
    wanted = [t for t in leaves if t.requires_grad]
    for a, b in zip(torch.autograd.grad(eager, wanted, dy),
                    torch.autograd.grad(got, [t for t in leaves_c if t.requires_grad], dy)):
        assert rel_err(b, a) < tol


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_routing():
    """No host sync in forward or backward: the whole step captures into a CUDA graph, and
    replaying it with new routing values in the same buffers gives the new result."""
    dtype = torch.bfloat16
    x, w, m_sizes, g, s, rw = make_problem("large", dtype, True, True, True)
    leaves = [t.requires_grad_() for t in (x, w, rw)]
    dy = torch.randn(g.shape[0], w.shape[1], device=DEVICE, dtype=dtype)

    def step():
        y = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw,
                         configs=configs_for(dtype))
        return (y, *torch.autograd.grad(y, leaves, dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    _, _, m_new, g_new, s_new, _ = make_problem("large", dtype, True, True, True)
    m_sizes.copy_(m_new.flip(0))  # same total, different split
    g.copy_(g_new)
    s.copy_(s_new)
    graph.replay()
    expected = step()
    for got, ref in zip(captured, expected):
        assert rel_err(got, ref) < 1e-6


# --- bad input --------------------------------------------------------------------------

def _args(**over):
    base = dict(
        x=torch.randn(6, 8), w=torch.randn(2, 4, 8),
        m_sizes=torch.tensor([2, 4], dtype=torch.int32),
    )
    base.update(over)
    return base


@pytest.mark.parametrize(
    "over, kwargs, match",
    [
        (dict(x=torch.randn(6, 8, 1)), {}, "x must be 2-D"),
        (dict(w=torch.randn(4, 8)), {}, "w must be 3-D"),
        (dict(w=torch.randn(2, 4, 7)), {}, "K=7"),
        (dict(w=torch.randn(2, 4, 8, dtype=torch.float64)), {}, "does not match x dtype"),
        (dict(x=torch.randn(6, 8).to(torch.int32)), {}, "not supported"),
        (dict(m_sizes=torch.tensor([6])), {}, "one count per expert"),
        (dict(m_sizes=torch.tensor([2.0, 4.0])), {}, "int32 or int64"),
        (dict(m_sizes=torch.tensor([2, 3])), {}, "sums to 5 but there are 6"),
        (dict(m_sizes=torch.tensor([7, -1])), {}, "negative"),
        ({}, dict(gather_index=torch.tensor([0, 1, 2, 3, 4, 9])), "outside \\[0, 6\\)"),
        ({}, dict(gather_index=torch.tensor([0, 1, 2, 3, 4, 5.0])), "int32 or int64"),
        ({}, dict(scatter_index=torch.tensor([0, 1, 2, 3, 4])), "6 entries"),
        ({}, dict(scatter_index=torch.tensor([0, 1, 2, 3, 4, 4])), "permutation"),
        ({}, dict(row_weights=torch.rand(5)), "row_weights must be 1-D with 6"),
        ({}, dict(backend="cuda"), "backend='cuda'"),
        ({}, dict(configs=KernelConfig()), "configs must be a GemmConfigs .* got KernelConfig; wrap one config"),
        ({}, dict(configs={}), "configs must be a GemmConfigs"),
    ],
)
def test_bad_input_names_the_argument(over, kwargs, match):
    a = _args(**over)
    with pytest.raises(ValueError, match=match):
        grouped_gemm(a["x"], a["w"], a["m_sizes"], **kwargs)


def test_defaults_fit_shared_memory():
    from ep_moe.kernels.config import smem_bytes

    for elem, limit in ((2, 227 * 1024), (4, 227 * 1024), (2, 99 * 1024)):
        configs = GemmConfigs.defaults(elem, limit)
        for p in ("forward", "dx", "dw"):
            assert smem_bytes(configs.for_pass(p), p, elem) <= limit


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="BLOCK_N=48"):
        KernelConfig(BLOCK_N=48)


@pytest.mark.gpu
def test_device_mismatch_is_rejected():
    a = _args()
    with pytest.raises(ValueError, match="w is on"):
        grouped_gemm(a["x"].cuda(), a["w"], a["m_sizes"].cuda())


@pytest.mark.gpu
def test_debug_mode_checks_indices_on_gpu():
    a = {k: v.cuda() for k, v in _args().items()}
    with pytest.raises(ValueError, match="outside"):
        grouped_gemm(a["x"], a["w"], a["m_sizes"], gather_index=torch.full((6,), 99, device="cuda"),
                     debug=True)


def test_torch_backend_matches_triton():
    x, w, m_sizes, g, s, rw = make_problem("ragged", torch.float32, True, True, True)
    a = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw, backend="torch")
    b = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw,
                     configs=CONFIGS, backend="triton")
    assert rel_err(b, a) < TOL[torch.float32]


def test_every_config_field_reaches_the_launch(monkeypatch):
    """Each KernelConfig field is a launch argument, so no field is silently ignored."""
    import ep_moe.kernels.grouped_gemm as gg

    launches = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.__setitem__(self.name, kwargs)

    monkeypatch.setattr(gg, "_grouped_rows_kernel", Recorder("rows"))
    monkeypatch.setattr(gg, "_grouped_dw_kernel", Recorder("dw"))
    cfg = KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, GROUP_SIZE_M=5, num_warps=2, num_stages=3)
    x, w = torch.randn(8, 16), torch.randn(2, 24, 16)
    m_sizes = torch.tensor([3, 5], dtype=torch.int32)
    gg.launch_rows(x, w, torch.empty(8, 24), m_sizes, cfg, transpose_w=True)
    gg.launch_dw(torch.randn(8, 24), x, torch.empty_like(w), m_sizes, cfg)
    for name, kwargs in launches.items():
        expected = {f: getattr(cfg, f) for f in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_SIZE_M", "num_warps",
                                                 "num_stages")}
        assert {k: kwargs[k] for k in expected} == expected, name
        assert kwargs["USE_TMA"] is False  # asked for none; the interpreter/CPU has none anyway
    assert set(launches) == {"rows", "dw"}


@pytest.mark.parametrize("layout", ["transposed", "every_other_column"])
def test_gathered_x_with_strided_columns_gets_right_gradients(layout):
    """The backward's row gathers (dW, the sorted dX) read rows as contiguous: an x whose
    columns are strided is made contiguous first, not read as if it were."""
    base = torch.randn(48, 10, device=DEVICE) if layout == "transposed" else torch.randn(10, 96, device=DEVICE)
    x = (base.t() if layout == "transposed" else base[:, ::2]).requires_grad_()
    assert x.shape == (10, 48) and x.stride(-1) != 1
    w = (torch.randn(2, 24, 48, device=DEVICE) / 7).requires_grad_()
    m_sizes = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    gather = torch.randint(0, 10, (14,), device=DEVICE)
    y = grouped_gemm(x, w, m_sizes, gather_index=gather, configs=configs_for(torch.float32), backend="triton")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = grouped_gemm_reference(x64, w64, m_sizes, gather_index=gather)
    refs = torch.autograd.grad(ref, (x64, w64), dy.double())
    assert rel_err(y, ref) < TOL[torch.float32]
    for got, want in zip(grads, refs):
        assert rel_err(got, want) < TOL[torch.float32]


def _dropless_routing(tokens: int, top_k: int, num_experts: int, on_one: bool = False):
    """(m_sizes, token_index, slot_index) of a dropless top-k routing of ``tokens`` tokens:
    each token's k distinct experts (expert 1 for all with ``on_one``, top_k 1), its (token,
    slot) pairs sorted by expert, slot t*k + j."""
    if on_one:
        ids = torch.ones(tokens, top_k, dtype=torch.long, device=DEVICE)
    else:
        ids = torch.rand(tokens, num_experts, device=DEVICE).argsort(dim=1)[:, :top_k]
    slot_index = torch.argsort(ids.flatten(), stable=True)
    m_sizes = torch.bincount(ids.flatten(), minlength=num_experts).to(torch.int32)
    return m_sizes, slot_index // top_k, slot_index


# (tokens, top_k, experts, on_one): ragged with empty experts, one token, all on one expert,
# no tokens
SLOT_CASES = {"ragged": (13, 3, 7, False), "one_token": (1, 2, 4, False), "all_on_one": (9, 1, 3, True),
              "no_tokens": (0, 2, 3, False)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SLOT_CASES))
def test_gather_slots_dx_matches_reference(case, dtype):
    """layer_grouped_gemm's gather_slots (the dX rows stored at their slots and summed K per
    token, no sort) gives the reference's gradients, and the sorted path's."""
    tokens, top_k, num_experts, on_one = SLOT_CASES[case]
    m_sizes, token_index, slot_index = _dropless_routing(tokens, top_k, num_experts, on_one)
    x = torch.randn(tokens, 45, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(num_experts, 37, 45, device=DEVICE) / 45 ** 0.5).to(dtype).requires_grad_()
    dy = torch.randn(tokens * top_k, 37, device=DEVICE).to(dtype)
    grads = {}
    for path, slots in (("slots", slot_index), ("sort", None)):
        y = layer_grouped_gemm(x, w, m_sizes, gather_index=token_index, configs=CONFIGS, backend="triton",
                               gather_slots=slots)
        grads[path] = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.autograd.grad(grouped_gemm_reference(x64, w64, m_sizes, gather_index=token_index), (x64, w64),
                              dy.double())
    for name, got, want, other in zip(("dx", "dw"), grads["slots"], ref, grads["sort"]):
        assert torch.isfinite(got).all(), name
        if tokens:
            assert rel_err(got, want) < TOL[dtype], name
            assert rel_err(got, other) < TOL[dtype], name


@pytest.mark.parametrize("corrupt, match", [
    (lambda s: s.flip(0), "permutation of the 39 slots"),
    (lambda s: s[:-3], "must match gather_index"),
])
def test_gather_slots_that_disagree_with_the_gather_are_rejected(corrupt, match):
    m_sizes, token_index, slot_index = _dropless_routing(13, 3, 7)
    x = torch.randn(13, 45, device=DEVICE)
    w = torch.randn(7, 37, 45, device=DEVICE)
    if DEVICE.type == "cuda":
        pytest.skip("the value checks run on the CPU (or with EP_MOE_DEBUG)")
    with pytest.raises(ValueError, match=match):
        layer_grouped_gemm(x, w, m_sizes, gather_index=token_index, backend="triton",
                           gather_slots=corrupt(slot_index))


def test_tma_only_from_tma_min_rows(monkeypatch):
    """Launches under TMA_MIN_ROWS rows load through pointers even where the config asks for
    TMA (its descriptors cost host time there and the loads were no faster)."""
    import ep_moe.kernels.grouped_gemm as grouped_gemm_module

    monkeypatch.setattr(grouped_gemm_module, "tma_usable", lambda *tensors: True)
    with_tma, without = KernelConfig(use_tma=True), KernelConfig(use_tma=False)
    w = torch.empty(2, 16, 16)
    assert not grouped_gemm_module.use_tma_for(with_tma, TMA_MIN_ROWS - 1, w)
    assert grouped_gemm_module.use_tma_for(with_tma, TMA_MIN_ROWS, w)
    assert not grouped_gemm_module.use_tma_for(without, TMA_MIN_ROWS, w)
