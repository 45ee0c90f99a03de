"""The routed experts through ``torch._grouped_mm``, for small eager calls.

An eager call over few routed rows is host-bound: the GPU finishes each kernel before the
host has launched the next. There a Triton launch costs the host 40-80 us (Triton's Python
launcher, one cost per argument), and a torch op about 10 (H200 host), so the expert MLP
as torch ops (:func:`grouped_mm_mlp`: two ``torch._grouped_mm`` and a few index ops, with
their autograd backward) finishes sooner than the fused kernels' 3 launches forward and 7
backward. :func:`use_grouped_mm` picks it for calls of at most :data:`GROUPED_MM_MAX_ROWS`
routed rows (twice as many where autograd records the call), in eager mode only: a CUDA graph replays launches for free and
``torch.compile`` captures them, and there the fused kernels are faster.

The math is :func:`ep_moe.experts.expert_mlp`'s, deterministic as its kernels are, with no
atomics in the backward: each row reads its token through the token's slot (the backward
sums each token's K slot gradients in a reduction), a bias comes through a one-hot matmul
(whose backward sums each expert's rows), and the outputs are placed by index copies.

Bounded rows (the all-gather dispatches: the buffers sized for a bound known on the host,
the counts on the device) need no host sync either: the GEMMs run over the counted rows only
(``torch._grouped_mm``'s offsets end at the count, so they cost what the routed rows do, not
the bound), which leaves the rows past the count undefined in their outputs and input
gradients. Three masks keep that from leaking: the gathered rows (their gradient, which
would reach the tokens), GEMM1's output with a bias (its gradient, which the bias sums over
every row) and GEMM2's output (the result).

Shape suffixes follow the legend in :mod:`ep_moe.routing`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from ep_moe.kernels.arrival import arrival_of
from ep_moe.routing import combine_slots

GROUPED_MM_MAX_ROWS = 4096
"""Most routed rows (tokens x top-k on this rank, or the all-gathers' bound) an eager forward
alone runs through ``torch._grouped_mm``; a call autograd records (a backward follows) takes
up to twice as many; more go to the fused Triton kernels. On an H200 (qwen3-30b-a3b's experts)
the forward alone was no faster from 4096 rows on, while forward + backward was faster up to
8192 rows and slower at 16384: at EP=1 (1024 tokens, 8192 rows: 3.38 against 3.75 ms a layer
call) and for the all-gather's bound at EP=4 (8192 rows, about 2048 counted: 1.77 against 3.00
ms the experts; 16384 rows: 2.67 against 2.51)."""

_WORKS_ON: dict[int, bool] = {}
"""CUDA device index -> whether ``torch._grouped_mm`` runs there in bf16 (probed once)."""


def _grouped_mm_works(device: torch.device) -> bool:
    """``torch._grouped_mm`` exists and runs a bf16 problem with an empty group on ``device``
    (Hopper or newer: the GPUs its CUTLASS kernels target). Probed once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _WORKS_ON:
        works = hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(index) >= (9, 0)
        if works:
            try:
                a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
                offs = torch.tensor([8, 8, 16], device=device, dtype=torch.int32)
                out = torch._grouped_mm(a, a.new_ones(3, 16, 16), offs=offs)
                works = bool((out == 16).all())
            except RuntimeError:
                works = False
        _WORKS_ON[index] = works
    return _WORKS_ON[index]


def small_eager_call(x: torch.Tensor, num_rows: int, recorded: bool) -> bool:
    """Whether a call over ``num_rows`` routed rows of ``x`` is one the torch path beats the
    fused kernels on: eager (not compiled, not graph-captured) bf16 on a CUDA device where
    ``torch._grouped_mm`` runs, of at most :data:`GROUPED_MM_MAX_ROWS` rows (twice as many
    where autograd records the call: ``recorded``)."""
    return (num_rows <= GROUPED_MM_MAX_ROWS * (2 if recorded else 1) and not torch.compiler.is_compiling()
            and _eager_bf16_where_it_runs(x))


def use_grouped_mm(x: torch.Tensor, weights: tuple[torch.Tensor, ...], num_rows: int,
                   slot_index_R: Optional[torch.Tensor]) -> bool:
    """Whether :func:`ep_moe.experts.expert_mlp` runs this call through
    :func:`grouped_mm_mlp`: a :func:`small_eager_call` of at least one routed row (for the
    all-gathers, the bound of rows: all are computed), each with its slot (dropless at EP=1,
    any all-to-all or all-gather), on rows that have landed, with dense weights (contiguous,
    or each expert's matrix transposed, as transformers' GPT-OSS stores them) of 16-byte rows
    (``torch._grouped_mm``'s alignment)."""
    if num_rows == 0 or slot_index_R is None or arrival_of(x) is not None:
        return False
    if x.shape[1] % 8 or any(w.shape[1] % 8 or w.shape[2] % 8 or not _dense_experts(w) for w in weights):
        return False
    recorded = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))
    return small_eager_call(x, num_rows, recorded)


