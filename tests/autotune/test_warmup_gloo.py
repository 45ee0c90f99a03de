"""warmup across 4 gloo processes: rank 0 alone tunes; a failing rank 0 leaves everyone on
the same fallback; a rank 0 frozen past the timeout leaves everyone, itself included once
thawed, on the same fallback, the others within the timeout and grace (no hang).

The scenarios run in order in one 4-process world (one start-up for all).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import filelock
import pytest
import torch.distributed as dist
from _dist import STUB_CONFIGS, TINY, TINY_UP, CountingTuner, set_cache_env, tune_calls
from dist_utils import run_distributed

from ep_moe.autotune import WarmupTimeout, device_limits, get_kernel_configs, warmup
from ep_moe.autotune.cache import ConfigCache, cache_dir, make_key
from ep_moe.autotune.space import heuristic_configs

NPROCS = 4
SPLIT_PROBLEMS = [TINY, TINY_UP] + [dataclasses.replace(TINY, top_k=k) for k in (1, 3, 4)]
STALL_TIMEOUT = 2.0
STALL_GRACE = 1.0  # coordinate._publish_grace(STALL_TIMEOUT)
LOCK_TIMEOUT = 2.0


def _rendezvous_store_type() -> str:
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return type(store).__name__


def _scenarios(rank, world_size, tmp):
    out = {"store": _rendezvous_store_type()}
    # 1. Normal: rank 0 tunes both problems, everyone installs what it sent.
    set_cache_env(tmp / "ok")
    resolved = warmup([TINY, TINY_UP], num_tokens=64, tuner=CountingTuner(str(tmp / "ok.log")))
    out["ok"] = {
        "sources": [r.source for r in resolved.values()],
        "tables": [r.to_dict() for r in resolved.values()],
        "served": get_kernel_configs(TINY, 128).forward.to_dict(),
        "cache_files": len(list((tmp / "ok" / "cache").glob("*.json"))),
    }
    # 2. Rank 0's tuning raises: everyone ends on the same heuristic configs.
    set_cache_env(tmp / "fail")
    resolved = warmup([TINY], num_tokens=64, tuner=CountingTuner(str(tmp / "fail.log"), fail=True))
    out["fail"] = {"source": resolved[TINY].source, "error": resolved[TINY].error,
                   "table": resolved[TINY].to_dict(),
                   "served": get_kernel_configs(TINY, 128).forward.to_dict()}
    # 3. Rank 0 freezes (SIGSTOP) in its tuning, past the timeout: the others give up after the
    # timeout and grace; rank 1 then thaws it, and rank 0 learns that they gave up.
    set_cache_env(tmp / "stall")
    if rank == 0:
        (tmp / "rank0.pid").write_text(str(os.getpid()))
    dist.barrier()
    start = time.monotonic()
    resolved = warmup([TINY], num_tokens=64, timeout=STALL_TIMEOUT,
                      tuner=CountingTuner(str(tmp / "stall.log"), freeze=True))
    out["stall"] = {"seconds": time.monotonic() - start, "source": resolved[TINY].source,
                    "error": resolved[TINY].error, "table": resolved[TINY].to_dict()}
    if rank == 1:
        os.kill(int((tmp / "rank0.pid").read_text()), signal.SIGCONT)
    # 3b. Another process holds the cache lock rank 0 needs: rank 0 stops waiting by the
    # timeout and publishes the fallback, which the others (waiting a grace longer) take.
    set_cache_env(tmp / "locked")
    lock = filelock.FileLock(str(ConfigCache(cache_dir()).path(make_key(TINY, device_limits()))) + ".lock")
    if rank == 1:
        lock.acquire()
    dist.barrier()
    start = time.monotonic()
    try:
        resolved = warmup([TINY], num_tokens=64, timeout=LOCK_TIMEOUT, tuner=CountingTuner(str(tmp / "locked.log")))
        out["locked"] = {"source": resolved[TINY].source, "error": resolved[TINY].error}
    except WarmupTimeout as e:
        out["locked"] = {"source": None, "error": str(e)}
    out["locked"]["seconds"] = time.monotonic() - start
    dist.barrier()
    if rank == 1:
        lock.release()
    # 4. Split tuning over the node's ranks: each problem tuned once, by its share's owner.
    set_cache_env(tmp / "split")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(NPROCS))
    resolved = warmup(SPLIT_PROBLEMS, num_tokens=64, split_tuning=True,
                      tuner=CountingTuner(str(tmp / "split.log")))
    out["split"] = {"tables": [resolved[p].to_dict() for p in SPLIT_PROBLEMS]}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo")
    return tmp, run_distributed(_scenarios, NPROCS, tmp, start_method="forkserver", timeout_s=60, deadline_s=150)


@pytest.mark.distributed
def test_only_rank0_tunes_and_all_ranks_agree(runs):
    tmp, results = runs
    calls = tune_calls(tmp / "ok.log")
    assert [c.split()[0] for c in calls] == ["0", "0"], "only rank 0 tunes, once per problem"
    first = results[0]["ok"]
    assert first["sources"] == ["tuned", "tuned"]
    for r in results:
        assert r["ok"]["tables"] == first["tables"]
        assert r["ok"]["served"] == STUB_CONFIGS.forward.to_dict()
    assert first["cache_files"] == 2


@pytest.mark.distributed
def test_rank0_failure_same_fallback_everywhere(runs):
    tmp, results = runs
    assert [c.split()[0] for c in tune_calls(tmp / "fail.log")] == ["0"]
    expected = heuristic_configs(TINY, 128, device_limits()).forward.to_dict()
    for r in results:
        assert r["fail"]["source"] == "fallback" and "stub tuning failure" in r["fail"]["error"]
        assert r["fail"]["table"] == results[0]["fail"]["table"]
        assert r["fail"]["served"] == expected


@pytest.mark.distributed
def test_a_frozen_rank0_leaves_every_rank_on_the_same_fallback(runs):
    """Rank 0 used to return its tuned configs after the others had raised WarmupTimeout."""
    tmp, results = runs
    assert [c.split()[0] for c in tune_calls(tmp / "stall.log")] == ["0"]
    expected = heuristic_configs(TINY, 128, device_limits()).forward.to_dict()
    for r in results:
        stall = r["stall"]
        assert stall["source"] == "fallback" and "gave up for every rank" in stall["error"], stall
        assert stall["table"] == results[0]["stall"]["table"]
        assert stall["table"]["table"]["128"]["configs"]["forward"] == expected
    for r in results[1:]:
        assert STALL_TIMEOUT <= r["stall"]["seconds"] < STALL_TIMEOUT + STALL_GRACE + 5, r["stall"]


@pytest.mark.distributed
def test_the_rendezvous_store_is_bound_when_it_is_made(runs):
    """The harness rendezvous through a file (no port picked, released and bound again later)."""
    _, results = runs
    assert {r["store"] for r in results} == {"FileStore"}


@pytest.mark.distributed
def test_a_held_cache_lock_leaves_every_rank_on_the_same_fallback(runs):
    tmp, results = runs
    assert tune_calls(tmp / "locked.log") == []
    for r in results:
        locked = r["locked"]
        assert locked["source"] == "fallback" and "Timeout" in locked["error"], locked
        assert locked["seconds"] < LOCK_TIMEOUT + 10, locked


@pytest.mark.distributed
def test_split_tuning_spreads_problems_over_local_ranks(runs):
    tmp, results = runs
    by_rank = sorted(c.split()[0] for c in tune_calls(tmp / "split.log"))
    assert by_rank == ["0", "0", "1", "2", "3"], "each problem tuned once, by LOCAL_RANK::4"
    for r in results:
        assert r["split"]["tables"] == results[0]["split"]["tables"]
        assert [t["source"] for t in r["split"]["tables"]] == ["tuned"] * len(r["split"]["tables"])
