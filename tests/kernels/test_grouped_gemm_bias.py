"""The grouped GEMM's per-expert bias (``nn.Linear``'s) against a float64 reference: the
forward, dX, dW, the bias gradient and the row weights' gradient (whose bias share the dX
kernel adds), in every permutation mode; experts with no rows, every row on one expert, one
row, sizes that are multiples of no block; the bias gradient alone (frozen weight), rows
past a bound, the slot-summing down projection, the bias gradient queued with dW under
defer_weight_grads, raw launchers on poisoned outputs, and argument errors.

On the CPU these run in the Triton interpreter (float32, float16); on a GPU in bfloat16 too
(``tests/gpu/test_bias_cuda.py`` adds the shapes users run).
"""

from __future__ import annotations

import pytest
import torch

from ep_moe import grouped_gemm
from ep_moe.ep.pipeline import DeferredWeightGrads
from ep_moe.kernels.grouped_gemm import launch_rows, launch_segment_sum
from ep_moe.kernels.ops import _expert_rows_grads, defer_weight_grads, grouped_gemm_slot_sum
from ep_moe.kernels.reference import grouped_gemm_reference
from test_grouped_gemm import CASES, DEVICE, DTYPES, TOL, configs_for, make_problem, rel_err, row_dot_err
from test_slot_sum import TOP_K, _problem, _unweighted_rows

CONFIGS = configs_for(torch.float32)


def _bias_for(w: torch.Tensor, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(w.shape[0], w.shape[1], generator=gen).to(w.device, w.dtype)


def check_bias_op(case, dtype, gather, scatter, weights, wants=("x", "w", "rw", "bias")):
    """grouped_gemm with a bias on the Triton kernels against autograd of the float64
    reference: the output and the gradients of the inputs in ``wants``."""
    x, w, m_sizes, g, s, rw = make_problem(case, dtype, gather, scatter, weights)
    bias = _bias_for(w)
    inputs = {"x": x, "w": w, "rw": rw, "bias": bias}
    leaves = {name: t.requires_grad_() for name, t in inputs.items() if t is not None and name in wants}
    y = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw, bias=bias,
                     configs=configs_for(dtype), backend="triton")
    dy = torch.randn_like(y)
    grads = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy))) if leaves else {}

    ref = {name: None if t is None else t.detach().double().requires_grad_(name in leaves)
           for name, t in inputs.items()}
    y_ref = grouped_gemm_reference(ref["x"], ref["w"], m_sizes, gather_index=g, scatter_index=s,
                                   row_weights=ref["rw"], bias=ref["bias"])
    grads_ref = dict(zip(leaves, torch.autograd.grad(y_ref, [ref[n] for n in leaves], dy.double())))
    tol = TOL[dtype]
    assert y.dtype == dtype and rel_err(y, y_ref) < tol, "forward"
    for name, got in grads.items():
        assert got.dtype == inputs[name].dtype and torch.isfinite(got).all(), name
        if name == "rw":  # one dot per row: <dy row, unweighted output row (bias included)>
            y0 = grouped_gemm_reference(ref["x"], ref["w"], m_sizes, gather_index=g, scatter_index=s,
                                        bias=ref["bias"])
            assert row_dot_err(got, grads_ref[name], dy, y0) < tol, name
        else:
            assert rel_err(got, grads_ref[name]) < tol, name
    return m_sizes, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_bias_forward_and_every_gradient(case, dtype):
    """Gather, scatter and row weights (the down projection at EP=1 and more)."""
    m_sizes, grads = check_bias_op(case, dtype, gather=True, scatter=True, weights=True)
    if m_sizes.numel():
        empty = m_sizes == 0
        assert not grads["bias"][empty].any() and not grads["w"][empty].any()  # experts with no rows


@pytest.mark.parametrize("gather,scatter,weights", [(False, False, False), (True, False, False),
                                                    (False, True, True), (False, False, True)],
                         ids=["plain", "gate_up", "down", "weights"])
def test_bias_in_each_permutation_mode(gather, scatter, weights):
    check_bias_op("ragged", torch.float32, gather, scatter, weights)


@pytest.mark.parametrize("wants", [("bias",), ("bias", "rw"), ("x", "bias"), ("w",)],
                         ids=["bias", "bias+rw", "x+bias", "w"])
