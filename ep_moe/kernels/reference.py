"""Plain-PyTorch grouped GEMM: the oracle for tests and the CPU path.

Same contract as :func:`ep_moe.kernels.ops.grouped_gemm`: the routed problem has
``M = m_sizes.sum()`` rows, sorted by expert (expert 0's rows first). Row ``r`` reads
``x[gather_index[r]]`` (or ``x[r]``), is multiplied by ``w[e]^T`` for its expert ``e``, and
lands in output row ``scatter_index[r]`` (or ``r``), plus ``bias[e]`` when given, all
scaled by ``row_weights`` of that output row. Gradients come from ordinary autograd.
"""

from __future__ import annotations

import torch


def grouped_gemm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    gather_index: torch.Tensor | None = None,
    scatter_index: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Grouped GEMM by a loop over experts (one host sync for the split sizes).

    Accumulates in ``compute_dtype`` (default: float32, or float64 for float64 inputs) and
    returns ``x.dtype``. Pass ``compute_dtype=torch.float64`` for a test oracle.
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows_MK = x if gather_index is None else x.index_select(0, gather_index.long())
    rows_MK = rows_MK.to(compute_dtype)
    sizes = [int(s) for s in m_sizes.tolist()]  # host sync: per-expert split sizes
    pieces = [
        seg @ w_e.to(compute_dtype).t()
        for seg, w_e in zip(torch.split(rows_MK[:sum(sizes)], sizes), w.unbind(0))
    ]
    if bias is not None:
        pieces = [piece + b_e.to(compute_dtype) for piece, b_e in zip(pieces, bias.unbind(0))]
    # rows past the counts (grouped_gemm's bounded_rows) come out as zeros
    pieces.append(rows_MK.new_zeros(rows_MK.shape[0] - sum(sizes), w.shape[1]))
    out_MN = torch.cat(pieces)
    if scatter_index is not None:
        out_MN = torch.zeros_like(out_MN).index_copy(0, scatter_index.long(), out_MN)
    if row_weights is not None:
        out_MN = out_MN * row_weights.to(compute_dtype)[:, None]
    return out_MN.to(x.dtype)
