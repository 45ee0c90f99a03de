"""FP8 rows on the wire: with FP8 experts (``MoEConfig(expert_precision="fp8")``) the EP
dispatches (all-to-all, all-gather) send each token row as its e4m3 values and its fp32
scale, about half the bytes of a bf16 row. The sender quantizes the row as the receiver's up
projection would (one scale per row, :func:`ep_moe.kernels.fp8.quantize_rows`), and that GEMM
reads the arrived rows as they are, so the results are those of rows sent in the compute
dtype (:mod:`ep_moe.kernels.fp8`: the up projection's weight gradient reads the e4m3 rows at
every EP size). The combine, and the backward's gradients both ways, stay in the compute
dtype.

A row on the wire is :data:`HEADER_BYTES` (its fp32 scale, then padding, so that the values
start 16-byte aligned), then its H e4m3 values, padded to a multiple of 16 bytes
(:func:`wire_width`). In the expert graph the arrived rows are a placeholder of the compute
dtype (:func:`rows_placeholder`), whose gradient goes back to the senders as a bf16 row's
would.
"""

from __future__ import annotations

import torch

from ep_moe.ep.base import round_up
from ep_moe.kernels.e4m3 import E4M3
from ep_moe.kernels.fp8 import QuantizedRows, quantize_rows

HEADER_BYTES = 16
"""Bytes before a row's values: its fp32 scale, then padding."""
_ALIGN = 16


def wire_width(hidden: int) -> int:
    """Bytes of one row of ``hidden`` values on the wire."""
    return HEADER_BYTES + round_up(hidden, _ALIGN)


def _values(message: torch.Tensor, hidden: int) -> torch.Tensor:
    return message[:, HEADER_BYTES:HEADER_BYTES + hidden].view(E4M3)


def _scales(message: torch.Tensor) -> torch.Tensor:
    return message[:, :4].view(torch.float32)


def pack_fp8_rows(rows_TH: torch.Tensor) -> torch.Tensor:
    """``rows_TH`` [T, H] quantized per row into one message, uint8 [T, :func:`wire_width`]
    (not differentiable: the expert pipeline sends the gradients back)."""
    num_rows, hidden = rows_TH.shape
    message = torch.empty((num_rows, wire_width(hidden)), dtype=torch.uint8, device=rows_TH.device)
    _, scales = quantize_rows(rows_TH.detach(), values_out=_values(message, hidden))
    _scales(message).copy_(scales[:, None])
    return message


def unpack_fp8_rows(message: torch.Tensor, hidden: int) -> QuantizedRows:
    """The rows of a :func:`pack_fp8_rows` message that arrived ([S, :func:`wire_width`]):
    their values a strided view of it, their scales copied out contiguous."""
    if message.dtype != torch.uint8 or message.dim() != 2 or message.shape[1] != wire_width(hidden):
        raise ValueError(f"unpack_fp8_rows: a message of rows of {hidden} values is uint8 [rows, "
                         f"{wire_width(hidden)}], got {message.dtype} {tuple(message.shape)}")
    return QuantizedRows(_values(message, hidden), _scales(message)[:, 0].contiguous())


def rows_placeholder(rows: QuantizedRows, dtype: torch.dtype) -> torch.Tensor:
    """A [S, H] tensor of ``dtype`` standing for ``rows`` in autograd: the expert graph's leaf
    for the arrived rows, whose gradient goes back to the senders. An expanded zero row: the
    FP8 GEMM reads ``rows`` (:func:`ep_moe.kernels.fp8.layer_grouped_gemm_fp8`'s
    ``quantized_rows``), never these values."""
    num_rows, hidden = rows.values.shape
    return torch.zeros((1, hidden), dtype=dtype, device=rows.values.device).expand(num_rows, hidden)