def test_gradients_of_some_inputs(wants):
    """The bias gradient without dW (a frozen weight: a segment sum of the weighted rows),
    and dW without it."""
    check_bias_op("ragged", torch.float32, gather=True, scatter=True, weights=True, wants=wants)


def test_bounded_rows_leave_the_rows_past_the_counts_out_of_the_bias_gradient():
    """Rows past the counts (bounded_rows) add nothing to db, their row-weight gradients are
    0, and the counted rows equal the problem of those rows alone."""
    sizes, extra = [5, 0, 17, 3], 7
    counted, num_rows = sum(sizes), sum(sizes) + extra
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x = torch.randn(20, 45, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 37, 45, device=DEVICE, requires_grad=True)
    bias = torch.randn(4, 37, device=DEVICE, requires_grad=True)
    rw = torch.rand(num_rows, device=DEVICE, requires_grad=True)
    g = torch.randint(0, 20, (num_rows,), device=DEVICE)
    kwargs = dict(configs=CONFIGS, backend="triton", bias=bias)
    dy = torch.randn(num_rows, 37, device=DEVICE)
    grads = {}
    for frozen_w in (False, True):  # dW kernel's db, and the segment sum's
        w.requires_grad_(not frozen_w)
        leaves = [t for t in (x, w, bias, rw) if t.requires_grad]
        y = grouped_gemm(x, w, m_sizes, gather_index=g, row_weights=rw, bounded_rows=True, **kwargs)
        got = torch.autograd.grad(y[:counted], leaves, dy[:counted])
        y_ref = grouped_gemm(x, w, m_sizes, gather_index=g[:counted], row_weights=rw[:counted], **kwargs)
        want = torch.autograd.grad(y_ref, leaves, dy[:counted])
        assert torch.equal(y[:counted], y_ref)
        for a, b in zip(got, want):
            assert rel_err(a, b) < TOL[torch.float32]
        grads[frozen_w] = dict(zip([id(t) for t in leaves], got))
        assert not grads[frozen_w][id(rw)][counted:].any()
    assert rel_err(grads[True][id(bias)], grads[False][id(bias)]) < TOL[torch.float32]


# --- the slot-summing down projection -----------------------------------------------------

def _slot_sum_reference(meta, a, w, row_weights, bias):
    experts = torch.repeat_interleave(torch.arange(w.shape[0], device=a.device), meta.counts_E)
    rows = (_unweighted_rows(meta, a, w) + bias.double()[experts]) * row_weights.double()[:, None]
    out = torch.zeros(meta.num_tokens, w.shape[1], dtype=torch.float64, device=a.device)
    return out.index_add(0, meta.token_index_R, rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,n,k,routing", [(23, 37, 45, "mixed"), (1, 24, 20, "mixed"),
                                                    (9, 24, 20, "one_expert")], ids=["ragged", "one_token", "one_expert"])
