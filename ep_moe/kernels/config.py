"""Launch configuration of the grouped GEMM kernels.

One frozen :class:`KernelConfig` describes one launch of one kernel (forward, dX or dW):
tile sizes, tile grouping, warps, pipeline stages and whether weight tiles go through TMA
tensor descriptors. Every field reaches the launch (``launch_kwargs``); the autotuner
(``ep_moe.autotune``) searches over these objects and stores them as JSON
(``to_dict``/``from_dict``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal

Pass = Literal["forward", "dx", "dw"]
PASSES: tuple[Pass, ...] = ("forward", "dx", "dw")


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Tile shape and launch parameters of one grouped GEMM kernel.

    For the forward and dX kernels the tile is ``BLOCK_M`` rows x ``BLOCK_N`` output
    columns, reduced over the inner dimension in steps of ``BLOCK_K``. For the dW kernel
    the tile is ``BLOCK_N`` x ``BLOCK_K`` of one expert's weight gradient, reduced over
    that expert's rows in steps of ``BLOCK_M``.
    """

    BLOCK_M: int = 128
    """Rows of the routed problem per tile (forward, dX) or per reduction step (dW)."""
    BLOCK_N: int = 128
    """Output columns per tile (forward: N; dX: K of the forward problem; dW: N)."""
    BLOCK_K: int = 64
    """Reduction step (forward: K; dX: N of the forward problem; dW: K columns per tile)."""
    GROUP_SIZE_M: int = 8
    """Tiles along M visited together before moving along N, for L2 reuse of weight tiles
    (forward and dX); in dW, whose tiles each cover a whole expert's rows, the N tiles
    visited together before moving along K, for L2 reuse of the dy and x columns."""
    num_warps: int = 8
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth of the reduction loop."""
    use_tma: bool = False
    """Load weight tiles through TMA tensor descriptors (Hopper+, Triton with descriptors);
    ignored (plain pointers) where the device, Triton or the interpreter lacks them."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # strict: a cache file's 4.0 or "no" is not a config
            want = bool if f.name == "use_tma" else int
            if type(getattr(self, f.name)) is not want:
                raise ValueError(f"KernelConfig.{f.name}={getattr(self, f.name)!r}: must be {want.__name__}")
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}={value}: must be a power of two >= 16")
        if self.GROUP_SIZE_M < 1:
            raise ValueError(f"KernelConfig.GROUP_SIZE_M={self.GROUP_SIZE_M}: must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages={self.num_stages}: must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KernelConfig":
        """Inverse of :meth:`to_dict`; unknown or missing fields raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        missing = names - set(data)
        if unknown or missing:
            raise ValueError(
                f"KernelConfig.from_dict: unknown fields {sorted(unknown)}, missing {sorted(missing)}"
            )
        return cls(**data)

    def short(self) -> str:
        """Compact human-readable form, e.g. ``128x128x64 g8 w8 s3 tma``."""
        tma = " tma" if self.use_tma else ""
        return (
            f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} g{self.GROUP_SIZE_M} "
            f"w{self.num_warps} s{self.num_stages}{tma}"
        )


TMA_MIN_ROWS = 4096
"""Launches over fewer rows load through pointers even where the config asks for TMA: there
the launcher's host-side encoding of each descriptor (about 40 us a launch on an H200's host)
costs more than TMA saves, and the loads themselves were no faster (qwen3-30b-a3b's dX and dW
on H200 at 64-2048 rows: ``benchmarks/PERFORMANCE_LOG.md``)."""


# Defaults for Hopper-class GPUs and bf16, from the sweeps in benchmarks/bench_grouped_gemm.py
# and the dW probe in benchmarks/PERFORMANCE_LOG.md (H200): 128x256 output tiles keep two
# warpgroups' MMAs busy and halve the A re-reads of 128x128; the dW kernel reduces over rows
# in BLOCK_M steps, its 128x256 output tile (BLOCK_N x BLOCK_K) read by 8 N tiles at a time.
DEFAULT_CONFIGS: dict[str, KernelConfig] = {
    "forward": KernelConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
    "dx": KernelConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, use_tma=True),
    "dw": KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=3, use_tma=True),
}


def smem_bytes(config: KernelConfig, which: Pass, elem_size: int) -> int:
    """Shared memory the pipelined operand tiles of one program take (the usual bound).

    Forward and dX stage an A tile [BLOCK_M, BLOCK_K] and a B tile [BLOCK_K, BLOCK_N] per
    stage; dW stages [BLOCK_M, BLOCK_N] and [BLOCK_M, BLOCK_K], and with TMA its output tile
    [BLOCK_N, BLOCK_K] leaves through shared memory too.
    """
    c = config
    if which == "dw":
        per_stage = c.BLOCK_M * (c.BLOCK_N + c.BLOCK_K)
        store = c.BLOCK_N * c.BLOCK_K if c.use_tma else 0
        return (per_stage * c.num_stages + store) * elem_size
    per_stage = c.BLOCK_K * (c.BLOCK_M + c.BLOCK_N)
    return per_stage * elem_size * c.num_stages


def fit_to_smem(config: KernelConfig, which: Pass, elem_size: int, smem_limit: int) -> KernelConfig:
    """``config`` with fewer stages (down to 2), then (dW) without TMA and the store buffer it
    brings, then a halved reduction block, until its tiles fit ``smem_limit`` bytes: how a
    default tuned for bf16 serves float32 or a GPU with less shared memory. The store buffer
    counts wherever ``use_tma`` is set, also on a GPU without TMA (an A100's dW default keeps 2
    stages where 3 would fit)."""
    reduce_field = "BLOCK_M" if which == "dw" else "BLOCK_K"
    while smem_bytes(config, which, elem_size) > smem_limit:
        if config.num_stages > 2:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        elif which == "dw" and config.use_tma:
            config = dataclasses.replace(config, use_tma=False)
        elif getattr(config, reduce_field) > 16:
            config = dataclasses.replace(config, **{reduce_field: getattr(config, reduce_field) // 2})
        else:
            break
    return config


@dataclass(frozen=True)
class GemmConfigs:
    """The three configs one grouped GEMM call uses (forward, dX, dW)."""

    forward: KernelConfig = DEFAULT_CONFIGS["forward"]
    dx: KernelConfig = DEFAULT_CONFIGS["dx"]
    dw: KernelConfig = DEFAULT_CONFIGS["dw"]

    def for_pass(self, which: Pass) -> KernelConfig:
        """The config of one pass by name."""
        return getattr(self, which)

    @classmethod
    @functools.lru_cache(maxsize=None)  # on every grouped_gemm call without configs
    def defaults(cls, elem_size: int, smem_limit: int) -> "GemmConfigs":
        """The default configs fitted to an element size and a shared-memory limit."""
        return cls(**{p: fit_to_smem(DEFAULT_CONFIGS[p], p, elem_size, smem_limit) for p in PASSES})


CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_SIZE_M", "num_warps", "num_stages", "use_tma")
"""A :class:`KernelConfig`'s fields in the order of its int form."""


# The int form: what the custom ops take (their schema has no dataclass) and the constant
# torch.compile's trace hands over; both directions cached, a layer passing the same few
# configs on every call.
@functools.lru_cache(maxsize=None)
def configs_to_ints(configs: GemmConfigs) -> tuple[int, ...]:
    """``configs`` as ints: each pass's :data:`CONFIG_FIELDS`, passes in ``PASSES`` order."""
    return tuple(int(getattr(configs.for_pass(p), f)) for p in PASSES for f in CONFIG_FIELDS)


@functools.lru_cache(maxsize=None)
def configs_from_ints(values: tuple[int, ...]) -> GemmConfigs:
    """The :class:`GemmConfigs` of :func:`configs_to_ints`' ints."""
    n = len(CONFIG_FIELDS)
    per_pass = {}
    for i, p in enumerate(PASSES):
        fields = dict(zip(CONFIG_FIELDS, values[i * n:(i + 1) * n]))
        fields["use_tma"] = bool(fields["use_tma"])
        per_pass[p] = KernelConfig(**fields)
    return GemmConfigs(**per_pass)