def _dense_experts(w: torch.Tensor) -> bool:
    """``w`` [e, N, K] is e dense matrices one after another, each row- or column-major."""
    n, k = w.shape[1], w.shape[2]
    per_expert = w.stride(0) == n * k or w.shape[0] == 1
    return per_expert and ((w.stride(2) == 1 and w.stride(1) == k) or (w.stride(1) == 1 and w.stride(2) == n))


def _eager_bf16_where_it_runs(x: torch.Tensor) -> bool:
    """bf16 on a CUDA device where ``torch._grouped_mm`` runs, no CUDA graph being captured
    (nor warmed up for one: :func:`fused_kernels_only`)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and not _fused_kernels_only
            and not torch.cuda.is_current_stream_capturing() and _grouped_mm_works(x.device))


_fused_kernels_only = False


@contextlib.contextmanager
def fused_kernels_only() -> Iterator[None]:
    """Inside the block every call runs the fused kernels, as a CUDA graph capture does: the
    eager warm-up before a capture (:mod:`ep_moe.forward_graphs`) compiles and looks up what
    the capture will launch."""
    global _fused_kernels_only
    previous, _fused_kernels_only = _fused_kernels_only, True
    try:
        yield
    finally:
        _fused_kernels_only = previous


DOUBLE_BACKWARD = "double backward (create_graph=True) through an ep_moe MoE layer is not supported"
"""The start of the errors that say so (here on the Triton backend, in :mod:`ep_moe.ep.base` at EP>1)."""


def _refuse_double_backward(grad_outputs) -> None:
    """A pre-hook on the node of an output of the Triton kernels: raises where a backward
    builds a graph of itself (``.backward(create_graph=True)``, ``torch.autograd.grad(...,
    create_graph=True)``), which runs its hooks with grad mode on. The kernels' backward is
    not differentiable again: without this, a second backward finds the expert weights "not
    used in the graph", or silently misses their terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{DOUBLE_BACKWARD} on the Triton backend (its kernels' backward is not differentiable "
                           "again); build the layer with MoEConfig(backend='torch'), whose backward is, at EP=1")


def once_differentiable_output(out: torch.Tensor, backend: str) -> torch.Tensor:
    """``out``, an output of the Triton backend's kernels (``backend="triton"``), set to raise
    one clear error in a backward with ``create_graph=True`` (:func:`_refuse_double_backward`);
    as it is on the torch backend, whose ops autograd differentiates twice. A hook on the
    node, no op: only the calls that run the kernels pay for it (not the small eager calls
    of this module, :func:`grouped_mm_mlp`: torch ops too)."""
    if backend == "triton" and out.requires_grad and not torch.compiler.is_compiling():
        out.grad_fn.register_prehook(_refuse_double_backward)
    return out


def _expert_one_hot(offsets_e: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, e] one-hot of each routed row's expert (``offsets_e``: each expert's end row; rows
    past the last are nobody's: zero rows): ``one_hot @ bias_e`` gives each row its expert's
    bias, and its backward sums each expert's rows in a matmul (fp32 accumulation,
    deterministic), where a gather's backward would add them with atomics."""
    rows_R = torch.arange(num_rows, device=offsets_e.device, dtype=offsets_e.dtype)
    expert_R = torch.searchsorted(offsets_e, rows_R, right=True)
    return (expert_R.unsqueeze(1) == torch.arange(offsets_e.shape[0], device=offsets_e.device)).to(dtype)


