"""Timing candidate configs on representative data. The only module that times anything.

For one problem, one pass and one token bucket, :class:`PassLaunch` builds the data a
training step would feed that kernel: the exact (E_local, n, k, dtype), ``num_rows``
routed rows from ``num_rows / top_k`` tokens routed with a mild Zipf skew over experts
(busiest expert about E^0.3 times the quietest), and the index mode its projection uses
(:mod:`ep_moe.kernels.ops`):

=========  =======================================  =========================================
pass       gate_up (gather on load)                 down (scatter on store, top-k weights)
=========  =======================================  =========================================
forward    rows(x, transpose_w, load_idx=gather)    rows(h, transpose_w, store_idx=scatter, scale)
dx         rows(dy, store_idx=position)             rows(dy, load_idx=scatter, scale by load row,
                                                    dot_with=h)
dw         dw(dy, x[gather])                        dw(rw * dy[scatter], h)
=========  =======================================  =========================================

dW reads expert-ordered rows; the gather/scale that makes them (``launch_gather_rows``)
does not depend on the config and runs once, outside the timed region.

Activations are rotated over a few copies (enough to exceed twice the L2) so no launch
reads operands the previous one left in cache. :func:`time_configs` checks each
candidate's output against the first candidate's (the default config) before timing it,
then times it with the injected timer: ``triton.testing.do_bench`` median and 20/80%
quantiles on GPU, a wall clock in the interpreter. Candidates that fail to compile, run
out of resources or memory, compute a different result, or time as no duration (NaN,
infinite) are skipped.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
import triton.testing
from tqdm.auto import tqdm
from triton.compiler.errors import CompilationError
from triton.runtime.errors import TritonError

from ep_moe.autotune.space import (
    CandidateTiming,
    DeviceLimits,
    GemmProblem,
    Table,
    TunedBucket,
    default_config,
    initial_candidates,
    refinements,
)
from ep_moe.kernels.config import PASSES, GemmConfigs, KernelConfig, Pass
from ep_moe.kernels.grouped_gemm import (
    launch_dw,
    launch_rows,
    num_programs_for,
    smem_limit_for,
)
from ep_moe.kernels.permute import launch_gather_rows

logger = logging.getLogger(__name__)

ZIPF_SKEW = 0.3
"""Expert popularity p_e ~ 1 / rank^0.3: mild imbalance, as trained routers show."""

MAX_ROTATIONS = 4
"""Most copies of the activations kept for rotation."""

# Relative Frobenius error a candidate may show against the default config's output:
# both accumulate in fp32 but round differently (tile order, tf32 on GPU).
_TOLERANCE = {"float32": 5e-3, "float16": 5e-3, "bfloat16": 2e-2}

# Errors that mean "this config does not work here", not "the tuner is broken".
_SKIPPABLE = (TritonError, CompilationError, torch.OutOfMemoryError)

# do_bench budget per candidate (ms): enough repetitions for a stable median of kernels of
# 0.1-10 ms while a shape's whole search stays within minutes.
_WARMUP_MS, _REP_MS = 10, 50


@dataclass(frozen=True)
class Timing:
    """Median and 20/80% quantiles of one timed function, in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float


Timer = Callable[[Callable[[], Any]], Timing]
"""Times a no-argument function (which may have been called once already)."""


def gpu_timer(fn: Callable[[], Any]) -> Timing:
    """``triton.testing.do_bench`` (L2 flushed between calls): median, 20% and 80% quantiles."""
    median, p20, p80 = triton.testing.do_bench(fn, warmup=_WARMUP_MS, rep=_REP_MS, quantiles=[0.5, 0.2, 0.8])
    return Timing(median, p20, p80)


def wall_clock_timer(fn: Callable[[], Any], repeats: int = 3) -> Timing:
    """Stand-in for :func:`gpu_timer` on the CPU: one untimed call, then ``repeats`` (>= 2) timed."""
    fn()
    samples = []
    for _ in range(max(2, repeats)):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    quintiles = statistics.quantiles(samples, n=5, method="inclusive")
    return Timing(statistics.median(samples), quintiles[0], quintiles[3])


