"""The lookup chain (memory -> cache -> shipped -> tune -> heuristic), env vars and
single-process warmup, with a stub tuner."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time

import pytest
import torch
from _dist import (  # noqa: F401
    STUB_CONFIGS,
    TINY,
    TINY_UP,
    CountingTuner,
    isolated,
    locks_held_by_a_stopped_process,
    tune_calls,
)

from ep_moe.autotune import clear_memory_cache, collect_problems, device_limits, get_kernel_configs, warmup
from ep_moe.autotune.cache import ConfigCache, cache_dir, device_dir_name, make_key
from ep_moe.autotune.space import STANDARD_BUCKETS, TunedBucket, heuristic_configs
from ep_moe.kernels.config import GemmConfigs, KernelConfig

DEV = device_limits(torch.device("cpu"))
OTHER = GemmConfigs(forward=KernelConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2))


def store(directory, table):
    ConfigCache(directory).store(make_key(TINY, DEV), table)


def test_nothing_cached_serves_heuristic_and_logs_once(isolated, caplog):
    with caplog.at_level(logging.INFO, logger="ep_moe.autotune"):
        first = get_kernel_configs(TINY, 64)
        assert get_kernel_configs(TINY, 64) == first
        get_kernel_configs(TINY, 100000)
    assert first == heuristic_configs(TINY, 64, DEV)
    served = [r for r in caplog.records if "served from heuristic" in r.message]
    assert len(served) == 1


def test_cache_file_served_by_nearest_bucket(isolated):
    store(cache_dir(), {1024: TunedBucket(configs=STUB_CONFIGS), 4096: TunedBucket(configs=OTHER)})
    assert get_kernel_configs(TINY, 10) == STUB_CONFIGS
    assert get_kernel_configs(TINY, 2000) == STUB_CONFIGS
    assert get_kernel_configs(TINY, 3000) == OTHER
    assert get_kernel_configs(TINY, 10**6) == OTHER
    assert get_kernel_configs(TINY_UP, 1024) == heuristic_configs(TINY_UP, 1024, DEV)


def test_shipped_served_when_no_user_cache(isolated):
    store(isolated / "tuned", {1024: TunedBucket(configs=OTHER)})
    shipped = isolated / "shipped" / device_dir_name(DEV.name)
    shipped.mkdir(parents=True)
    for f in (isolated / "tuned").glob("*.json"):
        shutil.copy(f, shipped)
    assert get_kernel_configs(TINY, 1024) == OTHER
    clear_memory_cache()
    store(cache_dir(), {1024: TunedBucket(configs=STUB_CONFIGS)})
    assert get_kernel_configs(TINY, 1024) == STUB_CONFIGS, "the user cache comes before shipped configs"


def test_warmup_tunes_once_then_cache_then_memory(isolated):
    log = isolated / "tunes.log"
    tuner = CountingTuner(str(log))
    first = warmup([TINY, TINY_UP, TINY], tuner=tuner, num_tokens=64)
    assert [r.source for r in first.values()] == ["tuned", "tuned"]
    assert [line.split()[-1] for line in tune_calls(log)] == ["[128]", "[128]"]  # 64 tokens x top-2
    assert get_kernel_configs(TINY, 128) == STUB_CONFIGS
    clear_memory_cache()  # as a new process would start
    second = warmup([TINY], tuner=tuner, num_tokens=64)
    assert second[TINY].source == "cache" and len(tune_calls(log)) == 2
    ConfigCache(cache_dir()).clear()
    assert get_kernel_configs(TINY, 128) == STUB_CONFIGS, "memory is consulted before files"


def test_warmup_default_buckets(isolated):
    log = isolated / "tunes.log"
    result = warmup(TINY, tuner=CountingTuner(str(log)))
    assert tuple(sorted(result[TINY].table)) == STANDARD_BUCKETS


def test_force_env_retunes(isolated, monkeypatch):
    log = isolated / "tunes.log"
    warmup([TINY], tuner=CountingTuner(str(log)), num_tokens=64)
    clear_memory_cache()
    monkeypatch.setenv("EP_MOE_FORCE_AUTOTUNE", "1")
    assert warmup([TINY], tuner=CountingTuner(str(log)), num_tokens=64)[TINY].source == "tuned"
    clear_memory_cache()
    monkeypatch.delenv("EP_MOE_FORCE_AUTOTUNE")
    assert warmup([TINY], tuner=CountingTuner(str(log)), num_tokens=64, force=True)[TINY].source == "tuned"
    assert len(tune_calls(log)) == 3


def test_disable_env_never_tunes_nor_reads_user_cache(isolated, monkeypatch):
    store(cache_dir(), {128: TunedBucket(configs=OTHER)})
    monkeypatch.setenv("EP_MOE_DISABLE_AUTOTUNE", "1")
    log = isolated / "tunes.log"
    result = warmup([TINY], tuner=CountingTuner(str(log)), num_tokens=64, force=True)
    assert result[TINY].source == "heuristic" and tune_calls(log) == []
    assert get_kernel_configs(TINY, 128) == heuristic_configs(TINY, 128, DEV)


def test_tuning_failure_falls_back_with_warning(isolated, caplog):
    with caplog.at_level(logging.WARNING):
        result = warmup([TINY], tuner=CountingTuner(str(isolated / "log"), fail=True), num_tokens=64)
    assert result[TINY].source == "fallback" and "stub tuning failure" in result[TINY].error
    assert get_kernel_configs(TINY, 128) == heuristic_configs(TINY, 128, DEV)
    assert "using heuristic configs" in caplog.text


def test_get_kernel_configs_is_cheap(isolated):
    get_kernel_configs(TINY, 100)
    start = time.perf_counter()
    for rows in range(20000):
        get_kernel_configs(TINY, rows)
    per_call = (time.perf_counter() - start) / 20000
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per call"


class _Layer(torch.nn.Module):
    def __init__(self, problems):
        super().__init__()
        self.problems = problems

    def gemm_problems(self):
        return list(self.problems)


def test_collect_problems_from_module_and_errors(isolated):
    model = torch.nn.Sequential(_Layer([TINY, TINY_UP]), torch.nn.Linear(2, 2), _Layer([TINY]))
    assert collect_problems(model) == [TINY, TINY_UP]
    assert set(warmup(model, tuner=CountingTuner(str(isolated / "log")))) == {TINY, TINY_UP}
    with pytest.raises(TypeError, match="model_or_shapes"):
        collect_problems([TINY, "gate_up"])
    with pytest.raises(ValueError, match="num_tokens"):
        warmup([TINY], num_tokens=0)
    with pytest.raises(ValueError, match="group is given"):
        warmup([TINY], group=object())


def test_other_node_leader_stores_rank0_tables_whose_key_matches(isolated):
    from ep_moe.autotune.coordinate import ResolvedConfigs, _write_node_cache

    table = {128: TunedBucket(configs=STUB_CONFIGS)}
    key = make_key(TINY, DEV)
    foreign = dataclasses.replace(make_key(TINY_UP, DEV), device_name="NVIDIA H200")
    items = [{"key": k.to_dict(), "resolved": ResolvedConfigs(source, table).to_dict()}
             for k, source in ((key, "tuned"), (foreign, "tuned"))]
    ConfigCache(cache_dir()).store(key, {16: TunedBucket(configs=OTHER)})  # the node's own bucket
    _write_node_cache(items, torch.device("cpu"), lock_timeout=5.0)
    assert ConfigCache(cache_dir()).load(key) == {16: TunedBucket(configs=OTHER), **table}
    assert ConfigCache(cache_dir()).load(foreign) is None
    assert len(list(cache_dir().glob("*.json"))) == 1


def test_cached_configs_that_overflow_the_device_are_not_served(isolated, caplog, monkeypatch):
    from ep_moe.autotune import coordinate

    monkeypatch.setitem(coordinate._LIMITS, ("cpu", -1), dataclasses.replace(DEV, smem_per_block=232448))
    huge = KernelConfig(BLOCK_M=256, BLOCK_N=256, BLOCK_K=256, num_warps=8, num_stages=4)
    store(cache_dir(), {128: TunedBucket(configs=GemmConfigs(forward=huge))})
    with caplog.at_level(logging.WARNING):
        resolved = get_kernel_configs(TINY, 128, device=torch.device("cpu"))
    assert resolved.forward != huge and "needs 2097152 bytes of shared memory, the device has 232448" in caplog.text


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("ON", True), ("0", False), ("off", False),
                                       ("no", False), ("", False), ("maybe", False)])
def test_env_flags(monkeypatch, caplog, value, on):
    from ep_moe.autotune.coordinate import ENV_FORCE, _env_flag

    monkeypatch.setenv(ENV_FORCE, value)
    with caplog.at_level(logging.WARNING):
        assert _env_flag(ENV_FORCE) is on
    assert ("neither on" in caplog.text) == (value == "maybe")


def test_warmup_refuses_a_timeout_that_is_not_positive(isolated):
    with pytest.raises(ValueError, match=r"timeout=-1: give a finite number of seconds in \(0, 604800\]"):
        warmup([TINY], timeout=-1)


def test_a_tuning_lookup_falls_back_when_a_stopped_process_holds_the_lock(isolated, caplog):
    """``get_kernel_configs(..., allow_tuning=True)`` waited forever on a held lock; now it
    falls back to the heuristic with warmup's warning, within the bound."""
    cache_dir().mkdir(parents=True)
    lock = str(ConfigCache(cache_dir()).path(make_key(TINY, DEV))) + ".lock"
    with locks_held_by_a_stopped_process(lock), caplog.at_level(logging.WARNING):
        start = time.monotonic()
        configs = get_kernel_configs(TINY, 128, allow_tuning=True, lock_timeout=0.5)
        assert time.monotonic() - start < 5
    assert configs == heuristic_configs(TINY, 128, DEV)
    assert "using heuristic configs" in caplog.text and "stayed locked for 0.5s" in caplog.text
