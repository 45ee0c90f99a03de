"""FP8 rows on the wire (``ep_moe.ep.fp8_wire``): the message (each row's fp32 scale, then
its e4m3 values 16-byte aligned; about half the bytes of a bf16 row at real widths) carries
the recipe's rows bit for bit (also read through a gather), and the FP8 GEMM on arrived rows (a placeholder standing for
them in autograd, its values never read) equals the GEMM that quantizes the rows itself:
output and every gradient, bit for bit. Rows: none, one, an all-zero one, widths that are
multiples of no block. The layer at EP=2 on gloo with FP8 experts is in
``tests/test_fp8_layer.py``.
"""

from __future__ import annotations

import pytest
import torch

from ep_moe.ep.fp8_wire import HEADER_BYTES, pack_fp8_rows, rows_placeholder, unpack_fp8_rows, wire_width
from ep_moe.kernels.e4m3 import E4M3, quantize_rows_reference
from ep_moe.kernels.fp8 import QuantizedRows, fp8_supported, layer_grouped_gemm_fp8

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])

pytestmark = pytest.mark.skipif(not fp8_supported(DEVICE)[0], reason=fp8_supported(DEVICE)[1] or "no FP8")


@pytest.mark.parametrize("hidden", [1, 50, 64])
@pytest.mark.parametrize("num_rows", [0, 1, 7])
def test_message_carries_the_recipes_rows_bit_for_bit(num_rows, hidden):
    gen = torch.Generator().manual_seed(num_rows * 100 + hidden)
    x = torch.randn(num_rows, hidden, generator=gen).to(DEVICE, torch.float16)
    if num_rows > 1:
        x[1] = 0  # an all-zero row: a finite scale, zeros out
    message = pack_fp8_rows(x)
    width = wire_width(hidden)
    assert message.dtype == torch.uint8 and message.shape == (num_rows, width)
    assert width % 16 == 0 and HEADER_BYTES + hidden <= width < HEADER_BYTES + hidden + 16
    rows = unpack_fp8_rows(message.clone(), hidden)  # as it arrives: in another buffer
    values, scales = quantize_rows_reference(x)
    assert rows.values.dtype == E4M3 and rows.values.shape == (num_rows, hidden)
    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(rows.scales, scales) and rows.scales.is_contiguous()
    if num_rows:
        assert rows.values.stride() == (width, 1) and rows.values.data_ptr() % 16 == 0


def test_message_quantizes_through_the_gather():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 50, generator=gen).to(DEVICE, torch.float16)
    gather = torch.tensor([4, 4, 0, 8, 2], dtype=torch.int64, device=DEVICE)  # a row twice, some never
    rows = unpack_fp8_rows(pack_fp8_rows(x, gather), 50)
    values, scales = quantize_rows_reference(x[gather])
    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8)) and torch.equal(rows.scales, scales)
    assert pack_fp8_rows(x, gather[:0]).shape == (0, wire_width(50))


def test_rows_take_about_half_the_bytes_of_bf16_at_real_widths():
    for hidden in (2048, 2880, 4096, 7168):  # qwen3-30b-a3b, gpt-oss, mixtral, deepseek-v3
        assert wire_width(hidden) <= 0.51 * 2 * hidden


def test_a_message_of_another_width_is_refused():
    with pytest.raises(ValueError, match=r"uint8 \[rows, 64\], got torch.uint8 \(3, 80\)"):
        unpack_fp8_rows(torch.zeros(3, 80, dtype=torch.uint8), 48)


