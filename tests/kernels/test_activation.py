"""Fused SwiGLU and GeGLU against autograd of ``act(gate) * up`` in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from ep_moe.kernels.activation import ClampedSwiGLU, _launch, geglu, swiglu
from ep_moe.kernels.grouped_gemm import row_block_programs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("fused,act", [(swiglu, F.silu), (geglu, F.gelu)], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", [(1, 8), (37, 300), (0, 16)])
def test_gated_matches_autograd(rows, inter, dtype, fused, act):
    h = (torch.randn(rows, 2 * inter, device=DEVICE) * 3).to(dtype).requires_grad_()
    a = fused(h)
    da = torch.randn_like(a)
    (dh,) = torch.autograd.grad(a, h, da)

    h64 = h.detach().double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    a_ref = act(gate) * up
    (dh_ref,) = torch.autograd.grad(a_ref, h64, da.double())
    assert a.dtype == dtype and a.shape == a_ref.shape
    for got, ref in ((a, a_ref), (dh, dh_ref)):
        if ref.numel():
            assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError, match="\\[rows, 2I\\]"):
        swiglu(torch.randn(4, 7))


@pytest.mark.parametrize("used_share", [0.0, 1e-9, 0.7, 1.0])
def test_swiglu_with_a_device_row_count(used_share):
    """num_rows (device count, as the grouped GEMM's bounded_rows): the first rows forward and
    backward as without it, the rest neither written nor read. There are more row blocks
    than the limited grid's programs, so the programs stride."""
    inter = 16  # one column block
    rows = 16 * row_block_programs(1 << 30, 1, DEVICE, limited=True) + 300  # more row blocks than programs
    used = math.ceil(used_share * rows)
    h = torch.randn(rows, 2 * inter, device=DEVICE).requires_grad_()
    count = torch.tensor(used, device=DEVICE)
    a = swiglu(h, count)
    da = torch.randn_like(a)
    (dh,) = torch.autograd.grad(a, h, da)
    h_used = h[:used].detach().requires_grad_()
    a_ref = swiglu(h_used)
    (dh_ref,) = torch.autograd.grad(a_ref, h_used, da[:used])
    assert torch.equal(a[:used], a_ref) and torch.equal(dh[:used], dh_ref)
    # past the count: the output keeps what was there, and NaN inputs there are never read
    h_nan = h.detach().clone()
    h_nan[used:] = float("nan")
    out = torch.full((rows, inter), -7.0, device=DEVICE)
    _launch(h_nan, None, out, count)
    assert torch.equal(out[:used], a_ref) and bool((out[used:] == -7.0).all())
    grad = torch.full_like(h_nan, -7.0)
    _launch(h_nan, da.detach().clone().index_fill_(0, torch.arange(used, rows, device=DEVICE), float("nan")),
            grad, count)
    assert torch.equal(grad[:used], dh[:used]) and bool((grad[used:] == -7.0).all())


def test_swiglu_rejects_a_bad_row_count():
    with pytest.raises(ValueError, match="num_rows must be a one-element integer tensor.*m_sizes.sum"):
        swiglu(torch.randn(4, 8, device=DEVICE), torch.tensor([1.0, 2.0], device=DEVICE))


def test_integer_input_is_refused():
    with pytest.raises(ValueError, match="swiglu expects floating-point activations, got torch.int32"):
        swiglu(torch.ones(2, 4, dtype=torch.int32))


def _gpt_oss_gate(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate, written out: the oracle of ClampedSwiGLU."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", [(1, 8), (37, 300)])
def test_clamped_swiglu_matches_gpt_oss_gate(rows, inter, dtype):
    """GPT-OSS's gate (interleaved, clamped, alpha, up + 1) fused, forward and backward,
    against autograd of transformers' formula in float64; a third of the values past the
    limits (clamped: no gradient there), a few exactly at them (the gradient passes)."""
    alpha, limit = 1.702, 1.5
    h = torch.randn(rows, 2 * inter, device=DEVICE) * 2
    h.view(-1)[::7] = limit
    h = h.to(dtype).requires_grad_()
    form = ClampedSwiGLU(alpha=alpha, clamp_at=limit)
    a = form.fused(h)
    da = torch.randn_like(a)
    (dh,) = torch.autograd.grad(a, h, da)
    h64 = h.detach().double().requires_grad_()
    a_ref = _gpt_oss_gate(h64, alpha, limit)
    (dh_ref,) = torch.autograd.grad(a_ref, h64, da.double())
    for got, ref in ((a, a_ref), (dh, dh_ref)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
    assert torch.equal(dh[h.detach() > limit], torch.zeros_like(dh[h.detach() > limit]))
    torch.testing.assert_close(form.reference(h64), a_ref, rtol=0, atol=0)


@pytest.mark.parametrize("act, form", [("silu", None), ("gelu", None),
                                       ("silu", ClampedSwiGLU(alpha=1.702, clamp_at=0.5)),
                                       ("gelu", ClampedSwiGLU(clamp_at=0.3, interleaved=False, up_offset=0.5))],
                         ids=["swiglu", "geglu", "gpt-oss", "clamped-gelu"])
def test_compiled_gate_is_the_kernels_math(act, form):
    """Under ``torch.compile`` the gate is torch math (no graph break): the same output and
    input gradient as the Triton kernel, clamps and all."""
    from ep_moe.kernels.activation import gated

    h = (torch.randn(37, 2 * 24) * 2).requires_grad_()
    call = (lambda t: gated(t, act)) if form is None else (lambda t: gated(t, act, form=form))
    dy = torch.randn(37, 24)
    eager = call(h)
    (eager_dh,) = torch.autograd.grad(eager, h, dy)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(h)
    (compiled_dh,) = torch.autograd.grad(compiled, h, dy)
    torch._dynamo.reset()
    assert torch.allclose(compiled, eager, atol=1e-5, rtol=1e-5)
    assert torch.allclose(compiled_dh, eager_dh, atol=1e-5, rtol=1e-5)
    assert eager_dh.abs().max() > 0
