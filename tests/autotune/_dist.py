"""Helpers of the autotune tests: an isolated cache, a counting stub tuner, and running a
function in N fresh processes (optionally joined by a gloo group on 127.0.0.1).

Imported by the test modules as ``_dist`` (pytest puts this directory on ``sys.path``;
spawned children inherit it), so worker functions defined here can be pickled by name.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_moe.autotune import GemmProblem, clear_memory_cache
from ep_moe.autotune.coordinate import ENV_DISABLE, ENV_FORCE
from ep_moe.autotune.space import CandidateTiming, Table, TunedBucket
from ep_moe.kernels.config import GemmConfigs, KernelConfig

TINY = GemmProblem(projection="down", num_local_experts=4, n=64, k=48, top_k=2, dtype="float32")
TINY_UP = GemmProblem(projection="gate_up", num_local_experts=4, n=96, k=64, top_k=2, dtype="float32")

# What the stub tuner "chooses": no heuristic or default produces it.
STUB_CONFIG = KernelConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=3, num_warps=2, num_stages=1)
STUB_CONFIGS = GemmConfigs(forward=STUB_CONFIG, dx=STUB_CONFIG, dw=STUB_CONFIG)


def set_cache_env(root: Path) -> None:
    """In a worker process: point the user cache and shipped configs under ``root``, clear
    the autotune env vars and the in-memory tables."""
    os.environ["EP_MOE_CACHE_DIR"] = str(root / "cache")
    os.environ["EP_MOE_SHIPPED_DIR"] = str(root / "shipped")
    os.environ.pop(ENV_DISABLE, None)
    os.environ.pop(ENV_FORCE, None)
    clear_memory_cache()


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A fresh cache directory, no shipped configs, no autotune env vars, empty memory."""
    monkeypatch.setenv("EP_MOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EP_MOE_SHIPPED_DIR", str(tmp_path / "shipped"))
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    monkeypatch.delenv(ENV_FORCE, raising=False)
    clear_memory_cache()
    yield tmp_path
    clear_memory_cache()


@dataclass(frozen=True)
class CountingTuner:
    """Stub tuner: appends one line per call to ``log``, sleeps ``delay``, optionally raises,
    and returns :data:`STUB_CONFIGS` for every bucket."""

    log: str
    delay: float = 0.0
    fail: bool = False

    def __call__(self, problem: GemmProblem, dev: Any, buckets: tuple[int, ...]) -> Table:
        rank = dist.get_rank() if dist.is_initialized() else -1
        with open(self.log, "a") as f:
            f.write(f"{rank} {os.getpid()} {problem.projection} {list(buckets)}\n")
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("stub tuning failure")
        timing = CandidateTiming(config=STUB_CONFIG, median_ms=1.0, p20_ms=0.9, p80_ms=1.1)
        return {b: TunedBucket(configs=STUB_CONFIGS, timings={"forward": (timing,)},
                               default_ms={"forward": 2.0}) for b in buckets}


def tune_calls(log: Path) -> list[str]:
    """Lines the stub tuner wrote (one per tuning call)."""
    return log.read_text().splitlines() if log.exists() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, nprocs: int, port: int | None, tmp: str, args: tuple) -> None:
    if port is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=nprocs, timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, Path(tmp), *args)
    except BaseException:
        Path(tmp, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if port is not None:
            dist.destroy_process_group()
    Path(tmp, f"result{rank}.json").write_text(json.dumps(result))


# Children fork from a fresh server process that has imported torch and ep_moe once but
# never run anything: as clean as "spawn", without paying the ~4 s import per child (16
# children on 2 cores). The server keeps the environment it started with, so workers set
# what they need (set_cache_env) instead of inheriting the test's monkeypatched env.
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "torch.distributed", "torch.multiprocessing", "ep_moe.autotune"])


def run_processes(fn: Callable, nprocs: int, tmp: Path, *args: Any, gloo: bool = True,
                  timeout: float = 150.0) -> list[Any]:
    """Run ``fn(rank, tmp, *args)`` in ``nprocs`` new processes and return their
    JSON-able results by rank. With ``gloo`` the processes form a gloo world first.
    Processes still running after ``timeout`` seconds are killed and the test fails."""
    ctx = mp.start_processes(_entry, args=(fn, nprocs, free_port() if gloo else None, str(tmp), args),
                             nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise AssertionError(f"processes still running after {timeout}s: a hang")
    except mp.ProcessRaisedException as e:
        errors = "\n".join(f"--- rank {p.name[5:-4]}:\n{p.read_text()}" for p in sorted(tmp.glob("error*.txt")))
        raise AssertionError(f"a process failed:\n{errors}") from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads(Path(tmp, f"result{r}.json").read_text()) for r in range(nprocs)]


def wait_for_peers(tmp: Path, rank: int, nprocs: int, timeout: float = 120.0) -> None:
    """File barrier: returns once all ``nprocs`` processes have reached it."""
    Path(tmp, f"ready{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(tmp.glob("ready*"))) < nprocs:
        if time.monotonic() > deadline:
            raise TimeoutError("peers never became ready")
        time.sleep(0.01)