def default_device() -> torch.device:
    """The current CUDA device, else the CPU (Triton interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_timer(device: torch.device) -> Timer:
    """:func:`gpu_timer` on CUDA devices, :func:`wall_clock_timer` elsewhere."""
    return gpu_timer if device.type == "cuda" else wall_clock_timer


def device_limits(device: torch.device | None = None) -> DeviceLimits:
    """Query the limits pruning needs (name, opt-in shared memory, SMs, capability); in the
    interpreter, those the launchers assume (no shared-memory bound)."""
    device = device or default_device()
    smem, sms = smem_limit_for(device), num_programs_for(device)  # what the launchers use
    if device.type != "cuda":
        return DeviceLimits(name="cpu", smem_per_block=smem, num_sms=sms, capability=(0, 0))
    props = torch.cuda.get_device_properties(device)
    return DeviceLimits(name=props.name, smem_per_block=smem, num_sms=sms,
                        capability=(props.major, props.minor))


@dataclass(frozen=True)
class Routing:
    """Routing of ``num_tokens`` tokens to local experts, rows sorted by expert (all int32).

    ``gather[r]``: token of sorted row r; ``scatter[r]``: its token-slot (output) row;
    ``position``: where row r lands when rows are sorted by token (the deterministic dX
    path of a gathered operand); ``row_weights``: top-k weights by token-slot row.
    """

    m_sizes: torch.Tensor
    gather: torch.Tensor
    scatter: torch.Tensor
    position: torch.Tensor
    row_weights: torch.Tensor


def make_routing(problem: GemmProblem, num_rows: int, device: torch.device, seed: int = 0) -> Routing:
    """Route ``num_rows // top_k`` tokens (at least one) with a mild Zipf skew."""
    e, top_k = problem.num_local_experts, problem.top_k
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_tokens = max(1, num_rows // top_k)
    popularity = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** ZIPF_SKEW
    popularity = popularity[torch.randperm(e, generator=gen)]
    # Distinct experts per token where possible (at EP > 1 a rank may hold fewer than top_k).
    experts_TK = torch.multinomial(popularity.expand(num_tokens, e), top_k,
                                   replacement=top_k > e, generator=gen)
    order = torch.argsort(experts_TK.flatten(), stable=True)
    gather = order // top_k
    by_token = torch.argsort(gather, stable=True)
    position = torch.empty_like(by_token)
    position[by_token] = torch.arange(order.numel())
    m_sizes = torch.bincount(experts_TK.flatten(), minlength=e)
    row_weights = torch.rand(order.numel(), generator=gen)
    m_sizes, gather, order, position = (t.to(device=device, dtype=torch.int32)
                                        for t in (m_sizes, gather, order, position))
    return Routing(m_sizes, gather, order, position, row_weights.to(device))  # fp32, as routers give


def _rotations(bytes_per_set: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(MAX_ROTATIONS, math.ceil(2 * l2 / max(bytes_per_set, 1))))


class PassLaunch:
    """Data of one pass of one problem at ``num_rows`` routed rows, launchable with any config.

    ``routing`` and ``w_ENK`` are shared; ``sets`` holds the rotated activations (``a`` and
    ``dot_with`` for the rows kernel; ``dy`` and ``x`` for dW, with the expert-ordered
    ``dy_rows`` and ``x_rows`` the kernel reads); ``out`` is the buffer every
    launch writes. Calling runs one config on input set ``index`` (None: the next set in
    rotation) and returns ``out``.
    """

    def __init__(self, problem: GemmProblem, which: Pass, num_rows: int, device: torch.device,
                 seed: int = 0) -> None:
        if which not in PASSES:
            raise ValueError(f"which={which!r}: use one of {PASSES}")
        self.which = which
        dtype = getattr(torch, problem.dtype)
        gen = torch.Generator(device=device).manual_seed(seed + 1)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        r = make_routing(problem, num_rows, device, seed)
        rows, tokens = r.gather.numel(), max(1, num_rows // problem.top_k)
        n, k, e = problem.n, problem.k, problem.num_local_experts
        gate_up = problem.projection == "gate_up"
        self.routing = r
        self.m_sizes = r.m_sizes
        self.w_ENK = randn(e, n, k, scale=k ** -0.5)

        # Activations of one rotation set; weights and routing are shared by all sets.
        if which == "forward":
            shapes = {"a": (tokens if gate_up else rows, k)}
            self.out = torch.empty(rows, n, device=device, dtype=dtype)
        elif which == "dx":
            shapes = {"a": (rows, n)} if gate_up else {"a": (rows, n), "dot_with": (rows, k)}
            self.out = torch.empty(rows, k, device=device, dtype=dtype)
        else:
            shapes = {"dy": (rows, n), "x": (tokens if gate_up else rows, k)}
            self.out = torch.empty(e, n, k, device=device, dtype=dtype)

        def make_set() -> dict[str, torch.Tensor]:
            s = {name: randn(*shape) for name, shape in shapes.items()}
            if which == "dw":  # the kernel's operands: expert-ordered rows, as ops makes them
                s["dy_rows"] = s["dy"] if gate_up else launch_gather_rows(s["dy"], r.scatter, r.row_weights)
                s["x_rows"] = launch_gather_rows(s["x"], r.gather) if gate_up else s["x"]
            return s

        first = make_set()
        bytes_per_set = sum(t.numel() * t.element_size() for t in first.values())
        self.sets = [first] + [make_set() for _ in range(_rotations(bytes_per_set, device) - 1)]
        if gate_up:
            modes = {"forward": dict(transpose_w=True, load_idx=r.gather),
                     "dx": dict(transpose_w=False, store_idx=r.position)}
        else:
            modes = {"forward": dict(transpose_w=True, store_idx=r.scatter, scale=r.row_weights),
                     "dx": dict(transpose_w=False, load_idx=r.scatter, scale=r.row_weights,
                                scale_by_load_row=True)}
        self.kwargs = modes.get(which, {})
        self._turn = 0

    def __call__(self, config: KernelConfig, index: int | None = None) -> torch.Tensor:
        if index is None:
            index, self._turn = self._turn % len(self.sets), self._turn + 1
        s = self.sets[index]
        if self.which == "dw":
            launch_dw(s["dy_rows"], s["x_rows"], self.out, self.m_sizes, config)
        else:
            launch_rows(s["a"], self.w_ENK, self.out, self.m_sizes, config,
                        dot_with=s.get("dot_with"), **self.kwargs)
        return self.out


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, in fp64 a slice of rows at a time (outputs may be GiBs)."""
    num = den = 0.0
    rows_out, rows_ref = out.flatten(0, -2), ref.flatten(0, -2)
    for o, r in zip(torch.split(rows_out, 1024), torch.split(rows_ref, 1024)):
        r64 = r.double()
        num += float(((o.double() - r64) ** 2).sum())
        den += float((r64 ** 2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def time_configs(launch: PassLaunch, configs: list[KernelConfig], dtype: str, timer: Timer,
                 reference: torch.Tensor | None = None,
                 progress: tqdm | None = None) -> tuple[list[Timing | None], torch.Tensor | None]:
    """Validate, then time each config; None where a config is skipped.

    Each output (buffer poisoned with NaN first, so unwritten rows fail) is checked
    against ``reference``; when that is None the first output that runs becomes the
    reference (pass the default config first). A timing that is not a duration (NaN,
    infinite or negative) skips its config too. Returns the timings and the reference.
    """
    results: list[Timing | None] = []
    for config in configs:
        try:
            launch.out.fill_(float("nan"))
            out = launch(config, 0).clone()
            if reference is None and bool(torch.isfinite(out).all()):
                reference = out
            elif reference is None or not _rel_error(out, reference) <= _TOLERANCE[dtype]:  # NaN fails
                logger.warning("autotune: %s leaves rows unwritten or differs from the default; skipped",
                               config.short())
                results.append(None)
                continue
            timing = timer(lambda: launch(config, None))
            if not all(0 <= t < math.inf for t in (timing.median_ms, timing.p20_ms, timing.p80_ms)):  # NaN fails
                logger.warning("autotune: %s timed %s ms (median, 20%%, 80%%), not a duration; skipped",
                               config.short(), [timing.median_ms, timing.p20_ms, timing.p80_ms])
                timing = None
            results.append(timing)
        except _SKIPPABLE as e:
            logger.info("autotune: %s skipped: %s", config.short(), (str(e).splitlines() or [repr(e)])[0])
            if isinstance(e, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            results.append(None)
        finally:
            if progress is not None:
                progress.update(1)
    return results, reference


CandidateFn = Callable[[GemmProblem, Pass, int, DeviceLimits], list[KernelConfig]]
"""First-round candidates of one (problem, pass, routed rows, device)."""

TuneFn = Callable[[GemmProblem, DeviceLimits, tuple[int, ...]], Table]
"""What tunes a problem for some buckets: a :class:`Tuner`, or a stand-in (tests)."""


@dataclass(frozen=True, kw_only=True)
class Tuner:
    """Tunes the problems of one device: times candidates per pass and bucket, picks the best.

    Round one times ``candidates`` (default first); round two times the refinements of the
    ``refine_top`` fastest. A candidate replaces the default only if its median is at least
    ``min_gain`` faster, so timing noise does not trade the default for an equal config.
    """

    device: torch.device | None = None
    """Device to tune on; default: the current CUDA device, else the CPU interpreter."""
    timer: Timer | None = None
    """Timing function; default :func:`gpu_timer` on CUDA, :func:`wall_clock_timer` elsewhere."""
    candidates: CandidateFn = initial_candidates
    """First-round candidates of one (problem, pass, bucket)."""
    refine_top: int = 2
    """How many of the best first-round configs get a second round around them (0: none)."""
    keep: int = 5
    """Best candidates recorded per pass."""
    min_gain: float = 0.03
    """Relative speedup over the default a candidate needs to be chosen: about the
    run-to-run spread of one do_bench on an H200 (``benchmarks/PERFORMANCE_LOG.md``), so a
    tie keeps the default."""
    confirm_rounds: int = 3
    """Head-to-head re-timings of the fastest candidate against the default, alternating;
    the candidate must also win their medians by ``min_gain``, so one lucky timing among
    dozens cannot replace the default with a config that is not faster (0: no check)."""
    progress: bool = True
    """Show a tqdm bar over candidates."""
    seed: int = 0
    """Seed of the routing and data."""

    def __call__(self, problem: GemmProblem, dev: DeviceLimits, buckets: tuple[int, ...]) -> Table:
        """Tune ``problem`` for each bucket (routed rows per rank); returns the table."""
        device = self.device or default_device()
        timer = self.timer or default_timer(device)
        name = f"{problem.projection} e{problem.num_local_experts} n{problem.n} k{problem.k}"
        table: Table = {}
        with tqdm(total=0, desc=f"autotune {name}", unit="cfg", disable=not self.progress) as bar:
            for bucket in buckets:
                chosen: dict[str, KernelConfig] = {}
                timings: dict[str, tuple[CandidateTiming, ...]] = {}
                default_ms: dict[str, float | None] = {}
                for which in PASSES:
                    best, ranked, default_ms[which] = self._tune_pass(
                        problem, which, bucket, dev, device, timer, bar)
                    chosen[which], timings[which] = best, tuple(ranked[: self.keep])
                table[bucket] = TunedBucket(configs=GemmConfigs(**chosen), timings=timings,
                                            default_ms=default_ms)
        return table

    def _tune_pass(self, problem: GemmProblem, which: Pass, bucket: int, dev: DeviceLimits,
                   device: torch.device, timer: Timer, bar: tqdm):
        """(chosen config, timed candidates fastest first, default's median) of one pass."""
        launch = PassLaunch(problem, which, bucket, device, self.seed)
        timed: dict[KernelConfig, Timing] = {}
        tried: set[KernelConfig] = set()
        reference = None
        batch = self.candidates(problem, which, bucket, dev)
        for _ in range(2 if self.refine_top else 1):  # round one, then refinements
            batch = [c for i, c in enumerate(batch) if c not in tried and c not in batch[:i]]
            tried.update(batch)
            bar.total += len(batch)
            bar.refresh()
            results, reference = time_configs(launch, batch, problem.dtype, timer, reference, bar)
            timed.update((c, t) for c, t in zip(batch, results) if t is not None)
            leaders = sorted(timed, key=lambda c: timed[c].median_ms)[: self.refine_top]
            batch = [r for c in leaders for r in refinements(c, problem, which, bucket, dev)]
        if not timed:
            raise RuntimeError(f"autotune: no candidate ran for {problem} pass={which} rows={bucket}; "
                               "see the log for why each was skipped")
        default = default_config(problem, which, dev)
        default_ms = timed[default].median_ms if default in timed else None
        best = min(timed, key=lambda c: timed[c].median_ms)
        if default_ms is not None and best != default and self.confirm_rounds:
            for config, timing in self._confirm(launch, (default, best), problem.dtype, timer, reference).items():
                if math.isfinite(timing.median_ms):
                    timed[config] = timing
                else:  # failed most rounds: a failed candidate
                    del timed[config]
            if not timed:
                raise RuntimeError(f"autotune: neither the default nor {best.short()} ran again for {problem} "
                                   f"pass={which} rows={bucket}; see the log for why")
            default_ms = timed[default].median_ms if default in timed else None
            if best not in timed:
                best = default if default in timed else min(timed, key=lambda c: timed[c].median_ms)
        if default_ms is not None and timed[best].median_ms > default_ms * (1 - self.min_gain):
            best = default
        order = sorted(timed, key=lambda c: (c != best, timed[c].median_ms))
        ranked = [CandidateTiming(config=c, median_ms=timed[c].median_ms, p20_ms=timed[c].p20_ms,
                                  p80_ms=timed[c].p80_ms) for c in order]
        return best, ranked, default_ms

    def _confirm(self, launch: PassLaunch, pair: tuple[KernelConfig, KernelConfig], dtype: str,
                 timer: Timer, reference: torch.Tensor | None) -> dict[KernelConfig, Timing]:
        """Median over ``confirm_rounds`` alternating timings of (default, challenger); a
        round a config fails counts as an infinite time (so one failing most rounds has an
        infinite median, which the caller drops)."""
        samples: dict[KernelConfig, list[Timing]] = {c: [] for c in pair}
        for _ in range(self.confirm_rounds):
            results, _ = time_configs(launch, list(pair), dtype, timer, reference)
            for config, timing in zip(pair, results):
                samples[config].append(timing or Timing(math.inf, math.inf, math.inf))
        return {c: Timing(statistics.median(t.median_ms for t in ts), statistics.median(t.p20_ms for t in ts),
                          statistics.median(t.p80_ms for t in ts)) for c, ts in samples.items()}
