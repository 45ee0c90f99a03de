"""Shared pieces of the benchmarks: model shapes, routing, timing, environment record."""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: E experts, hidden H, expert intermediate I, top-k."""

    name: str
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int


# The shapes of one MoE layer of each model, as in ANCHORS.md (deepseek-v3-ep8: 256 experts
# over EP 8, so 32 local experts).
SHAPES = {
    s.name: s
    for s in (
        MoEShape("mixtral-8x7b", 8, 4096, 14336, 2),
        MoEShape("qwen3-30b-a3b", 128, 2048, 768, 8),
        MoEShape("gpt-oss-20b", 32, 2880, 2880, 4),
        MoEShape("deepseek-v3-ep8", 32, 7168, 2048, 8),
    )
}


TINY = MoEShape("tiny", 8, 64, 128, 2)
"""The CPU smoke runs' shape (``--shape tiny``)."""


def random_routing(num_tokens: int, num_experts: int, top_k: int, device, generator=None):
    """Uniform top-k routing: (m_sizes int32 [E], gather int32 [T*k] token of each sorted
    slot, scatter int32 [T*k] token-slot position of each sorted slot)."""
    scores = torch.rand(num_tokens, num_experts, device=device, generator=generator)
    expert_TK = scores.topk(top_k, dim=1).indices
    flat = expert_TK.flatten()
    order = torch.argsort(flat, stable=True)
    m_sizes = torch.bincount(flat, minlength=num_experts).to(torch.int32)
    gather = (order // top_k).to(torch.int32)
    return m_sizes, gather, order.to(torch.int32)


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn`` in milliseconds (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def fixed_median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn`` in ms over exactly ``iters`` calls after ``warmup``:
    the same number of calls on every rank, so ``fn`` may run collectives (``bench_ms``
    picks its count from the rank's own timings)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_times(fn, setup, iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` (CUDA events on a GPU, the wall clock
    on the CPU); ``setup()``, when given, runs before each call, outside the timed region."""
    marks = []
    for _ in range(iters):
        if setup is not None:
            setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            marks.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            marks.append((time.perf_counter() - t0) * 1e3)
    synchronize(device)
    return [s.elapsed_time(e) for s, e in marks] if device.type == "cuda" else marks


def environment() -> dict:
    """Device, versions and host: recorded beside every number."""
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    else:
        info["device"] = "cpu"
    return info


def save_results(path: Path, payload: dict) -> None:
    """Write ``payload`` plus the environment as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2) + "\n")