def grouped_mm_mlp(x: torch.Tensor, gate_up: Optional[torch.Tensor], down: torch.Tensor, m_sizes_e: torch.Tensor,
                   activation_fn: Callable[[torch.Tensor], torch.Tensor], *, slot_index_R: torch.Tensor,
                   token_index_R: torch.Tensor, top_k: int,
                   gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                   scatter_index: Optional[torch.Tensor] = None, row_weights: Optional[torch.Tensor] = None,
                   sum_slots: bool = False, bounded_rows: bool = False) -> torch.Tensor:
    """The expert MLP of :func:`ep_moe.experts.expert_mlp` as torch ops: routed row r
    (expert order, ``m_sizes_e`` rows per expert) reads ``x[token_index_R[r]]``, which is
    ``slot_index_R[r] // top_k``;
    GEMM1 (``gate_up`` [e, F, H], absent for one Linear), ``activation_fn``, GEMM2
    (``down`` [e, H, I]), each with its bias per expert, then times ``row_weights`` (in
    fp32; indexed by output row as in :func:`~ep_moe.kernels.ops.grouped_gemm`).

    ``bounded_rows``: the rows are a bound, ``m_sizes_e`` counts fewer; the rows past the
    count (distinct slots, as a permutation's tail is) come out zero and pass no gradient
    (module docstring).

    Returns the rows in expert order [R, H]; placed at ``scatter_index`` (a permutation);
    or with ``sum_slots`` each row of x's K slots summed (fp32, rounded once), [rows of x, H]
    (with ``scatter_index``, which then fills all of x's slots, the placed rows' sums)."""
    num_rows, top_k_rows = slot_index_R.shape[0], x.shape[0] * top_k
    offsets_e = torch.cumsum(m_sizes_e, 0, dtype=torch.int32)
    one_hot_Re = None
    if gate_up_bias is not None or down_bias is not None:
        one_hot_Re = _expert_one_hot(offsets_e, num_rows, x.dtype)
    rows_RH = rows_of_slots(x, top_k, slot_index_R, token_index_R)
    counted_R1 = None
    if bounded_rows:  # compared on the device: the count is not known on the host
        counted_R1 = (torch.arange(num_rows, device=x.device, dtype=offsets_e.dtype) < offsets_e[-1]).unsqueeze(1)
        if rows_RH.requires_grad:
            rows_RH = _counted_only(rows_RH, counted_R1)
    if gate_up is not None:
        h_RF = torch._grouped_mm(rows_RH, gate_up.transpose(-2, -1), offs=offsets_e)
        if gate_up_bias is not None:
            h_RF = _counted_only(h_RF + one_hot_Re @ gate_up_bias, counted_R1)
        rows_RH = activation_fn(h_RF)
    y_RH = torch._grouped_mm(rows_RH, down.transpose(-2, -1), offs=offsets_e)
    if down_bias is not None:
        y_RH = y_RH + one_hot_Re @ down_bias
    y_RH = _counted_only(y_RH, counted_R1)
    if scatter_index is not None:  # placed first: the row weights are indexed by output row
        y_RH = torch.empty_like(y_RH).index_copy_(0, scatter_index, y_RH)
        if sum_slots:  # every slot filled: weighted as [T, K, H], whose gradient needs no copy to rows
            return combine_slots(y_RH, top_k, row_weights)
    if row_weights is not None:  # in fp32, rounded once: with the slot sum, after it
        y_RH = y_RH * row_weights.to(torch.float32).unsqueeze(1)
    if sum_slots:  # each row at its slot, the rest zero
        y_NH = y_RH.new_zeros(top_k_rows, y_RH.shape[1]).index_copy_(0, slot_index_R, y_RH)
        return y_NH.view(x.shape[0], top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
    return y_RH.to(x.dtype)


def rows_of_slots(x: torch.Tensor, top_k: int, slot_index_R: torch.Tensor,
                  token_index_R: torch.Tensor) -> torch.Tensor:
    """The row of ``x`` each routed slot reads, [R, H]: ``x[token_index_R]``, where
    ``token_index_R`` is ``slot_index_R // top_k``. Where autograd records it, through each
    slot's copy of its row (``slot_index_R`` distinct), so that the backward sums each row's
    K slot gradients in a reduction: deterministic, where the gather's backward would add
    them with atomics."""
    if torch.is_grad_enabled() and x.requires_grad:
        copies_NH = x.unsqueeze(1).expand(-1, top_k, -1).reshape(x.shape[0] * top_k, x.shape[1])
        return copies_NH.index_select(0, slot_index_R)
    return x.index_select(0, token_index_R)


def _counted_only(t_RX: torch.Tensor, counted_R1: Optional[torch.Tensor]) -> torch.Tensor:
    """``t_RX`` with the rows past the count (``counted_R1`` False) zero, and zero gradient
    there in the backward: a select, so an undefined (even NaN) row does not leak as it
    would through a multiply."""
    return t_RX if counted_R1 is None else torch.where(counted_R1, t_RX, 0.0)
