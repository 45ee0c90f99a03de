"""FP8 (e4m3) grouped GEMM (``ep_moe.kernels.fp8``): the row quantization (with the gather
fused; rows in one block and in two passes) and the weight's quantization (both layouts)
against the recipe's PyTorch definition, bit for bit; the forward and dX against a float64
product of the same quantized operands; dW (bf16) against float64; the down projection's
form (rows scattered, times their row weights, plus a bias, and the gradients of both; fp32
master weights) likewise, gathered rows entering the backward as their e4m3 values; the whole against the unquantized product within the recipe's
bound; the weight's quantized copies made once per version; argument errors. Experts with no
rows, every row on one expert, one row, sizes that are multiples of no block.

On the CPU these run in the Triton interpreter (float16); on a GPU in bfloat16 too, with the
FP8 tensor cores (``tests/gpu/test_fp8_layer_cuda.py`` runs the layer with FP8 experts;
``bench_grouped_gemm.py --fp8`` times it).
"""

from __future__ import annotations

import pytest
import torch

from ep_moe.kernels.e4m3 import E4M3, E4M3_MAX, MIN_AMAX, quantize_rows_reference
from ep_moe.kernels.fp8 import (QUANTIZE_ROW_ELEMENTS, QuantizedRows, dequantize_rows, fp8_supported, grouped_gemm_fp8,
                                quantize_rows, quantize_weight, quantized_weight)
from ep_moe.kernels.reference import grouped_gemm_reference
from test_grouped_gemm import CASES, DEVICE, ON_GPU, rel_err

DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Relative Frobenius error of a product of the same quantized operands: fp32 accumulation
# (FP8 tensor cores accumulate with fewer bits: the GPU's margin), one rounding to the output dtype.
SAME_QUANT_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
E4M3_BOUND = 6e-2
"""Relative Frobenius error of the FP8 product against the unquantized one, on Gaussian
operands: each e4m3 value carries 3 mantissa bits (rounding error up to 2**-4 of it,
about 2.5% on average), in both operands; measured 3.5-4.5e-2."""

pytestmark = pytest.mark.skipif(not fp8_supported(DEVICE)[0], reason=fp8_supported(DEVICE)[1] or "no FP8")


