"""Fixtures the fault probes share: the trainer's modules in this process, outside torchrun; a
fresh autotune cache directory; a bound on every probe of a module that sets ``PROBE_TIMEOUT_S``."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch.distributed as dist

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each rank; the probes run without it (a process group of one)."""


@pytest.fixture
def train(monkeypatch):
    """The modules of ``ep_moe.train``, with no torchrun environment; any process group a
    probe starts is torn down afterwards."""
    for var in TORCHRUN_ENV:
        monkeypatch.delenv(var, raising=False)
    from ep_moe.train import checkpoint, config, data, errors, model, train, trainer

    yield SimpleNamespace(checkpoint=checkpoint, config=config, data=data, errors=errors, model=model,
                          train=train, trainer=trainer)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def group(train):
    """A gloo group of one, as the trainer forms without torchrun."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """A fresh autotune cache directory (not created yet), no shipped configs, no autotune env
    vars, the in-memory cache cleared before and after."""
    from ep_moe.autotune import clear_memory_cache, coordinate

    monkeypatch.setenv("EP_MOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EP_MOE_SHIPPED_DIR", str(tmp_path / "shipped"))
    monkeypatch.delenv(coordinate.ENV_DISABLE, raising=False)
    monkeypatch.delenv(coordinate.ENV_FORCE, raising=False)
    clear_memory_cache()
    yield tmp_path / "cache"
    clear_memory_cache()


@pytest.fixture(autouse=True)
def no_hang(request):
    """Every probe of a module with ``PROBE_TIMEOUT_S`` ends within it, or fails as a hang."""
    seconds = getattr(request.module, "PROBE_TIMEOUT_S", None)
    if seconds is None:
        yield
        return

    def timed_out(signum, frame):
        raise TimeoutError(f"probe still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
