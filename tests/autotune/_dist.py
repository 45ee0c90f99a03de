"""Helpers of the autotune tests: tiny problems, an isolated cache, a counting stub tuner, a
lock holder in another (stopped) process, and what workers run by
``dist_utils.run_distributed`` need (``set_cache_env``, ``wait_for_peers``).

Imported by the test modules as ``_dist`` (pytest puts this directory on ``sys.path``;
the worker processes inherit it), so objects defined here can be pickled by name. The
process tests run their workers with ``start_method="forkserver"`` (torch and ep_moe
imported once, not per child); workers set the cache env they need (set_cache_env).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

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
    """Stub tuner: appends one line per call to ``log``, sleeps ``delay``, optionally stops
    its process (SIGSTOP: frozen until another process sends SIGCONT), optionally raises, and
    returns :data:`STUB_CONFIGS` for every bucket."""

    log: str
    delay: float = 0.0
    fail: bool = False
    freeze: bool = False

    def __call__(self, problem: GemmProblem, dev: Any, buckets: tuple[int, ...]) -> Table:
        rank = dist.get_rank() if dist.is_initialized() else -1
        with open(self.log, "a") as f:
            f.write(f"{rank} {os.getpid()} {problem.projection} {list(buckets)}\n")
        time.sleep(self.delay)
        if self.freeze:
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.fail:
            raise RuntimeError("stub tuning failure")
        timing = CandidateTiming(config=STUB_CONFIG, median_ms=1.0, p20_ms=0.9, p80_ms=1.1)
        return {b: TunedBucket(configs=STUB_CONFIGS, timings={"forward": (timing,)},
                               default_ms={"forward": 2.0}) for b in buckets}


_HOLD_LOCKS = """import filelock, os, signal, sys
locks = [filelock.FileLock(path) for path in sys.argv[1:]]
for lock in locks:
    lock.acquire()
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@contextmanager
def locks_held_by_a_stopped_process(*lock_paths: Path):
    """Another process acquires the file locks ``lock_paths`` and stops itself (SIGSTOP): a
    holder that never lets go until it is killed on exit."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCKS, *map(str, lock_paths)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held", "the lock holder failed to start"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def tune_calls(log: Path) -> list[str]:
    """Lines the stub tuner wrote (one per tuning call)."""
    return log.read_text().splitlines() if log.exists() else []


def wait_for_peers(tmp: Path, rank: int, nprocs: int, timeout: float = 120.0) -> None:
    """File barrier: returns once all ``nprocs`` processes have reached it."""
    Path(tmp, f"ready{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(tmp.glob("ready*"))) < nprocs:
        if time.monotonic() > deadline:
            raise TimeoutError("peers never became ready")
        time.sleep(0.01)
