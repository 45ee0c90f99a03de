"""Problems, search space, pruning rules and the shape heuristic of the autotuner. Pure.

Nothing here queries a GPU or touches a file: every function takes a frozen
:class:`GemmProblem` and a frozen :class:`DeviceLimits` (built by
:func:`ep_moe.autotune.bench.device_limits`) and returns new objects.

Tiles of the three kernels (see :mod:`ep_moe.kernels.grouped_gemm`):

* forward and dX: ``BLOCK_M`` routed rows x ``BLOCK_N`` output columns, reduced over the
  inner dim in ``BLOCK_K`` steps; shared memory per stage holds an A tile (BM x BK) and a
  weight tile (BK x BN).
* dW: ``BLOCK_N`` x ``BLOCK_K`` of one expert's weight gradient, reduced over that
  expert's rows in ``BLOCK_M`` steps; shared memory per stage holds a dy tile (BM x BN)
  and an x tile (BM x BK), loaded through TMA with ``use_tma`` (which stores the output
  tile through shared memory too). ``GROUP_SIZE_M`` groups its N tiles.

Search: :func:`initial_candidates` (a short list of proven tile shapes, the default
first) and :func:`refinements` (pipeline depth, tile grouping and TMA around the best
few); :func:`prune` filters both.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ep_moe.kernels.config import (
    DEFAULT_CONFIGS,
    PASSES,
    TMA_MIN_ROWS,
    GemmConfigs,
    KernelConfig,
    Pass,
    fit_to_smem,
    smem_bytes,
)

Projection = Literal["gate_up", "down"]

PROJECTIONS: tuple[str, ...] = get_args(Projection)
"""The values of :data:`Projection`."""

_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*")
"""What a dtype of a :class:`GemmProblem` may look like: a torch dtype's name."""

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per element of the dtypes the kernels support."""

MIN_BLOCK_M = 32
"""Floor of the BLOCK_M limit from rows per expert: below this, tiles stop getting cheaper."""

MAX_STAGES = 4
"""Deepest pipeline the initial candidates use; refinements may try one more."""

STANDARD_BUCKETS: tuple[int, ...] = (1024, 4096, 16384, 65536)
"""Routed rows per rank (tokens x top_k) tuned when the caller names no token count."""

HEURISTIC_BUCKETS: tuple[int, ...] = tuple(2 ** i for i in range(4, 19))
"""Buckets (16 .. 262144 rows, powers of two like :func:`bucket_for`) of heuristic tables:
the heuristic depends on the rows per expert."""


@dataclass(frozen=True, kw_only=True)
class GemmProblem:
    """One expert projection of one MoE layer, as its grouped GEMM sees it.

    ``gate_up`` reads tokens through a gather index (each token used ``top_k`` times) and
    writes rows in expert order; ``down`` reads rows in expert order and scatters them to
    token-slot order with the top-k weights multiplied in.

    The fields name the problem's cache file, so they are checked at construction: a
    ``ValueError`` names a field outside its form (see each field).
    """

    projection: Projection
    """Which projection: ``"gate_up"`` (H -> 2I or I) or ``"down"`` (I -> H)."""
    num_local_experts: int
    """Experts on this rank (E / ep_size); an ``int`` >= 1, as are ``n``, ``k`` and ``top_k``."""
    n: int
    """Output features of the forward GEMM (w is [E, n, k])."""
    k: int
    """Input features of the forward GEMM."""
    top_k: int
    """Experts per token."""
    dtype: str
    """Element type, a torch dtype's name (lowercase letters, digits, ``_``), e.g. ``"bfloat16"``."""

    def __post_init__(self) -> None:
        # Every field goes into a cache file's name: none may carry a path, NUL or a line break.
        if self.projection not in PROJECTIONS:
            raise ValueError(f"GemmProblem.projection={self.projection!r}: give 'gate_up' or 'down'")
        for name in ("num_local_experts", "n", "k", "top_k"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"GemmProblem.{name}={value!r}: give an integer >= 1")
        if not isinstance(self.dtype, str) or not _DTYPE_NAME.fullmatch(self.dtype):
            raise ValueError(f"GemmProblem.dtype={self.dtype!r}: give a torch dtype's name as a string of "
                             f"lowercase letters, digits and underscores that starts with a letter, "
                             f"e.g. 'bfloat16'")