def test_slot_sum_with_bias(dtype, num_tokens, n, k, routing):
    """grouped_gemm_slot_sum's bias, its gradient and its share of the row weights' gradient."""
    meta, a, w, row_weights = _problem(dtype, num_tokens, n, k, seed=num_tokens, routing=routing)
    bias = _bias_for(w, seed=1)
    leaves = [t.requires_grad_() for t in (a, w, row_weights, bias)]
    out = grouped_gemm_slot_sum(a, w, meta.counts_E, row_weights, meta.token_index_R, meta.row_of_slot_N, TOP_K,
                                configs_for(dtype), bias=bias)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = _slot_sum_reference(meta, *ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    assert rel_err(out, ref) < TOL[dtype]
    experts = torch.repeat_interleave(torch.arange(w.shape[0], device=DEVICE), meta.counts_E)
    for name, got, want in zip(("a", "w", "row_weights", "bias"), grads, ref_grads):
        if name == "row_weights":
            y_rows = _unweighted_rows(meta, a.detach(), w.detach()) + bias.detach().double()[experts]
            assert row_dot_err(got, want, dy[meta.token_index_R], y_rows) < TOL[dtype], name
        else:
            assert rel_err(got, want) < TOL[dtype], name
    # without dW (frozen weight): the bias gradient from the segment sum
    w.requires_grad_(False)
    out = grouped_gemm_slot_sum(a, w, meta.counts_E, row_weights, meta.token_index_R, meta.row_of_slot_N, TOP_K,
                                configs_for(dtype), bias=bias)
    (db,) = torch.autograd.grad(out, [bias], dy)
    assert rel_err(db, ref_grads[3]) < TOL[dtype]


# --- defer_weight_grads: dW and db queued together -----------------------------------------

@pytest.mark.parametrize("op", ["grouped_gemm", "slot_sum"])
def test_bias_grad_is_queued_with_dw_and_accumulates(op):
    """Inside defer_weight_grads a GEMM with a bias queues one entry for (w, bias), from one
    dW launch; two GEMMs on the same weights sum into one pair of buffers (the kernel's
    accumulate); the result equals the direct backward. A queue that owns the weight but
    not the bias queues nothing (both are computed at once)."""
    meta, a, w, row_weights = _problem(torch.float32, 17, 24, 20, seed=5)
    bias = _bias_for(w, seed=2)
    leaves = [t.requires_grad_() for t in (a, w, bias)]

    def backward():
        for t in leaves:
            t.grad = None
        for scale in (1.0, 0.5):  # two GEMMs on the same weights
            if op == "slot_sum":
                out = grouped_gemm_slot_sum(a, w, meta.counts_E, row_weights * scale, meta.token_index_R,
                                            meta.row_of_slot_N, TOP_K, CONFIGS, bias=bias)
            else:
                out = grouped_gemm(a, w, meta.counts_E, row_weights=row_weights * scale, bias=bias, configs=CONFIGS,
                                   backend="triton")
            out.backward(torch.ones_like(out))

    backward()
    want = [t.grad.clone() for t in leaves]
    queue = DeferredWeightGrads([w, bias])
    with defer_weight_grads(queue):
        backward()
    assert len(queue) == 2 and w.grad is None and bias.grad is None
    assert torch.equal(a.grad, want[0])
    queue.run()
    assert rel_err(w.grad, want[1]) < 1e-6 and rel_err(bias.grad, want[2]) < 1e-6
    queue = DeferredWeightGrads([w])
    with defer_weight_grads(queue):
        backward()
    assert len(queue) == 0 and torch.equal(bias.grad, want[2]) and torch.equal(w.grad, want[1])


# --- raw launchers on poisoned outputs -----------------------------------------------------

def test_launchers_with_bias_write_every_element():
    """Forward with a bias, the dX row dots with its share, and dW with db (empty experts:
    zeros; ``add_to`` adds to what dw and db hold), on NaN-poisoned outputs."""
    x, w, m_sizes, g, s, rw = make_problem("ragged", torch.float32, True, True, True)
    bias = _bias_for(w)
    num_rows, n, k = g.shape[0], w.shape[1], w.shape[2]
    sizes = m_sizes.tolist()
    experts = torch.repeat_interleave(torch.arange(len(sizes), device=DEVICE), m_sizes.long())
    x64, w64, b64 = x.double(), w.double(), bias.double()
    ref_rows = torch.einsum("rk,rnk->rn", x64[g], w64[experts]) + b64[experts]

    out = torch.full((num_rows, n), float("nan"), device=DEVICE)
    launch_rows(x, w, out, m_sizes, CONFIGS.forward, transpose_w=True, load_idx=g, store_idx=s, scale=rw, bias=bias)
    expected = torch.empty_like(ref_rows)
    expected[s] = ref_rows * rw.double()[s, None]
    assert rel_err(out, expected) < TOL[torch.float32]

    dy = torch.randn(num_rows, n, device=DEVICE)
    a_rows = torch.randn(num_rows, k, device=DEVICE)  # the forward's input rows, one per routed row
    dx_rows = torch.full((num_rows, k), float("nan"), device=DEVICE)
    dots = launch_rows(dy, w, dx_rows, m_sizes, CONFIGS.dx, transpose_w=False, dot_with=a_rows, bias=bias)
    want_dots = (dy.double() * (torch.einsum("rk,rnk->rn", a_rows.double(), w64[experts]) + b64[experts])).sum(1)
    assert rel_err(dots, want_dots) < TOL[torch.float32]
    assert rel_err(dx_rows, torch.einsum("rn,rnk->rk", dy.double(), w64[experts])) < TOL[torch.float32]

    dw, db = _expert_rows_grads(dy, a_rows, w, m_sizes, CONFIGS.dw, bias)  # new tensors (torch.empty)
    want_db = torch.zeros_like(b64).index_add(0, experts, dy.double())
    assert torch.isfinite(db).all() and rel_err(db, want_db) < TOL[torch.float32]
    assert torch.equal(db[1], torch.zeros_like(db[1]))  # expert 1 has no rows
    want_dw = torch.zeros_like(w64).index_add(0, experts, torch.einsum("rn,rk->rnk", dy.double(), a_rows.double()))
    assert rel_err(dw, want_dw) < TOL[torch.float32]
    held = dw.clone(), db.clone()
    _expert_rows_grads(dy, a_rows, w, m_sizes, CONFIGS.dw, bias, add_to=(dw, db))
    assert rel_err(dw, 2 * held[0].double()) < TOL[torch.float32] and rel_err(db, 2 * held[1].double()) < TOL[torch.float32]


@pytest.mark.parametrize("rows_per_step", [1, 4, 32])
def test_segment_sum_rows_per_step(rows_per_step):
    """Segment sums with 1, 4 and 32 rows a step against float64: empty segments, one row,
    lengths that are multiples of no step, one long segment; equal results every run."""
    lengths = [0, 1, 7, 33, 0, 130, 5]
    offsets = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    src = torch.randn(sum(lengths), 200, device=DEVICE)
    out = torch.full((len(lengths), 200), float("nan"), device=DEVICE)
    launch_segment_sum(src, offsets, out, rows_per_step=rows_per_step)
    want = torch.stack([src.double()[int(a):int(b)].sum(0) for a, b in zip(offsets[:-1], offsets[1:])])
    assert rel_err(out, want) < TOL[torch.float32]
    again = torch.empty_like(out)
    launch_segment_sum(src, offsets, again, rows_per_step=rows_per_step)
    assert torch.equal(out, again)


# --- argument errors -------------------------------------------------------------------------

@pytest.mark.parametrize("bias,pattern", [
    (lambda w: w[:, :, 0].tolist(), r"bias must be a torch.Tensor"),
    (lambda w: torch.zeros(w.shape[1]), r"bias must be \[E, N\] = \[4, 37\].*stack the experts' nn.Linear biases"),
    (lambda w: torch.zeros(w.shape[:2], dtype=torch.float64), r"bias dtype torch.float64 does not match w dtype "
                                                               r"torch.float32; cast it with bias.to\(w.dtype\)"),
    (lambda w: torch.zeros(w.shape[:2], device="meta"), r"bias is on meta but w is on .*bias.to\(w.device\)"),
], ids=["list", "shape", "dtype", "device"])
def test_bias_errors_name_the_fix(bias, pattern):
    x, w, m_sizes, g, s, rw = make_problem("ragged", torch.float32, True, True, True)
    with pytest.raises((TypeError, ValueError), match=pattern):
        grouped_gemm(x, w, m_sizes, gather_index=g, bias=bias(w), backend="torch")
    meta, a, w, row_weights = _problem(torch.float32, 5, 37, 20, seed=0)
    with pytest.raises((TypeError, ValueError), match=pattern):
        grouped_gemm_slot_sum(a, w, meta.counts_E, row_weights, meta.token_index_R, meta.row_of_slot_N, TOP_K,
                              CONFIGS, bias=bias(w))


def test_dx_bias_needs_row_dots():
    x, w, m_sizes, _, _, _ = make_problem("ragged", torch.float32, False, False, False)
    dy = torch.randn(x.shape[0], w.shape[1], device=DEVICE)
    with pytest.raises(ValueError, match="a bias in the dX pass only adds to the row dots; pass dot_with"):
        launch_rows(dy, w, torch.empty_like(x), m_sizes, CONFIGS.dx, transpose_w=False, bias=_bias_for(w))


def test_custom_ops_take_the_bias():
    """Under torch.compile the kernels run through the custom ops, the bias and its
    gradient with them: the same numbers as eager (aot_eager keeps the ops opaque)."""
    x, w, m_sizes, g, s, rw = make_problem("ragged", torch.float32, True, True, True)
    bias = _bias_for(w)

    def f(x, w, bias, rw):
        y = grouped_gemm(x, w, m_sizes, gather_index=g, scatter_index=s, row_weights=rw, bias=bias,
                         configs=CONFIGS, backend="triton")
        return torch.nn.functional.silu(y)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves, leaves_c = ([t.clone().requires_grad_() for t in (x, w, bias, rw)] for _ in range(2))
    eager, got = f(*leaves), compiled(*leaves_c)
    assert torch.equal(got, eager)
    dy = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, leaves, dy), torch.autograd.grad(got, leaves_c, dy)):
        assert torch.equal(a, b)
