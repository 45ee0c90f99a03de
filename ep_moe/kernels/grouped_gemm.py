"""Triton kernels of the grouped GEMM: forward, dX and dW, plus a segment sum (the row
gather they use lives in :mod:`ep_moe.kernels.permute`).

Problem. ``w`` is [E, N, K]; the routed problem has ``M = sum(m_sizes)`` rows sorted by
expert, row ``r`` belonging to expert ``e(r)``. Forward::

    y[s(r)] = rw[s(r)] * (x[g(r)] @ w[e(r)]^T)          g = gather, s = scatter (identity if absent)

With an optional per-expert bias ``b`` [E, N] (an ``nn.Linear``'s), the forward is
``rw[s(r)] * (x[g(r)] @ w[e(r)]^T + b[e(r)])``. Backward::

    dx_rows[r] = rw[s(r)] * (dy[s(r)] @ w[e(r)])         then dx[g(r)] += dx_rows[r]
    dw[e]      = sum over rows r of e: (rw[s(r)] * dy[s(r)])^T @ x[g(r)]
    db[e]      = sum over rows r of e: rw[s(r)] * dy[s(r)]
    drw[s(r)]  = (dy[s(r)] @ w[e(r)]) . x[g(r)] + dy[s(r)] . b[e(r)]

Forward and dX are the same kernel, ``_grouped_rows_kernel``: a row-tiled product whose
B operand is ``w[e]`` read transposed (forward) or as stored (dX), chosen by strides. The
bias is an epilogue add of the forward; its gradient is each expert's column sum of the
(weighted) dy rows, a segment sum of its own (``_segment_sum_kernel``: taken inside the dW
kernel by the tiles of the first K block, it made them several times slower than the rest
and cost more than the separate pass); its share of ``drw`` a dot the dX kernel's tiles of
the first column block add to the row dots.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

from ep_moe.kernels.arrival import arrival_of
from ep_moe.kernels.config import TMA_MIN_ROWS, KernelConfig

KERNEL_VERSION = 2
"""Version of these kernels, part of every autotune cache key. Bump it whenever a change
here can move the best config (tiling, schedule, fusions, masking), so stale tunings stop
matching."""

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None


def interpreter_active() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints. ``triton.cdiv`` does the same, but as a Triton
    ``constexpr_function`` it costs several Python calls per host call (launch sizing runs on
    every layer call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), on the host
    (``triton.next_power_of_2`` costs more, as :func:`cdiv` says)."""
    return 1 << max(0, n - 1).bit_length()


