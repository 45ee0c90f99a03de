"""The e4m3 number format as the FP8 kernels write it: its constants, the rounding of fp32
values onto its grid (the same bits on every backend), the scale of a set of values, and the
quantization's definition in PyTorch ops (what the kernels are tested against)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""The largest finite e4m3 value: a row's largest magnitude maps onto it."""
MIN_AMAX = 1e-12
"""An all-zero row's amax is taken as this (its scale stays finite; its values stay 0)."""


@triton.jit
def on_e4m3_grid(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32:
    3 mantissa bits kept in the bits of normal values (a carry may enter the exponent), steps of
    2**-9 below 2**-6 (e4m3's subnormals; a value rounded to zero keeps its sign). The cast that
    follows is then exact, so every backend writes the same bits (Triton's CPU interpreter
    rounds fp8 casts without that carry)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(v) + 24576.0) - 24576.0  # fp32's step at 1.5 * 2**14 is 2**-9
    # the sign kept when rounded to zero: a product, since a GPU build negates as 0 - x (+0 for +0)
    subnormal = magnitude * tl.where(bits < 0, -1.0, 1.0)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def scale_of(amax, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """The scale of values whose largest magnitude is ``amax``: ``max(amax, AMAX_FLOOR)`` times
    fp32(1 / FP8_MAX), a multiplication, rounded alike everywhere (a division by a constant is
    not: torch's CUDA kernels multiply by its reciprocal, Triton's ``/`` is approximate on GPUs)."""
    return tl.maximum(amax, AMAX_FLOOR) * (1.0 / FP8_MAX)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one fp32 scale per row over the last dim of ``x`` (any leading dims), in
    PyTorch ops: the recipe's definition (``scale = max(amax, MIN_AMAX) * (1/448)``, values
    ``x / scale`` rounded to nearest even), for the weights and for tests."""
    amax = x.detach().float().abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX)
    scale = amax * (1.0 / E4M3_MAX)  # the kernels' scale (scale_of), on every device
    return (x.detach().float() / scale).to(E4M3), scale.squeeze(-1)