def _problem(dtype: torch.dtype, sizes: list[int], seed: int = 0):
    """The single-Linear form of the layer's GEMM, which reads the tokens and does all there
    is to do: tokens gathered, rows scattered, times their top-k weights, plus a bias."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 37, 45  # multiples of no block
    rows = sum(sizes)
    tokens = max(1, (rows * 2) // 3)
    x = torch.randn(tokens, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(len(sizes), n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    bias = (torch.randn(len(sizes), n, generator=gen) * 0.5).to(DEVICE, dtype)
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    gather = torch.randint(0, tokens, (rows,), generator=gen).to(DEVICE, torch.int32)
    scatter = torch.randperm(rows, generator=gen).to(DEVICE)
    row_weights = torch.rand(rows, generator=gen).to(DEVICE)
    dy = torch.randn(rows, n, generator=gen).to(DEVICE, dtype)
    return x, w, bias, m_sizes, gather, scatter, row_weights, dy


def _run(x, w, bias, m_sizes, gather, scatter, row_weights, dy, quantized_rows=None):
    """Output and gradients (x, w, row weights, bias) of the GEMM."""
    w, bias, row_weights = (t.detach().clone().requires_grad_() for t in (w, bias, row_weights))
    x = x.detach().requires_grad_()
    y = layer_grouped_gemm_fp8(x, w, m_sizes, gather_index=gather, scatter_index=scatter, row_weights=row_weights,
                               bias=bias, quantized_rows=quantized_rows)
    return (y, *torch.autograd.grad(y, (x, w, row_weights, bias), dy))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [0, 23, 0], [0, 1]], ids=["ragged", "all_on_one", "one_row"])
def test_gemm_on_arrived_rows_equals_the_gemm_that_quantizes_them(dtype, sizes):
    x, *rest = _problem(dtype, sizes)
    want = _run(x, *rest)
    arrived = unpack_fp8_rows(pack_fp8_rows(x).clone(), x.shape[1])
    placeholder = rows_placeholder(x.shape[0], x.shape[1], dtype, DEVICE)
    assert placeholder.shape == x.shape and placeholder.dtype == dtype
    unread = torch.full((1, x.shape[1]), float("nan"), dtype=dtype, device=DEVICE).expand(x.shape)
    for stand_in in (placeholder, unread):  # its values are never read
        got = _run(stand_in, *rest, quantized_rows=arrived)
        for what, a, b in zip(("y", "dx", "dw", "drw", "db"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), what


def test_rows_that_cannot_stand_for_x_are_refused():
    x, w, bias, m_sizes, gather, *_ = _problem(torch.float16, [5, 0, 17, 3])
    rows = unpack_fp8_rows(pack_fp8_rows(x), x.shape[1])
    for bad in (QuantizedRows(rows.values[:-1], rows.scales[:-1]),  # another shape
                QuantizedRows(rows.values.view(torch.uint8), rows.scales),  # not e4m3
                QuantizedRows(rows.values, rows.scales.double())):  # not fp32 scales
        with pytest.raises(ValueError, match="quantized_rows must be .* values of x's shape .* as quantize_rows "
                                             "makes them"):
            layer_grouped_gemm_fp8(x, w, m_sizes, gather_index=gather, quantized_rows=bad)
    with pytest.raises(ValueError, match="quantized_rows are token rows the GEMM gathers; pass their gather_index"):
        layer_grouped_gemm_fp8(x[:25], w, m_sizes, quantized_rows=QuantizedRows(rows.values[:25], rows.scales[:25]))


def test_dx_alone_reads_no_rows(monkeypatch):
    """Frozen experts and top-k weights: the backward needs x's shape only, and dequantizes
    nothing."""
    x, w, bias, m_sizes, gather, scatter, row_weights, dy = _problem(torch.float16, [5, 0, 17, 3])
    want = _run(x, w, bias, m_sizes, gather, scatter, row_weights, dy)[1]
    monkeypatch.setattr("ep_moe.kernels.fp8.dequantize_rows", lambda *args: pytest.fail("rows dequantized"))
    x = x.detach().requires_grad_()
    y = layer_grouped_gemm_fp8(x, w, m_sizes, gather_index=gather, scatter_index=scatter, row_weights=row_weights,
                               bias=bias)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, want)