def eager_or_graph_break(fn):
    """``fn`` run eagerly under ``torch.compile`` (a graph break, as ``torch.compiler.disable``
    does) and called directly in eager mode: the disable wrapper switches Dynamo's frame
    hook off and on around every call, host time that eager layer calls would pay each time."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return (disabled if torch.compiler.is_compiling() else fn)(*args, **kwargs)

    call.disabled = disabled  # what runs under torch.compile
    return call


@functools.lru_cache(maxsize=None)
def num_programs_for(device: torch.device) -> int:
    """Size of the persistent grid: one program per SM (a few in the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_TILE_GRID = contextvars.ContextVar("ep_moe_tile_grid", default=False)
_TILE_GRID_STRIDE = 1 << 30
"""Stride of the tile loop in a one-program-per-tile launch: past the tile count, so each
program runs one tile (launches of more tiles stay persistent); a constant, so the kernels
compile once for this mode."""


@contextlib.contextmanager
def one_program_per_tile():
    """Inside the block, the GEMM kernels launch one program per output tile instead of one
    per SM. Work launched beside them (an all-to-all's NCCL kernels) then gets an SM as soon
    as any tile ends, instead of waiting for a persistent kernel to end. The GEMMs alone run
    a little slower this way (measured in ``benchmarks/PERFORMANCE_LOG.md``).
    Results are bitwise the same (same tiles, same reduction order)."""
    token = _TILE_GRID.set(True)
    try:
        yield
    finally:
        _TILE_GRID.reset(token)


def launch_grid(device: torch.device, max_tiles: int) -> tuple[tuple[int], int]:
    """(grid, tile stride) of a GEMM launch over at most ``max_tiles`` tiles: persistent
    (one program per SM, striding the tiles), or one program per tile inside
    :func:`one_program_per_tile`."""
    if _TILE_GRID.get() and max_tiles <= _TILE_GRID_STRIDE:
        return (max(1, max_tiles),), _TILE_GRID_STRIDE
    programs = num_programs_for(device)
    return (max(1, min(programs, max_tiles)),), programs


def row_block_programs(row_blocks: int, col_blocks: int, device: torch.device, limited: bool) -> int:
    """Programs along the rows of a (row blocks x column blocks) elementwise launch: one per
    row block, or, when the rows in use are a device count below the grid's bound
    (``limited``), 64 per SM in all, striding the row blocks, so the blocks past the count
    cost no launch (against a full grid and other strides: ``benchmarks/PERFORMANCE_LOG.md``)."""
    if not limited:
        return max(1, row_blocks)
    return max(1, min(row_blocks, 64 * num_programs_for(device) // max(1, col_blocks)))


@functools.lru_cache(maxsize=None)
def smem_limit_for(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (unbounded in the interpreter)."""
    if device.type != "cuda":
        return 1 << 30
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 99 * 1024)


@functools.lru_cache(maxsize=None)
def _tma_capable(device: torch.device) -> bool:
    """Whether ``device`` (CUDA) is Hopper or newer; asked once per device, not per launch."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether tiles of every tensor can be loaded through TMA tensor descriptors.

    Needs Hopper or newer, a Triton with host-side descriptors, not the interpreter, a
    contiguous last dim, 16-byte aligned base and strides, and no empty dim.
    """
    if TensorDescriptor is None or interpreter_active():
        return False
    for t in tensors:
        if t.device.type != "cuda" or not _tma_capable(t.device):
            return False
        if t.numel() == 0:  # a descriptor needs every dim positive
            return False
        elem = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((st * elem) % 16 for st in t.stride()[:-1]):
            return False
    return True


def use_tma_for(config: KernelConfig, num_rows: int, *tensors: torch.Tensor) -> bool:
    """Whether a launch over ``num_rows`` rows with ``config`` loads ``tensors`` through TMA:
    the config asks for it, the launch has :data:`TMA_MIN_ROWS` rows or more, and
    :func:`tma_usable` allows it."""
    return config.use_tma and num_rows >= TMA_MIN_ROWS and tma_usable(*tensors)


def _rows_metadata(grid, kernel, args):
    m, n, k = args["num_rows"], args["N"], args["K"]
    return {"name": f"ep_moe_grouped_rows[M={m},N={n},K={k}]", "flops": 2 * m * n * k}


def _dw_metadata(grid, kernel, args):
    m, n, k = args["num_rows"], args["N"], args["K"]
    return {"name": f"ep_moe_grouped_dw[M={m},N={n},K={k}]", "flops": 2 * m * n * k}


@triton.jit
def _tile_coords(local_tile, num_m_tiles, num_n_tiles, GROUP_SIZE_M: tl.constexpr):
    """(m tile, n tile) of the ``local_tile``-th tile of a [num_m_tiles, num_n_tiles] grid,
    GROUP_SIZE_M m tiles at a time, so that consecutive programs share n tiles in L2 (the
    rows kernels' weight tiles; the dW kernel passes its (N tile, K tile) grid, sharing the
    x columns of a K tile)."""
    tiles_per_group = GROUP_SIZE_M * num_n_tiles
    first_m = (local_tile // tiles_per_group) * GROUP_SIZE_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_SIZE_M)
    in_group = local_tile % tiles_per_group
    return first_m + in_group % group_rows, in_group // group_rows


@triton.jit
def _tiles_up_to_source(source_ends_ptr, e, w, m_e, NUM_SOURCES: tl.constexpr, BLOCK_M: tl.constexpr):
    """M tiles of expert ``e`` whose last row comes from a source <= ``w`` (0 for w < 0; all
    of them for the last source): rows are sorted by source, ``source_ends[e, w]`` of them
    from sources <= w."""
    end = tl.load(source_ends_ptr + e * NUM_SOURCES + tl.maximum(w, 0))
    tiles = tl.where(end >= m_e, tl.cdiv(m_e, BLOCK_M), end // BLOCK_M)
    tiles = tl.where(w == NUM_SOURCES - 1, tl.cdiv(m_e, BLOCK_M), tiles)
    return tl.where(w < 0, 0, tiles)


# out[st(r), :] = scale(r) * A[ld(r), :] @ B_e for each row r of expert e; B_e = w[e]^T or w[e].
# Schedule: persistent (one program per SM striding the tiles by TILE_STRIDE) or one program
#   per tile (launch_grid); one global tile list walks the experts in order (device-side
#   running sum of m_sizes: no host sync), (m, n) tiles GROUP_SIZE_M-swizzled.
# Fusions: LOAD_IDX gathers A rows in the prologue; STORE_IDX scatters output rows and SCALE
#   multiplies a per-row weight (fp32) in the epilogue; ROW_DOT also writes, per row, the dot
#   of the unscaled tile with rows of D (the top-k weight gradient); fp32 accumulation. The
#   weight and the dot belong to the store row, the load row or (PER_ROUTED_ROW) the routed
#   row r itself, when several routed rows load the same A row (a slot sum's backward).
#   FP8_SCALES: A and B hold e4m3 values (ep_moe.kernels.fp8); the fp32 tile is multiplied by
#   the A row's scale and the expert's output-channel scale first, before any bias or weight.
#   HAS_BIAS, forward (B_TRANSPOSED): the expert's bias row is added to the fp32 tile before
#   the row weight, one [BLOCK_N] load per tile. HAS_BIAS, dX with ROW_DOT: the bias's share
#   of the row weight's gradient, the dot of each A row (dy) with the bias over the reduced
#   dim, is added to the dots by the tiles of column block 0 only (a second pass over their
#   rows of A, still in cache; the other tiles skip it), so the main loop is the same.
# Source order (NUM_SOURCES > 1): each expert's rows are sorted by source (source_ends: per
#   expert, rows of sources <= w), and the tile list walks sources first_source..end_source-1
#   outermost. ARRIVAL: A's rows land source by source while the kernel runs (a copy-engine
#   all-gather, ep_moe.kernels.arrival; source 0 is there at launch); a tile belongs to the
#   source of its last row and waits, once per program and source, until the arrival flag
#   reaches arrival_base + w (32-bit values compared modulo 2**32, as the driver's stream
#   waits compare them). EXACT_SOURCES: each (expert, source) segment is tiled on its own,
#   so a launch over one source computes exactly its rows (sums that leave source by source).
# Masking: segments may be empty or end mid-tile. Rows past the segment read a clamped valid
#   row and are dropped at the store; K and N tails are masked unless EVEN_K / EVEN_N (masks,
#   not clamps, on the contiguous dim keep the loads vectorised). Weight tiles come through a 3-D TMA descriptor [E, N, K] when USE_TMA, which
#   zero-fills past each expert's bounds.
# first_source/end_source unspecialized: a source window's bounds (w, w+1) would otherwise
# compile one variant per window (Triton specializes ints equal to 1 or divisible by 16).
@triton.jit(launch_metadata=_rows_metadata, do_not_specialize=["first_source", "end_source"])
def _grouped_rows_kernel(
    a_ptr, b_ptr, b_desc, out_ptr, m_sizes_ptr,
    load_idx_ptr, store_idx_ptr, scale_ptr, bias_ptr,
    a_scale_ptr, b_scale_ptr,
    d_ptr, d_idx_ptr, row_dot_ptr,
    source_ends_ptr, arrival_ptr, arrival_base, first_source, end_source,
    num_experts, num_rows, N, K,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_om, stride_on,
    stride_dm, stride_dn,
    stride_bias_e, stride_b_scale_e,
    # Meta-parameters
    TILE_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, FP8_SCALES: tl.constexpr,
    LOAD_IDX: tl.constexpr, STORE_IDX: tl.constexpr,
    SCALE: tl.constexpr, SCALE_BY_LOAD_ROW: tl.constexpr, PER_ROUTED_ROW: tl.constexpr,
    ROW_DOT: tl.constexpr, D_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, B_TRANSPOSED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, NUM_SOURCES: tl.constexpr, ARRIVAL: tl.constexpr,
    EXACT_SOURCES: tl.constexpr,
):
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_steps = tl.cdiv(K, BLOCK_K)
    tile = tl.program_id(0)
    tiles_before = 0
    landed = tl.program_id(0) * 0  # sources this program has seen land
    for w in range(first_source, end_source):
        seg_start = 0
        for e in range(num_experts):
            m_e = tl.load(m_sizes_ptr + e)
            # this (expert, source) window's tiles: rows row_first.. (from the expert's first
            # row), row_end bounds them
            row_end = m_e
            if EXACT_SOURCES:
                row_first = tl.where(w == 0, 0, tl.load(source_ends_ptr + e * NUM_SOURCES + tl.maximum(w - 1, 0)))
                row_end = tl.load(source_ends_ptr + e * NUM_SOURCES + w)
                num_m = tl.cdiv(row_end - row_first, BLOCK_M)
            elif NUM_SOURCES > 1:
                m_first = _tiles_up_to_source(source_ends_ptr, e, w - 1, m_e, NUM_SOURCES, BLOCK_M)
                row_first = m_first * BLOCK_M
                num_m = _tiles_up_to_source(source_ends_ptr, e, w, m_e, NUM_SOURCES, BLOCK_M) - m_first
            else:
                row_first, num_m = 0, tl.cdiv(m_e, BLOCK_M)
            tiles_e = num_m * num_n_tiles
            while tile < tiles_before + tiles_e:
                if ARRIVAL:
                    if w > landed:
                        # (seen - target) as int32: flag values wrap around 2**32
                        seen = tl.atomic_add(arrival_ptr, 0, sem="acquire")
                        while seen - (arrival_base + w) < 0:
                            seen = tl.atomic_add(arrival_ptr, 0, sem="acquire")
                        landed = w
                pid_m, pid_n = _tile_coords(tile - tiles_before, num_m, num_n_tiles, GROUP_SIZE_M)
                offs_m = row_first + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = offs_m < row_end
                rows = seg_start + tl.where(row_ok, offs_m, 0)
                if LOAD_IDX:
                    a_rows = tl.load(load_idx_ptr + rows).to(tl.int64)
                else:
                    a_rows = rows.to(tl.int64)
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                col_ok = offs_n < N
                offs_k = tl.arange(0, BLOCK_K)
                a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
                b_ptrs = (b_ptr + tl.cast(e, tl.int64) * stride_be
                          + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ki in range(num_k_steps):
                    k_ok = offs_k < K - ki * BLOCK_K
                    if EVEN_K:
                        a = tl.load(a_ptrs)
                    else:
                        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                    if USE_TMA:
                        if B_TRANSPOSED:
                            b = b_desc.load([e, pid_n * BLOCK_N, ki * BLOCK_K])
                            b = tl.trans(tl.reshape(b, (BLOCK_N, BLOCK_K)))
                        else:
                            b = b_desc.load([e, ki * BLOCK_K, pid_n * BLOCK_N])
                            b = tl.reshape(b, (BLOCK_K, BLOCK_N))
                    elif EVEN_K and EVEN_N:
                        b = tl.load(b_ptrs)
                    else:
                        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                    a_ptrs += BLOCK_K * stride_ak
                    b_ptrs += BLOCK_K * stride_bk
                if FP8_SCALES:
                    a_scale = tl.load(a_scale_ptr + a_rows)
                    b_scale = tl.load(b_scale_ptr + tl.cast(e, tl.int64) * stride_b_scale_e + offs_n, mask=col_ok,
                                      other=0.0)
                    acc = acc * a_scale[:, None] * b_scale[None, :]
                if HAS_BIAS and B_TRANSPOSED:
                    bias = tl.load(bias_ptr + tl.cast(e, tl.int64) * stride_bias_e + offs_n, mask=col_ok, other=0.0)
                    acc += bias.to(tl.float32)[None, :]

                if STORE_IDX:
                    out_rows = tl.load(store_idx_ptr + rows).to(tl.int64)
                else:
                    out_rows = rows.to(tl.int64)
                if ROW_DOT:
                    if D_IDX:
                        d_rows = tl.load(d_idx_ptr + rows).to(tl.int64)
                    else:
                        d_rows = rows.to(tl.int64)
                    d = tl.load(d_ptr + d_rows[:, None] * stride_dm + offs_n[None, :] * stride_dn,
                                mask=col_ok[None, :], other=0.0)
                    partial = tl.sum(acc * d.to(tl.float32), axis=1)
                    if HAS_BIAS and not B_TRANSPOSED:
                        if pid_n == 0:  # + A row . bias over the reduced dim, by column block 0 only
                            bias_a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
                            bias_k_ptrs = bias_ptr + tl.cast(e, tl.int64) * stride_bias_e + offs_k
                            for ki in range(num_k_steps):
                                bias_k_ok = offs_k < K - ki * BLOCK_K
                                a_k = tl.load(bias_a_ptrs, mask=bias_k_ok[None, :], other=0.0)
                                bias_k = tl.load(bias_k_ptrs, mask=bias_k_ok, other=0.0)
                                partial += tl.sum(a_k.to(tl.float32) * bias_k.to(tl.float32)[None, :], axis=1)
                                bias_a_ptrs += BLOCK_K * stride_ak
                                bias_k_ptrs += BLOCK_K
                    dot_rows = rows.to(tl.int64) if PER_ROUTED_ROW else a_rows
                    tl.store(row_dot_ptr + tl.cast(pid_n, tl.int64) * num_rows + dot_rows, partial, mask=row_ok)
                if SCALE:
                    if PER_ROUTED_ROW:
                        acc = acc * tl.load(scale_ptr + rows).to(tl.float32)[:, None]
                    elif SCALE_BY_LOAD_ROW:
                        acc = acc * tl.load(scale_ptr + a_rows).to(tl.float32)[:, None]
                    else:
                        acc = acc * tl.load(scale_ptr + out_rows).to(tl.float32)[:, None]
                out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & col_ok[None, :])
                tile += TILE_STRIDE
            tiles_before += tiles_e
            seg_start += m_e


# dw[e] = DY[rows of e]^T @ X[rows of e], one [BLOCK_N, BLOCK_K] tile of one expert at a time.
# Both operands are contiguous and in expert order: the backward materialises gathered or
#   weighted rows once (``launch_gather_rows``), which keeps this reduction loop a plain
#   pipelined stream of tiles (an index load inside the loop, or an fp32 scale on an operand,
#   stalls the software pipeline).
# Schedule: persistent or one program per tile (launch_grid) over the E * (N/BLOCK_N) *
#   (K/BLOCK_K) output tiles, so small N*K still fills the GPU; each tile reduces its
#   expert's rows in BLOCK_M steps. Within an expert the (n, k) tiles go GROUP_SIZE_M n tiles
#   at a time (_tile_coords), so the programs running together read a few column blocks of
#   dy and of x, which stay in L2, instead of all of x's (K wide: 0.82-0.87x _grouped_mm's dW
#   on mixtral's down and deepseek-v3's gate_up before).
# Loads: with USE_TMA, whole BLOCK_M steps come through 2-D TMA descriptors (zero fill past N
#   and K) and only the ragged tail of a segment through masked pointer loads.
# Store: with a dw descriptor (USE_TMA and a TMA-able dw) the tile leaves through a TMA
#   store (clipped at N and K), else through masked pointer stores.
# Masking: rows past the segment load as zero (they are the reduction axis), and so do columns
#   past N or K. Experts with no rows store zeros. fp32 accumulation.
# Fuses: with ACCUMULATE, the tile adds what dw already holds (in fp32, one rounding), so the
#   dW of several row sets (the chunks of a pipeline) sums in place, with no buffer per set
#   and no separate add.
@triton.jit(launch_metadata=_dw_metadata)
def _grouped_dw_kernel(
    dy_ptr, x_ptr, dy_desc, x_desc, dw_ptr, dw_desc, m_sizes_ptr, m_ends_ptr,
    num_experts, num_rows, N, K,
    stride_dym, stride_dyn,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    # Meta-parameters
    TILE_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    USE_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_expert = num_n_tiles * num_k_tiles
    for tile in range(tl.program_id(0), num_experts * tiles_per_expert, TILE_STRIDE):
        e = tile // tiles_per_expert
        pid_n, pid_k = _tile_coords(tile % tiles_per_expert, num_n_tiles, num_k_tiles, GROUP_SIZE_M)
        m_e = tl.load(m_sizes_ptr + e)
        seg_start = tl.load(m_ends_ptr + e) - m_e
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        k_ok = offs_k < K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        num_full = 0
        if USE_TMA:  # whole BLOCK_M steps through TMA; the ragged tail through pointers below
            num_full = m_e // BLOCK_M
            for mi in range(num_full):
                dy = dy_desc.load([seg_start + mi * BLOCK_M, pid_n * BLOCK_N])
                x = x_desc.load([seg_start + mi * BLOCK_M, pid_k * BLOCK_K])
                acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
        tail = m_e - num_full * BLOCK_M
        offs_m = tl.arange(0, BLOCK_M)
        rows = tl.cast(seg_start + num_full * BLOCK_M, tl.int64) + offs_m
        dy_ptrs = dy_ptr + rows[:, None] * stride_dym + offs_n[None, :] * stride_dyn
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        for mi in range(tl.cdiv(tail, BLOCK_M)):
            row_ok = offs_m < tail - mi * BLOCK_M
            dy = tl.load(dy_ptrs, mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
            dy_ptrs += BLOCK_M * stride_dym
            x_ptrs += BLOCK_M * stride_xm
        if ACCUMULATE or not TMA_STORE:
            dw_ptrs = (dw_ptr + tl.cast(e, tl.int64) * stride_we
                       + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk)
            tile_ok = n_ok[:, None] & k_ok[None, :]
            if ACCUMULATE:
                acc += tl.load(dw_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
        if TMA_STORE:
            dw_desc.store([e, pid_n * BLOCK_N, pid_k * BLOCK_K],
                          tl.reshape(acc.to(dw_desc.dtype), (1, BLOCK_N, BLOCK_K)))
        else:
            tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=tile_ok)


# out[t] = sum of src rows offsets[t] .. offsets[t+1]-1: the deterministic reduction of a
# gathered operand's gradient (rows pre-sorted by destination, a few per segment) and the
# bias gradient (each expert's rows, hundreds to thousands per segment).
# Tiling: one program per (destination row, BLOCK_K columns), reading BLOCK_R rows a step
# into a [BLOCK_R, BLOCK_K] fp32 accumulator that is summed over its rows at the end (with
# BLOCK_R = 1: the rows added one by one, in order). Fixed order either way: deterministic.
@triton.jit
def _segment_sum_kernel(src_ptr, out_ptr, offsets_ptr, K, stride_sm, stride_om,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    start = tl.load(offsets_ptr + t)
    end = tl.load(offsets_ptr + t + 1)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for first in range(start, end, BLOCK_R):
        rows = first + offs_r
        ptrs = src_ptr + tl.cast(rows, tl.int64)[:, None] * stride_sm + cols[None, :]
        acc += tl.load(ptrs, mask=(rows < end)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.cast(t, tl.int64) * stride_om + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=col_ok)


def _int32_bits(value: int) -> int:
    """``value`` modulo 2**32 as a signed 32-bit int (a flag value the kernel compares)."""
    return (value + 2 ** 31) % 2 ** 32 - 2 ** 31


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def launch_rows(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    m_sizes: torch.Tensor,
    config: KernelConfig,
    *,
    transpose_w: bool,
    load_idx: torch.Tensor | None = None,
    store_idx: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    scale_by_load_row: bool = False,
    per_routed_row: bool = False,
    dot_with: torch.Tensor | None = None,
    dot_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    source_window: tuple[torch.Tensor, int] | None = None,
    fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Launch the row-tiled kernel: forward (``transpose_w=True``) or dX (``False``).

    ``a`` is read at rows ``load_idx[r]``; the product lands in ``out`` at rows
    ``store_idx[r]``, times ``scale`` at the store row (at the load row with
    ``scale_by_load_row``). With ``dot_with`` set, returns the per-row dot products of the
    unscaled result with ``dot_with[dot_idx[r]]``, indexed by load row ([rows of a], fp32).
    ``per_routed_row``: the scale and the dots belong to routed row r itself (dots [M]).
    ``bias`` [E, w's N], contiguous: forward, added to each row of expert e before the
    scale; dX (needs ``dot_with``), each dot also gets ``a[load row] . bias[e]`` (the
    forward's bias in the row weight's gradient).
    When rows of ``a`` are still landing (:func:`ep_moe.kernels.arrival.rows_arriving`), the
    tiles wait for them source by source. ``source_window=(source_ends, w)``: only the rows
    of source ``w`` (each expert's rows sorted by source, ``source_ends`` [E, S] of them from
    sources <= w), each (expert, source) segment tiled on its own.
    ``fp8_scales=(a_scale, w_scale)``: ``a`` and ``w`` hold e4m3 values; ``a_scale`` [rows of
    a] and ``w_scale`` [E, output columns] (fp32, contiguous) scale the fp32 products
    (:mod:`ep_moe.kernels.fp8`). Inputs are trusted: :mod:`ep_moe.kernels.ops` validates them.
    """
    num_experts, w_n, w_k = w.shape
    num_rows = load_idx.shape[0] if load_idx is not None else a.shape[0]
    if transpose_w:  # out = a @ w[e]^T: reduce over w's K, produce w's N
        n_out, k_red = w_n, w_k
        stride_bk, stride_bn = w.stride(2), w.stride(1)
    else:  # out = a @ w[e]: reduce over w's N, produce w's K
        n_out, k_red = w_k, w_n
        stride_bk, stride_bn = w.stride(1), w.stride(2)
    c = config
    use_tma = use_tma_for(c, num_rows, w)
    b_desc = None
    if use_tma:
        block = [1, c.BLOCK_N, c.BLOCK_K] if transpose_w else [1, c.BLOCK_K, c.BLOCK_N]
        b_desc = TensorDescriptor.from_tensor(w, block)
    if bias is not None and not transpose_w and dot_with is None:
        raise ValueError("launch_rows: a bias in the dX pass only adds to the row dots; pass dot_with, or no bias")
    num_n_tiles = cdiv(n_out, c.BLOCK_N)
    row_dot = None
    if dot_with is not None:
        if not per_routed_row and a.shape[0] != num_rows:  # the kernel strides the dots by num_rows
            raise ValueError(f"launch_rows: dots by load row need one routed row per row of a "
                             f"({num_rows} routed rows, a has {a.shape[0]}); pass per_routed_row=True")
        row_dot = torch.empty((num_n_tiles, num_rows), device=a.device, dtype=torch.float32)
    max_tiles = (cdiv(num_rows, c.BLOCK_M) + num_experts) * num_n_tiles
    arrival = arrival_of(a)
    if arrival is not None and arrival.source_ends.shape != (num_experts, arrival.num_sources):
        raise ValueError(f"launch_rows: source_ends of shape {tuple(arrival.source_ends.shape)} for "
                         f"{num_experts} experts and {arrival.num_sources} sources")
    if arrival is not None and source_window is not None:
        raise ValueError("launch_rows: rows still landing cannot be read by a source window")
    source_ends = arrival.source_ends if arrival is not None else (
        source_window[0] if source_window is not None else None)
    first_source, end_source = (source_window[1], source_window[1] + 1) if source_window is not None else (
        0, arrival.num_sources if arrival is not None else 1)
    grid, stride = launch_grid(a.device, max_tiles)
    _grouped_rows_kernel[grid](
        # absent optional tensors go as None: a constexpr the flags below prune, where a stand-in
        # tensor cost host time on every launch (specialized, and its pointer looked up)
        a, w, b_desc, out, m_sizes, load_idx, store_idx, scale, bias,
        *(fp8_scales if fp8_scales is not None else (None, None)),
        dot_with, dot_idx, row_dot, source_ends,
        arrival.landing.flag if arrival is not None else None,
        _int32_bits(arrival.landing.base) if arrival is not None else 0,
        first_source, end_source,
        num_experts, num_rows, n_out, k_red,
        a.stride(0), a.stride(1),
        w.stride(0), stride_bk, stride_bn,
        out.stride(0), out.stride(1),
        dot_with.stride(0) if dot_with is not None else 0,
        dot_with.stride(1) if dot_with is not None else 0,
        bias.stride(0) if bias is not None else 0,
        fp8_scales[1].stride(0) if fp8_scales is not None else 0,
        TILE_STRIDE=stride,
        BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K,
        GROUP_SIZE_M=c.GROUP_SIZE_M, FP8_SCALES=fp8_scales is not None,
        LOAD_IDX=load_idx is not None, STORE_IDX=store_idx is not None,
        SCALE=scale is not None, SCALE_BY_LOAD_ROW=scale_by_load_row, PER_ROUTED_ROW=per_routed_row,
        ROW_DOT=dot_with is not None, D_IDX=dot_idx is not None, HAS_BIAS=bias is not None,
        EVEN_K=k_red % c.BLOCK_K == 0, EVEN_N=n_out % c.BLOCK_N == 0,
        USE_TMA=use_tma, B_TRANSPOSED=transpose_w,
        INPUT_PRECISION=_input_precision(a.dtype),
        NUM_SOURCES=source_ends.shape[1] if source_ends is not None else 1,
        ARRIVAL=arrival is not None, EXACT_SOURCES=source_window is not None,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return None if row_dot is None else row_dot.sum(0)


def launch_dw(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, m_sizes: torch.Tensor,
              config: KernelConfig, accumulate: bool = False) -> None:
    """Launch the dW kernel into ``dw`` [E, N, K] from expert-ordered rows of ``dy`` [M, N]
    and ``x`` [M, K] (gather or weight them first with :func:`ep_moe.kernels.permute.launch_gather_rows`).
    ``accumulate``: add the product to what ``dw`` holds instead of overwriting it."""
    num_experts, n, k = dw.shape
    m_ends = torch.cumsum(m_sizes, 0, dtype=torch.int32)  # each segment's start is its end - m_sizes
    c = config
    max_tiles = num_experts * cdiv(n, c.BLOCK_N) * cdiv(k, c.BLOCK_K)
    use_tma = use_tma_for(c, x.shape[0], dy, x)
    dy_desc = TensorDescriptor.from_tensor(dy, [c.BLOCK_M, c.BLOCK_N]) if use_tma else None
    x_desc = TensorDescriptor.from_tensor(x, [c.BLOCK_M, c.BLOCK_K]) if use_tma else None
    # The TMA store stages the tile in shared memory at the inputs' element size (what smem_bytes
    # counts), so only a dw of their dtype takes it (FP8 experts' fp32 master weights get an fp32
    # dw from bf16 rows: twice the buffer, past the limit); and a weight stored transposed
    # (GPT-OSS's) has its dW so too: no TMA store along a strided dim.
    dw_desc = (TensorDescriptor.from_tensor(dw, [1, c.BLOCK_N, c.BLOCK_K])
               if use_tma and dw.dtype == x.dtype and tma_usable(dw) else None)
    grid, stride = launch_grid(x.device, max_tiles)
    _grouped_dw_kernel[grid](
        dy, x, dy_desc, x_desc, dw, dw_desc, m_sizes, m_ends,
        num_experts, x.shape[0], n, k,
        dy.stride(0), dy.stride(1),
        x.stride(0), x.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        TILE_STRIDE=stride,
        BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K, GROUP_SIZE_M=c.GROUP_SIZE_M,
        USE_TMA=use_tma, TMA_STORE=dw_desc is not None,
        INPUT_PRECISION=_input_precision(x.dtype),
        ACCUMULATE=accumulate,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )


def launch_segment_sum(src: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, rows_per_step: int = 1) -> None:
    """``out[t] = src[offsets[t]:offsets[t+1]].sum(0)`` for every row t of ``out``, in fp32, in
    a fixed order. ``rows_per_step``: rows each program reads at once, 1 (rows added in order:
    segments of a few rows) or a power of two (long segments: 32 reads the bias gradient's
    hundreds of rows per expert several times faster)."""
    num_out, k = out.shape
    if num_out == 0:
        return
    block_k = min(next_power_of_2(max(k, 16)), 1024 if rows_per_step == 1 else 256)
    _segment_sum_kernel[(num_out, cdiv(k, block_k))](
        src, out, offsets, k, src.stride(0), out.stride(0), BLOCK_R=rows_per_step, BLOCK_K=block_k,
        num_warps=4,
    )
