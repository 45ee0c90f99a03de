"""16 processes race to warm up the same key: exactly one tunes, all get its configs."""

from __future__ import annotations

import json

import pytest
from _dist import STUB_CONFIGS, TINY, CountingTuner, set_cache_env, tune_calls, wait_for_peers
from dist_utils import run_distributed

from ep_moe.autotune import warmup
from ep_moe.autotune.cache import cache_dir, read_file

NPROCS = 16


def _race(rank, nprocs, tmp):
    set_cache_env(tmp)
    wait_for_peers(tmp, rank, nprocs)
    # The delay keeps the winner tuning while every other process reaches the lock.
    result = warmup([TINY], num_tokens=64, tuner=CountingTuner(str(tmp / "tunes.log"), delay=1.0))[TINY]
    return {"source": result.source, "configs": result.for_rows(128).forward.to_dict()}


@pytest.mark.distributed
def test_sixteen_processes_one_tuning(tmp_path, monkeypatch):
    results = run_distributed(_race, NPROCS, tmp_path, gloo=False, start_method="forkserver", deadline_s=150)
    assert len(tune_calls(tmp_path / "tunes.log")) == 1
    assert sorted(r["source"] for r in results) == ["cache"] * (NPROCS - 1) + ["tuned"]
    assert all(r["configs"] == STUB_CONFIGS.forward.to_dict() for r in results)
    monkeypatch.setenv("EP_MOE_CACHE_DIR", str(tmp_path / "cache"))
    files = list(cache_dir().glob("*.json"))
    assert len(files) == 1
    data, why = read_file(files[0])
    assert why is None and json.loads(files[0].read_text()) == data
    assert not list(cache_dir().glob(".*.tmp"))
