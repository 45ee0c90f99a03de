"""Fused SwiGLU against autograd of ``silu(gate) * up`` in float64."""

import pytest
import torch
import torch.nn.functional as F

from ep_moe.kernels.activation import swiglu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", [(1, 8), (37, 300), (0, 16)])
def test_swiglu_matches_autograd(rows, inter, dtype):
    h = (torch.randn(rows, 2 * inter, device=DEVICE) * 3).to(dtype).requires_grad_()
    a = swiglu(h)
    da = torch.randn_like(a)
    (dh,) = torch.autograd.grad(a, h, da)

    h64 = h.detach().double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    a_ref = F.silu(gate) * up
    (dh_ref,) = torch.autograd.grad(a_ref, h64, da.double())
    assert a.dtype == dtype and a.shape == a_ref.shape
    for got, ref in ((a, a_ref), (dh, dh_ref)):
        if ref.numel():
            assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError, match="\\[rows, 2I\\]"):
        swiglu(torch.randn(4, 7))