def _problem(case: str, dtype: torch.dtype, gather: bool, seed: int = 0):
    sizes, n, k = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    tokens = max(1, (rows * 2) // 3) if gather else rows
    x = torch.randn(tokens, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(len(sizes), n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    g = torch.randint(0, tokens, (rows,), generator=gen).to(DEVICE, torch.int32) if gather else None
    return x, w, m_sizes, g


def _dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.double() * scale.double().unsqueeze(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gather", [False, True], ids=["sorted", "gathered"])
@pytest.mark.parametrize("k", [1100, QUANTIZE_ROW_ELEMENTS + 100], ids=["one_block", "two_passes"])
def test_quantize_rows_is_the_recipe_bit_for_bit(dtype, gather, k):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, k, generator=gen).to(DEVICE, dtype)  # K a multiple of no block
    x[3] = 0  # an all-zero row: a finite scale, zeros out
    x[5, 7] = 300.0  # one large value sets its row's scale
    g = torch.randint(0, 37, (50,), generator=gen).to(DEVICE, torch.int32) if gather else None
    q, scale = quantize_rows(x, g)
    rows = x[g.long()] if gather else x
    q_ref, scale_ref = quantize_rows_reference(rows)
    assert q.dtype == E4M3 and q.shape == rows.shape and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert q.float().abs().amax(1).max() <= E4M3_MAX
    zero_rows = (rows == 0).all(1)
    assert torch.equal(scale[zero_rows], torch.full_like(scale[zero_rows], MIN_AMAX) * (1.0 / E4M3_MAX))
    assert (q.float()[zero_rows] == 0).all()
    err = (_dequantized(q, scale) - rows.double()).abs() / rows.double().abs().amax(1, keepdim=True).clamp_min(1e-30)
    assert err.max() <= 2.0**-4  # half an e4m3 step at the top binade: 2**-4 of the row's amax
    empty_q, empty_scale = quantize_rows(x, torch.empty(0, dtype=torch.int32, device=DEVICE))
    assert empty_q.shape == (0, k) and empty_scale.shape == (0,)


@pytest.mark.parametrize("limit", [0, 9, 50, 80], ids=lambda n: f"limit{n}")
def test_quantize_rows_writes_only_the_rows_below_a_limit(limit):
    """A count on the device (the all-to-all sender's sent rows): rows below it as without
    one, into a strided buffer (a message's rows); the rest untouched."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 45, generator=gen).to(DEVICE, torch.float16)
    g = torch.randint(0, 37, (50,), generator=gen).to(DEVICE)
    buffer = torch.full((50, 64), 0x55, dtype=torch.uint8, device=DEVICE)
    values, scales = quantize_rows(x, g, values_out=buffer[:, :45].view(E4M3),
                                   limit=torch.tensor(limit, device=DEVICE))
    ref_values, ref_scales = quantize_rows_reference(x[g])
    done = min(limit, 50)
    assert torch.equal(values[:done].view(torch.uint8), ref_values[:done].view(torch.uint8))
    assert torch.equal(scales[:done], ref_scales[:done])
    assert (buffer[done:] == 0x55).all() and (buffer[:, 45:] == 0x55).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gather", [False, True], ids=["in_order", "gathered"])
@pytest.mark.parametrize("limit", [None, 0, 23, 80], ids=lambda n: f"limit{n}")
def test_dequantize_rows_is_the_fp32_product_rounded_once(dtype, gather, limit):
    """e4m3 rows (strided, as in a message) times their scales, each rounded once from fp32 to
    the compute dtype, gathered in the same pass (the FP8 dW's tokens); with a limit, the
    rows past it unwritten (never read: bounded rows)."""
    gen = torch.Generator().manual_seed(5)
    buffer = torch.zeros((37, 64), dtype=torch.uint8, device=DEVICE)
    rows = quantize_rows(torch.randn(37, 45, generator=gen).to(DEVICE, dtype) * 30,
                         values_out=buffer[:, 3:48].view(E4M3))
    index = torch.randint(0, 37, (50,), generator=gen).to(DEVICE, torch.int32) if gather else None
    limit_t = None if limit is None else torch.tensor(limit, device=DEVICE)
    out = dequantize_rows(rows, dtype, index, limit_t)
    ref = (rows.values.float() * rows.scales[:, None]).to(dtype)
    ref = ref[index.long()] if gather else ref
    done = ref.shape[0] if limit is None else min(limit, ref.shape[0])
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
    assert torch.equal(out[:done], ref[:done])
    assert dequantize_rows(QuantizedRows(rows.values[:0], rows.scales[:0]), dtype).shape == (0, 45)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=str)
def test_quantize_weight_is_the_recipe_bit_for_bit_in_both_layouts(dtype):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 70, 45, generator=gen).to(DEVICE, dtype)  # N and K multiples of no block
    w[0, 4] = 0  # an all-zero row of the forward layout
    w[1, :, 9] = 0  # an all-zero row of the dX layout
    w[2, 6, 8] = 200.0  # one large value sets a row's and a column's scale
    w[2, 7, 9] = -1e-6  # rounds to a negative zero
    (q, scale), (q_t, scale_t) = quantize_weight(w)
    for (values, scales), layout in (((q, scale), w), ((q_t, scale_t), w.transpose(1, 2))):
        ref_values, ref_scales = quantize_rows_reference(layout)
        assert values.dtype == E4M3 and values.shape == layout.shape and values.is_contiguous()
        assert torch.equal(scales, ref_scales)
        assert torch.equal(values.view(torch.uint8), ref_values.contiguous().view(torch.uint8))
    assert torch.equal(scale[0, 4], torch.tensor(MIN_AMAX, device=DEVICE) * (1.0 / E4M3_MAX))
    assert torch.equal(scale_t[1, 9], torch.tensor(MIN_AMAX, device=DEVICE) * (1.0 / E4M3_MAX))
    (empty, empty_scale), _ = quantize_weight(w[:, :0])
    assert empty.shape == (3, 0, 45) and empty_scale.shape == (3, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gather", [False, True], ids=["sorted", "gathered"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_product_and_gradients_match_float64_of_the_same_quantization(case, gather, dtype):
    x, w, m_sizes, g = _problem(case, dtype, gather)
    x.requires_grad_()
    w.requires_grad_()
    y = grouped_gemm_fp8(x, w, m_sizes, gather_index=g)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype and y.shape == (m_sizes.sum().item(), w.shape[1])

    rows = x.detach()[g.long()] if gather else x.detach()
    xq = _dequantized(*quantize_rows_reference(rows))
    wq = _dequantized(*quantize_rows_reference(w.detach()))
    tol = SAME_QUANT_TOL[dtype]
    y_ref = grouped_gemm_reference(xq, wq, m_sizes)
    assert rel_err(y, y_ref) < tol, "forward"

    dyq = _dequantized(*quantize_rows_reference(dy))
    wtq = _dequantized(*quantize_rows_reference(w.detach().transpose(1, 2))).transpose(1, 2)
    dx_rows = grouped_gemm_reference(dyq, wtq.transpose(1, 2), m_sizes)  # dy @ w[e], w quantized per (e, k)
    dx_ref = torch.zeros(x.shape, dtype=torch.float64, device=DEVICE)
    dx_ref.index_add_(0, g.long(), dx_rows) if gather else dx_ref.copy_(dx_rows)
    assert rel_err(dx, dx_ref) < tol, "dx"

    ends = torch.cumsum(m_sizes.long(), 0).tolist()
    dw_rows = xq.to(dtype) if gather else rows  # gathered: the rows' e4m3 values (the module's recipe)
    dw_ref = torch.stack([dy[e0:e1].double().T @ dw_rows[e0:e1].double()
                          for e0, e1 in zip([0] + ends[:-1], ends)])
    assert rel_err(dw, dw_ref) < tol, "dw"
    if m_sizes.sum() == 0:
        assert (dw == 0).all() and (dx == 0).all()


@pytest.mark.parametrize("master", [False, True], ids=["w_like_x", "w_fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_scatter_row_weights_and_bias_match_float64_of_the_same_quantization(case, master):
    """The down projection's form: rows scattered to their slots, times their top-k weights,
    plus each expert's bias; the gradients of x, w, the row weights (the dX product's row dots
    with x, plus dy . bias) and the bias; w as fp32 master weights too (quantized as they are,
    their gradients fp32)."""
    dtype = torch.float16
    x, w, m_sizes, g = _problem(case, dtype, gather=True, seed=4)
    gen = torch.Generator().manual_seed(5)
    rows = g.shape[0]
    w = (w.float() if master else w).requires_grad_()
    bias = (torch.randn(w.shape[:2], generator=gen) * 0.5).to(DEVICE, w.dtype).requires_grad_()
    scatter = torch.randperm(rows, generator=gen).to(DEVICE)
    row_weights = torch.rand(rows, generator=gen).to(DEVICE).requires_grad_()
    x.requires_grad_()
    y = grouped_gemm_fp8(x, w, m_sizes, gather_index=g, scatter_index=scatter, row_weights=row_weights, bias=bias)
    dy = torch.randn(y.shape, generator=gen).to(DEVICE, dtype)
    dx, dw, drw, db = torch.autograd.grad(y, (x, w, row_weights, bias), dy)
    assert y.dtype == dx.dtype == dtype and dw.dtype == db.dtype == w.dtype and drw.dtype == torch.float32

    expert = torch.repeat_interleave(torch.arange(w.shape[0], device=DEVICE), m_sizes.long())
    x_rows, b_rows = x.detach()[g.long()].double(), bias.detach().double()[expert]
    rw, dy_rows = row_weights.detach().double()[scatter], dy.double()[scatter]  # in routed order
    wq = _dequantized(*quantize_rows_reference(w.detach()))  # [E, N, K]
    wtq = _dequantized(*quantize_rows_reference(w.detach().transpose(1, 2)))  # [E, K, N]
    xq, dyq = _dequantized(*quantize_rows_reference(x_rows)), _dequantized(*quantize_rows_reference(dy_rows))
    forward = torch.empty(y.shape, dtype=torch.float64, device=DEVICE)  # in routed order
    product = torch.empty(x_rows.shape, dtype=torch.float64, device=DEVICE)
    for e in range(w.shape[0]):  # one expert's rows at a time: a weight per row would not fit the GPU
        mine = expert == e
        forward[mine], product[mine] = xq[mine] @ wq[e].T, dyq[mine] @ wtq[e].T
    y_ref = torch.empty(y.shape, dtype=torch.float64, device=DEVICE)
    y_ref[scatter] = rw[:, None] * (forward + b_rows)
    dx_ref = torch.zeros(x.shape, dtype=torch.float64, device=DEVICE).index_add_(0, g.long(), rw[:, None] * product)
    drw_ref = torch.empty(rows, dtype=torch.float64, device=DEVICE)
    x_read = xq.to(dtype).double()  # what the backward reads of the gathered rows: their e4m3 values
    drw_ref[scatter] = (product * x_read).sum(1) + (dy_rows * b_rows).sum(1)
    weighted = rw[:, None] * dy_rows
    dw_ref = torch.zeros(w.shape, dtype=torch.float64, device=DEVICE)
    for e in range(w.shape[0]):
        mine = expert == e
        dw_ref[e] = weighted[mine].T @ x_read[mine]
    db_ref = torch.zeros(bias.shape, dtype=torch.float64, device=DEVICE).index_add_(0, expert, weighted)
    tol = SAME_QUANT_TOL[dtype]
    for what, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref), ("drw", drw, drw_ref),
                            ("db", db, db_ref)):
        assert rel_err(got, want) < tol or ((want == 0).all() and (got == 0).all()), what


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_product_stays_within_the_recipes_bound_of_the_unquantized_one(dtype):
    x, w, m_sizes, g = _problem("ragged", dtype, gather=True, seed=3)
    y = grouped_gemm_fp8(x, w, m_sizes, gather_index=g)
    err = rel_err(y, grouped_gemm_reference(x.double(), w.double(), m_sizes, gather_index=g))
    assert 1e-2 < err < E4M3_BOUND  # quantized (not silently bf16), within the bound


def test_weights_are_quantized_once_per_version():
    _, w, _, _ = _problem("ragged", torch.float16, gather=False)
    first = quantized_weight(w)
    assert quantized_weight(w) is first  # a second call of the same step
    with torch.no_grad():
        w.mul_(2)  # an optimizer step updates in place
    second = quantized_weight(w)
    assert second is not first
    assert torch.equal(second.forward[1], 2 * first.forward[1])
    assert second.dx[0].shape == (w.shape[0], w.shape[2], w.shape[1]) and second.dx[0].is_contiguous()
    stored = w.detach().transpose(1, 2).contiguous()  # a transposed layout, read as a view made per call
    third = quantized_weight(stored.transpose(1, 2))
    assert quantized_weight(stored.transpose(1, 2)) is third  # keyed on the base and the view's geometry
    assert torch.equal(third.forward[0].view(torch.uint8), second.forward[0].view(torch.uint8))
    assert quantized_weight(stored) is not third  # the base itself is another layout


def test_bad_arguments_are_named():
    x, w, m_sizes, _ = _problem("ragged", torch.float16, gather=False)
    with pytest.raises(TypeError, match="x must be bfloat16 or float16 and w of x's dtype or float32"):
        grouped_gemm_fp8(x.float(), w.float(), m_sizes)
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\]"):
        grouped_gemm_fp8(x, w[:, :, :-1], m_sizes)
    with pytest.raises(ValueError, match="m_sizes must be int32"):
        grouped_gemm_fp8(x, w, m_sizes.long())


def test_devices_without_fp8_say_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fp8_supported(torch.device("cpu")) == (True, "")  # the kernels run in the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = fp8_supported(torch.device("cpu"))
    assert not ok and "CUDA GPUs with FP8 tensor cores" in why