@dataclass(frozen=True, kw_only=True)
class DeviceLimits:
    """What pruning needs to know about the device, queried once by ``bench.device_limits``."""

    name: str
    """Device name as the driver reports it, e.g. ``"NVIDIA H100 80GB HBM3"``; ``"cpu"``
    for the Triton interpreter."""
    smem_per_block: int
    """Shared memory one program may use, in bytes (opt-in maximum)."""
    num_sms: int
    """Streaming multiprocessors (the persistent grid size)."""
    capability: tuple[int, int]
    """Compute capability (major, minor); (0, 0) for the interpreter."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The MoE layer shape of one model, as stored in ``ep_moe/configs/models/*.json``."""

    name: str
    """Preset name, e.g. ``"mixtral-8x7b"``."""
    num_experts: int
    """Experts of the whole layer (E), before expert parallelism."""
    hidden_size: int
    """Model dim (H)."""
    intermediate_size: int
    """Expert FFN dim (I)."""
    top_k: int
    """Experts per token."""
    gated: bool = True
    """Gated activation (SwiGLU): gate_up produces 2I columns instead of I."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ModelShape.{name}={value!r}: must be an integer >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelShape.top_k={self.top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelShape":
        """Build from a JSON object; unknown fields raise ``ValueError`` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict):
            raise ValueError(f"model shape: expected a JSON object with fields {sorted(names)}, got {data!r}")
        unknown = set(data) - names - {"comment"}
        if unknown:
            raise ValueError(f"model shape has unknown fields {sorted(unknown)}; known: {sorted(names)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if required - set(data):
            raise ValueError(f"model shape lacks fields {sorted(required - set(data))}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def problems(self, ep_size: int, dtype: str) -> list[GemmProblem]:
        """The gate_up and down problems of one rank at expert-parallel size ``ep_size``."""
        if ep_size < 1 or self.num_experts % ep_size:
            raise ValueError(
                f"ep_size={ep_size}: {self.name} has {self.num_experts} experts, which must be "
                f"divisible by the expert-parallel size; pick a divisor of {self.num_experts}"
            )
        if dtype not in ELEMENT_BYTES:
            raise ValueError(f"dtype={dtype!r}: use one of {sorted(ELEMENT_BYTES)}")
        e_local = self.num_experts // ep_size
        up = self.intermediate_size * (2 if self.gated else 1)
        common = dict(num_local_experts=e_local, top_k=self.top_k, dtype=dtype)
        return [
            GemmProblem(projection="gate_up", n=up, k=self.hidden_size, **common),
            GemmProblem(projection="down", n=self.hidden_size, k=self.intermediate_size, **common),
        ]


def _check_ms(name: str, value: float) -> None:
    """``ValueError`` unless ``value`` is a duration: finite milliseconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name}={value!r}: give a finite number of milliseconds >= 0 (a NaN or infinite "
                         f"time is a failed candidate, not a timing)")


@dataclass(frozen=True, kw_only=True)
class CandidateTiming:
    """One timed candidate: its config and the median and 20/80% quantiles in ms."""

    config: KernelConfig
    median_ms: float
    p20_ms: float
    p80_ms: float

    def __post_init__(self) -> None:
        for name in ("median_ms", "p20_ms", "p80_ms"):
            _check_ms(f"CandidateTiming.{name}", getattr(self, name))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"config": self.config.to_dict(), "median_ms": self.median_ms,
                "p20_ms": self.p20_ms, "p80_ms": self.p80_ms}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CandidateTiming":
        """Inverse of :meth:`to_dict`."""
        return cls(config=KernelConfig.from_dict(data["config"]), median_ms=float(data["median_ms"]),
                   p20_ms=float(data["p20_ms"]), p80_ms=float(data["p80_ms"]))


@dataclass(frozen=True, kw_only=True)
class TunedBucket:
    """The configs chosen for one token bucket of one problem, with the evidence.

    ``timings`` lists the best candidates of each pass, fastest first; ``default_ms`` the
    default config's median (None where it was not timed or failed). Both are empty for
    configs that did not come from tuning (heuristic). Every time is a finite number of
    milliseconds >= 0 (``ValueError`` otherwise): a NaN or infinite time is a failed
    candidate, never a record.
    """

    configs: GemmConfigs
    timings: dict[str, tuple[CandidateTiming, ...]] = field(default_factory=dict)
    default_ms: dict[str, float | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for which, ms in self.default_ms.items():
            if ms is not None:
                _check_ms(f"TunedBucket.default_ms[{which!r}]", ms)

    def best_ms(self, which: Pass) -> float | None:
        """Median of the chosen config of one pass, if it was timed."""
        best = self.timings.get(which)
        return best[0].median_ms if best else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (plain types only)."""
        return {
            "configs": {p: self.configs.for_pass(p).to_dict() for p in PASSES},
            "timings": {p: [t.to_dict() for t in ts] for p, ts in self.timings.items()},
            "default_ms": dict(self.default_ms),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TunedBucket":
        """Inverse of :meth:`to_dict`; malformed data raises ``ValueError``/``KeyError``/``TypeError``."""
        configs = GemmConfigs(**{p: KernelConfig.from_dict(data["configs"][p]) for p in PASSES})
        timings = {p: tuple(CandidateTiming.from_dict(t) for t in ts)
                   for p, ts in data.get("timings", {}).items() if p in PASSES}
        default_ms = {p: (None if v is None else float(v))
                      for p, v in data.get("default_ms", {}).items() if p in PASSES}
        return cls(configs=configs, timings=timings, default_ms=default_ms)


Table = dict[int, TunedBucket]
"""Configs of one problem by token bucket (routed rows per rank)."""


def element_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype``; unknown dtypes raise ``ValueError``."""
    try:
        return ELEMENT_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(ELEMENT_BYTES)}") from None


def bucket_for(num_rows: int) -> int:
    """The token bucket tuned for ``num_rows`` routed rows: the nearest power of two (>= 16)."""
    return max(16, 1 << round(math.log2(max(num_rows, 1))))


def bucket_bounds(buckets: tuple[int, ...]) -> tuple[float, ...]:
    """Geometric midpoints between consecutive sorted ``buckets``: with
    ``bisect_left(bounds, num_rows)`` they pick the bucket nearest ``num_rows`` in log space."""
    return tuple(math.sqrt(a * b) for a, b in zip(buckets, buckets[1:]))


def config_smem(config: KernelConfig, which: Pass, problem: GemmProblem) -> int:
    """Shared memory of ``config``'s pipelined tiles for ``problem``'s dtype (the kernels'
    own estimate, :func:`ep_moe.kernels.config.smem_bytes`)."""
    return smem_bytes(config, which, element_bytes(problem.dtype))


def table_misfit(table: "Table", problem: GemmProblem, dev: DeviceLimits) -> str | None:
    """Why a stored table cannot run ``problem`` on ``dev`` (a config whose tiles overflow
    its shared memory), or None when every config fits."""
    for bucket, tuned in sorted(table.items()):
        for which in PASSES:
            config = tuned.configs.for_pass(which)
            need = config_smem(config, which, problem)
            if need > dev.smem_per_block:
                return (f"bucket {bucket}, {which} {config.short()} needs {need} bytes of shared memory, "
                        f"the device has {dev.smem_per_block}")
    return None


def default_config(problem: GemmProblem, which: Pass, dev: DeviceLimits) -> KernelConfig:
    """What the kernels run untuned (``GemmConfigs.defaults``): the default of ``which``
    fitted to the dtype and the device's shared memory. The baseline of every tuning."""
    return fit_to_smem(DEFAULT_CONFIGS[which], which, element_bytes(problem.dtype), dev.smem_per_block)


def block_m_limit(problem: GemmProblem, num_rows: int) -> int:
    """Largest useful BLOCK_M: about twice the mean rows per expert, at least ``MIN_BLOCK_M``.

    Larger row tiles (or, for dW, reduction steps) than an expert's rows only add masked
    work. Returned as a power of two.
    """
    mean_rows = num_rows / max(problem.num_local_experts, 1)
    return max(MIN_BLOCK_M, 1 << max(0, math.ceil(math.log2(max(2.0 * mean_rows, 1.0)))))


def tma_allowed(problem: GemmProblem, which: Pass, dev: DeviceLimits, num_rows: int) -> bool:
    """TMA needs Hopper or newer and 16-byte aligned rows of what it loads: the weight
    [E, n, k] for forward and dX; the dy [M, n] and x [M, k] rows for dW. Launches of fewer
    than ``TMA_MIN_ROWS`` rows never use it (the kernels load through pointers there)."""
    elem = element_bytes(problem.dtype)
    dims = (problem.n, problem.k) if which == "dw" else (problem.k,)
    return (num_rows >= TMA_MIN_ROWS and dev.capability >= (9, 0)
            and all(d * elem % 16 == 0 for d in dims))


def prune(cands: list[KernelConfig], problem: GemmProblem, which: Pass, num_rows: int,
          dev: DeviceLimits) -> list[KernelConfig]:
    """Candidates that fit shared memory, do not overshoot the rows per expert, and use TMA
    only where allowed. Order kept, duplicates dropped. (The kernels mask every edge, so no
    dimension needs to be a multiple of a block.)"""
    limit_m = block_m_limit(problem, num_rows)
    tma_ok = tma_allowed(problem, which, dev, num_rows)
    kept: list[KernelConfig] = []
    for c in cands:
        if (config_smem(c, which, problem) <= dev.smem_per_block
                and c.BLOCK_M <= limit_m
                and (tma_ok or not c.use_tma)
                and c not in kept):
            kept.append(c)
    return kept


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) tile shapes tried first, from large to small. The
# rows kernels (forward, dX) favour wide output tiles; dW's BLOCK_M is its reduction step.
_ROWS_TILES = (
    (128, 256, 64, 8), (256, 128, 64, 8), (128, 128, 128, 8), (128, 128, 64, 8),
    (128, 128, 64, 4), (128, 64, 64, 4), (64, 256, 64, 8), (64, 128, 128, 4),
    (64, 128, 64, 4), (64, 64, 64, 4), (32, 128, 64, 4), (32, 64, 128, 4),
)
_DW_TILES = (
    (64, 128, 256, 8), (64, 256, 128, 8), (128, 128, 128, 8), (64, 128, 128, 8),
    (64, 128, 128, 4), (64, 128, 64, 4), (64, 64, 128, 4), (32, 128, 128, 4),
    (32, 64, 64, 4),
)


def _deepest_stages(config: KernelConfig, which: Pass, problem: GemmProblem, dev: DeviceLimits,
                    most: int) -> int:
    """Deepest pipeline (1..most) whose operand tiles, and any buffer outside the pipeline
    (dW's TMA store), fit shared memory."""
    one = config_smem(dataclasses.replace(config, num_stages=1), which, problem)
    per_stage = config_smem(dataclasses.replace(config, num_stages=2), which, problem) - one
    fixed = one - per_stage
    return max(1, min(most, (dev.smem_per_block - fixed) // max(per_stage, 1)))


def _pow2_at_least(dim: int) -> int:
    return max(16, 1 << math.ceil(math.log2(max(dim, 1))))


def _fit(config: KernelConfig, problem: GemmProblem, which: Pass) -> KernelConfig:
    """Shrink BLOCK_N / BLOCK_K of a tile to the problem's dims (powers of two >= 16), so
    small problems get tiles they can use instead of none."""
    # BLOCK_N spans forward's and dW's n but dX's output, which is k; BLOCK_K the other dim.
    out_cols, reduce = (problem.k, problem.n) if which == "dx" else (problem.n, problem.k)
    return dataclasses.replace(config, BLOCK_N=min(config.BLOCK_N, _pow2_at_least(out_cols)),
                               BLOCK_K=min(config.BLOCK_K, _pow2_at_least(reduce)))


def initial_candidates(problem: GemmProblem, which: Pass, num_rows: int,
                       dev: DeviceLimits) -> list[KernelConfig]:
    """First search round for one pass: the default config, then each tile shape of the
    table at the deepest pipeline (<= ``MAX_STAGES``) that fits, with TMA as the default
    of that pass has it (where allowed), pruned.

    The default config is always the first entry, even where pruning would drop it, so
    the tuned choice is never slower than the default.
    """
    tiles = _DW_TILES if which == "dw" else _ROWS_TILES
    default = default_config(problem, which, dev)
    use_tma = default.use_tma and tma_allowed(problem, which, dev, num_rows)
    cands = []
    for bm, bn, bk, warps in tiles:
        tile = _fit(KernelConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, use_tma=use_tma),
                    problem, which)
        stages = _deepest_stages(tile, which, problem, dev, MAX_STAGES)
        cands.append(dataclasses.replace(tile, num_stages=stages))
    return [default] + [c for c in prune(cands, problem, which, num_rows, dev) if c != default]


def refinements(config: KernelConfig, problem: GemmProblem, which: Pass, num_rows: int,
                dev: DeviceLimits) -> list[KernelConfig]:
    """Second search round around one good config: one stage less and more, TMA loads
    toggled (where allowed), and tile grouping 4 and 16; pruned, ``config`` excluded."""
    near = [dataclasses.replace(config, num_stages=s)
            for s in (config.num_stages - 1, config.num_stages + 1) if s >= 1]
    near.append(dataclasses.replace(config, use_tma=not config.use_tma))
    near += [dataclasses.replace(config, GROUP_SIZE_M=g) for g in (4, 16) if g != config.GROUP_SIZE_M]
    return [c for c in prune(near, problem, which, num_rows, dev) if c != config]


def heuristic_config(problem: GemmProblem, which: Pass, num_rows: int,
                     dev: DeviceLimits) -> KernelConfig:
    """A config from the shape alone: the fitted default with BLOCK_M capped at the rows
    per expert (:func:`block_m_limit`), BLOCK_N/BLOCK_K shrunk to small dims, 4 warps for
    tiles under 128x128, the deepest pipeline that fits (up to the default's), and TMA only
    where allowed."""
    default = default_config(problem, which, dev)
    tile = _fit(default, problem, which)
    tile = dataclasses.replace(tile, BLOCK_M=min(tile.BLOCK_M, block_m_limit(problem, num_rows)),
                               use_tma=tile.use_tma and tma_allowed(problem, which, dev, num_rows))
    area = tile.BLOCK_N * (tile.BLOCK_K if which == "dw" else tile.BLOCK_M)
    tile = dataclasses.replace(tile, num_warps=min(tile.num_warps, 8 if area >= 128 * 128 else 4))
    return dataclasses.replace(tile, num_stages=_deepest_stages(tile, which, problem, dev, default.num_stages))


def heuristic_configs(problem: GemmProblem, num_rows: int, dev: DeviceLimits) -> GemmConfigs:
    """:func:`heuristic_config` for forward, dX and dW."""
    return GemmConfigs(**{p: heuristic_config(problem, p, num_rows, dev) for p in PASSES})


def heuristic_table(problem: GemmProblem, dev: DeviceLimits,
                    buckets: tuple[int, ...] = HEURISTIC_BUCKETS) -> Table:
    """Heuristic configs for each bucket, in the same shape as a tuned table."""
    return {b: TunedBucket(configs=heuristic_configs(problem, b, dev)) for b in buckets}
