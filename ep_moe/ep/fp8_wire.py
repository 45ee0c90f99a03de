"""FP8 rows on the wire: with FP8 experts (``MoEConfig(expert_precision="fp8")``) the EP
dispatches (all-to-all, all-gather) send each token row as its e4m3 values and its fp32
scale, about half the bytes of a bf16 row. The sender quantizes the row as the receiver's up
projection would (one scale per row, :func:`ep_moe.kernels.fp8.quantize_rows`), and that GEMM
reads the arrived rows as they are, so the results are those of rows sent in the compute
dtype (:mod:`ep_moe.kernels.fp8`: the up projection's weight gradient reads the e4m3 rows at
every EP size). The combine, and the backward's gradients both ways, stay in the compute
dtype; so do the rows of the all-to-all's slot-row format (small eager calls, few bytes).
The all-to-all's sender quantizes its rows (one per token and destination rank) through
the gather that selects them, into the message: no copy of them in the compute dtype.

A row on the wire is :data:`HEADER_BYTES` (its fp32 scale, then padding, so that the values
start 16-byte aligned), then its H e4m3 values, padded to a multiple of 16 bytes
(:func:`wire_width`). In autograd a placeholder of the compute dtype stands for the rows
(:func:`rows_placeholder`), whose gradient travels as a bf16 row's would.
"""

from __future__ import annotations

from typing import Optional

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


def pack_fp8_rows(x_TH: torch.Tensor, gather_index: Optional[torch.Tensor] = None,
                  limit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows of ``x_TH`` [T, H] (read at ``gather_index[r]`` when given: the quantization
    reads them through the gather) quantized per row into one message, uint8 [rows,
    :func:`wire_width`]; its padding bytes are not written, nor the rows from ``limit`` (a
    count on the device) on. Not differentiable: the expert pipeline sends the gradients
    back."""
    num_rows = x_TH.shape[0] if gather_index is None else gather_index.shape[0]
    hidden = x_TH.shape[1]
    message = torch.empty((num_rows, wire_width(hidden)), dtype=torch.uint8, device=x_TH.device)
    _, scales = quantize_rows(x_TH.detach(), gather_index, values_out=_values(message, hidden), limit=limit)
    _scales(message).copy_(scales[:, None])
    return message


def unpack_fp8_rows(message: torch.Tensor, hidden: int) -> QuantizedRows:
    """The rows of a :func:`pack_fp8_rows` message that arrived ([S, :func:`wire_width`]):
    their values a strided view of it, their scales copied out contiguous."""
    if message.dtype != torch.uint8 or message.dim() != 2 or message.shape[1] != wire_width(hidden):
        raise ValueError(f"unpack_fp8_rows: a message of rows of {hidden} values is uint8 [rows, "
                         f"{wire_width(hidden)}], got {message.dtype} {tuple(message.shape)}")
    return QuantizedRows(_values(message, hidden), _scales(message)[:, 0].contiguous())


def rows_placeholder(num_rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [rows, H] tensor of ``dtype`` standing in autograd for rows that travel in e4m3: the
    sender's rows (their gradient comes back to the tokens), the receiver's (the expert
    graph's leaf, whose gradient goes back to the senders). An expanded zero row, whose values
    nothing reads: the message carries the rows, and the receiver's FP8 GEMM reads them
    (:func:`ep_moe.kernels.fp8.layer_grouped_gemm_fp8`'s ``quantized_rows``)."""
    return torch.zeros((1, hidden), dtype=dtype, device=device).expand(num_rows, hidden)
