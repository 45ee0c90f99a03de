"""The JSON cache: keys, round trips, validation of bad files, unwritable directories."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import filelock
import pytest
from _dist import STUB_CONFIGS, TINY, TINY_UP, CountingTuner, locks_held_by_a_stopped_process, tune_calls

from ep_moe.autotune.cache import (
    SCHEMA_VERSION,
    CacheKey,
    CacheLockTimeout,
    ConfigCache,
    cache_dir,
    device_dir_name,
    load_model_shape,
    load_shipped,
    make_key,
    read_file,
)
from ep_moe.autotune.space import DeviceLimits

DEV = DeviceLimits(name="NVIDIA H100 80GB HBM3", smem_per_block=232448, num_sms=132, capability=(9, 0))


def stub_table(tmp_path, buckets=(1024, 4096)):
    return CountingTuner(os.devnull)(TINY, DEV, buckets)


def test_key_json_round_trip_and_digest():
    key = make_key(TINY, DEV)
    back = CacheKey.from_dict(json.loads(json.dumps(key.to_dict())))
    assert back == key and back.digest() == key.digest()
    assert isinstance(back.capability, tuple) and isinstance(back.passes, tuple)
    assert key.file_name().startswith("down-e4-n64-k48-top2-float32-NVIDIA_H100_80GB_HBM3-")
    assert key.problem() == TINY


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(CacheKey)])
def test_any_key_field_change_misses(tmp_path, field):
    cache = ConfigCache(tmp_path)
    key = make_key(TINY, DEV)
    cache.store(key, stub_table(tmp_path))
    value = getattr(key, field)
    if field == "projection":
        other = "gate_up"  # the one other value a key may have
    elif isinstance(value, tuple):
        other = value[:-1] + (value[-1] + 1,) if isinstance(value[-1], int) else value + ("x",)
    else:
        other = value + 1 if isinstance(value, int) else value + "x"
    changed = dataclasses.replace(key, **{field: other})
    assert changed.digest() != key.digest()
    assert ConfigCache(tmp_path).load(changed) is None
    assert ConfigCache(tmp_path).load(key) == stub_table(tmp_path)


def test_store_load_round_trip_through_json(tmp_path):
    key, table = make_key(TINY, DEV), stub_table(tmp_path)
    ConfigCache(tmp_path).store(key, table)
    path = tmp_path / key.file_name()
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["key"] == key.to_dict()
    assert set(data["buckets"]) == {"1024", "4096"}
    assert {"torch", "triton", "ep_moe"} <= set(data["versions"])
    assert ConfigCache(tmp_path).load(key) == table
    assert not list(tmp_path.glob(".*.tmp")), "temp file left behind"


def _valid_text(tmp_path):
    key = make_key(TINY, DEV)
    ConfigCache(tmp_path / "src").store(key, stub_table(tmp_path))
    return (tmp_path / "src" / key.file_name()).read_text()


BAD_FILES = {
    "garbage": lambda text: "\x00\xff not json at all",
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "wrong_schema": lambda text: text.replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 999'),
    "foreign_key": lambda text: text.replace('"n": 64', '"n": 65'),
    "bad_config": lambda text: text.replace('"BLOCK_M": 16', '"BLOCK_M": 17'),
    "float_field": lambda text: text.replace('"num_stages": 1', '"num_stages": 1.5'),
    "string_flag": lambda text: text.replace('"use_tma": false', '"use_tma": "no"'),
    "list": lambda text: "[1, 2, 3]",
    "key_not_object": lambda text: json.dumps({**json.loads(text), "key": "edited"}),
    "huge_number": lambda text: "[" + "9" * 5000 + "]",
    "deep_nesting": lambda text: "[" * 200000,
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_ignored_with_warning_then_replaced(tmp_path, caplog, kind):
    key = make_key(TINY, DEV)
    bad = BAD_FILES[kind](_valid_text(tmp_path))
    cache = ConfigCache(tmp_path / "c")
    (tmp_path / "c").mkdir()
    cache.path(key).write_text(bad, encoding="utf-8", errors="surrogateescape")
    with caplog.at_level(logging.WARNING):
        assert cache.load(key) is None
    assert "ignoring" in caplog.text and key.file_name() in caplog.text
    log = tmp_path / "tunes.log"
    table, source = cache.get_or_tune(key, (1024,), lambda b: CountingTuner(str(log))(TINY, DEV, b))
    assert source == "tuned" and len(tune_calls(log)) == 1
    data, why = read_file(cache.path(key))
    assert why is None and ConfigCache(tmp_path / "c").load(key) == table


def test_unwritable_directory_memory_only_one_warning(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = ConfigCache(blocker / "cache")  # mkdir under a regular file fails, even as root
    log = tmp_path / "tunes.log"
    tune = lambda b: CountingTuner(str(log))(TINY, DEV, b)  # noqa: E731
    with caplog.at_level(logging.WARNING):
        table, source = cache.get_or_tune(make_key(TINY, DEV), (1024,), tune)
        again, source2 = cache.get_or_tune(make_key(TINY, DEV), (1024,), tune)
        cache.get_or_tune(make_key(TINY_UP, DEV), (1024,), tune)
        cache.store(make_key(TINY_UP, DEV), table)
    assert (source, source2) == ("tuned", "cache") and again == table
    assert cache.memory_only and len(tune_calls(log)) == 2
    assert [r.message for r in caplog.records if r.levelno >= logging.WARNING][0].startswith(
        "ep_moe autotune cache: cannot write")
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_get_or_tune_tunes_only_missing_buckets_and_force_retunes(tmp_path):
    cache, key, log = ConfigCache(tmp_path), make_key(TINY, DEV), tmp_path / "tunes.log"
    tune = lambda b: CountingTuner(str(log))(TINY, DEV, b)  # noqa: E731
    cache.get_or_tune(key, (1024,), tune)
    table, source = cache.get_or_tune(key, (1024, 4096), tune)
    assert source == "tuned" and set(table) == {1024, 4096}
    assert tune_calls(log)[-1].endswith("[4096]")
    assert cache.get_or_tune(key, (4096,), tune)[1] == "cache"
    assert cache.get_or_tune(key, (4096,), tune, force=True)[1] == "tuned"
    assert len(tune_calls(log)) == 3


def test_find_list_clear(tmp_path):
    cache, key = ConfigCache(tmp_path), make_key(TINY, DEV)
    cache.store(key, stub_table(tmp_path))
    assert cache.files() == [cache.path(key)]
    assert cache.find(key.digest()) == cache.path(key) == cache.find(key.file_name())
    assert cache.find("down-e4") == cache.path(key) and cache.find("nothing") is None
    assert cache.clear().removed == [cache.path(key)]
    assert cache.files() == [] and cache.load(key) is None
    assert list(tmp_path.iterdir()) == [], "the lock file goes with its cache file"


def test_clear_leaves_a_file_that_is_being_tuned(tmp_path):
    cache, key = ConfigCache(tmp_path), make_key(TINY, DEV)
    cache.store(key, stub_table(tmp_path))
    with filelock.FileLock(str(cache.path(key)) + ".lock"):
        report = ConfigCache(tmp_path).clear(lock_timeout=0.1)
    assert report.removed == [] and report.kept == [(cache.path(key), "locked for 0.1s (being tuned?)")]
    assert cache.files() == [cache.path(key)]


def test_merge_keeps_the_buckets_on_file_and_gives_up_on_a_held_lock(tmp_path, caplog):
    cache, key = ConfigCache(tmp_path), make_key(TINY, DEV)
    cache.store(key, stub_table(tmp_path, buckets=(16,)))
    assert cache.merge(key, stub_table(tmp_path, buckets=(128,)), lock_timeout=1.0)
    assert sorted(ConfigCache(tmp_path).load(key)) == [16, 128]
    with filelock.FileLock(str(cache.path(key)) + ".lock"), caplog.at_level(logging.WARNING):
        start = time.monotonic()
        assert not cache.merge(key, stub_table(tmp_path, buckets=(4096,)), lock_timeout=0.2)
        assert time.monotonic() - start < 5
    assert "stayed locked" in caplog.text and sorted(ConfigCache(tmp_path).load(key)) == [16, 128]


def test_shipped_matches_ignoring_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("EP_MOE_SHIPPED_DIR", str(tmp_path / "shipped"))
    key = make_key(TINY, DEV)
    old = dataclasses.replace(key, torch_version="2.6.0", triton_version="3.2.0", num_sms=114)
    ConfigCache(tmp_path / "tuned").store(old, stub_table(tmp_path))
    device_dir = tmp_path / "shipped" / device_dir_name(DEV.name)
    device_dir.mkdir(parents=True)
    shutil.copy(tmp_path / "tuned" / old.file_name(), device_dir)
    assert load_shipped(key)[1024].configs == STUB_CONFIGS
    assert load_shipped(dataclasses.replace(key, device_name="NVIDIA H200")) is None
    assert load_shipped(dataclasses.replace(key, kernel_version=key.kernel_version + 1)) is None


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3", "tiny"])
def test_model_presets_load(name):
    shape = load_model_shape(name)
    assert shape.name == name and len(shape.problems(1, "bfloat16")) == 2


def test_model_unknown_names_presets():
    with pytest.raises(ValueError, match="presets: .*mixtral-8x7b"):
        load_model_shape("no-such-model")


def test_write_denied_in_existing_directory_memory_only(tmp_path, monkeypatch, caplog):
    """As a non-root user in a read-only directory (tests run as root, so chmod would not deny)."""
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("ep_moe.autotune.cache.tempfile.mkstemp", denied)
    cache, key, log = ConfigCache(tmp_path), make_key(TINY, DEV), tmp_path / "tunes.log"
    with caplog.at_level(logging.WARNING):
        table, source = cache.get_or_tune(key, (1024,), lambda b: CountingTuner(str(log))(TINY, DEV, b))
        assert cache.get_or_tune(key, (1024,), lambda b: CountingTuner(str(log))(TINY, DEV, b)) == (table, "cache")
    assert source == "tuned" and cache.memory_only and len(tune_calls(log)) == 1
    assert not cache.path(key).exists()
    assert sum("cannot write" in r.message for r in caplog.records) == 1


def test_lock_released_after_store_and_tuning(tmp_path):
    import filelock

    cache, key = ConfigCache(tmp_path), make_key(TINY, DEV)
    cache.store(key, stub_table(tmp_path))
    cache.get_or_tune(make_key(TINY_UP, DEV), (16,), lambda b: stub_table(tmp_path, b))
    for k in (key, make_key(TINY_UP, DEV)):
        other = filelock.FileLock(str(cache.path(k)) + ".lock", timeout=0)
        other.acquire()  # raises filelock.Timeout if this process still held it
        other.release()


def test_every_lock_wait_is_bounded_when_a_stopped_process_holds_the_lock(tmp_path, caplog):
    """``store`` and ``get_or_tune`` waited forever on a lock held by a stopped process."""
    cache, key, log = ConfigCache(tmp_path), make_key(TINY, DEV), tmp_path / "tunes.log"
    table = stub_table(tmp_path)
    with locks_held_by_a_stopped_process(str(cache.path(key)) + ".lock"), caplog.at_level(logging.WARNING):
        start = time.monotonic()
        cache.store(key, table, lock_timeout=0.5)
        assert time.monotonic() - start < 5
        assert "stayed locked for 0.5s" in caplog.text and "kept in memory" in caplog.text
        assert cache.load(key) == table and not cache.path(key).exists()
        other = ConfigCache(tmp_path)
        start = time.monotonic()
        with pytest.raises(CacheLockTimeout, match="stayed locked for 0.5s: another process"):
            other.get_or_tune(key, (1024,), lambda b: CountingTuner(str(log))(TINY, DEV, b), lock_timeout=0.5)
        assert time.monotonic() - start < 5 and tune_calls(log) == []


@pytest.mark.parametrize("timeout", [-1, float("inf"), float("nan")])
def test_an_unbounded_lock_wait_is_refused(tmp_path, timeout):
    with pytest.raises(ValueError, match="lock_timeout=.*bounded"):
        ConfigCache(tmp_path).store(make_key(TINY, DEV), stub_table(tmp_path), lock_timeout=timeout)


def test_clear_removes_only_what_it_wrote(tmp_path):
    cache, key, up = ConfigCache(tmp_path), make_key(TINY, DEV), make_key(TINY_UP, DEV)
    cache.store(key, stub_table(tmp_path))
    cache.store(up, stub_table(tmp_path))
    (tmp_path / "settings.json").write_text('{"theme": "dark"}')  # listed as INVALID, then deleted, before
    (tmp_path / "notes.txt").write_text("mine")
    named_like_ours = tmp_path / make_key(dataclasses.replace(TINY, n=128), DEV).file_name()
    named_like_ours.write_text('{"schema_version": 0}')
    linked = tmp_path / make_key(dataclasses.replace(TINY, n=256), DEV).file_name()
    linked.symlink_to(cache.path(key))  # never followed, never deleted
    leftover = tmp_path / f".{cache.path(up).name}.abc123.tmp"  # a writer killed before os.replace
    leftover.write_text("{")
    orphan_lock = tmp_path / (make_key(dataclasses.replace(TINY, n=512), DEV).file_name() + ".lock")
    orphan_lock.touch()  # a tuning that failed before writing
    report = cache.clear(lock_timeout=1.0)
    assert sorted(report.removed) == sorted([cache.path(key), cache.path(up)]) and report.failed == []
    kept = dict(report.kept)
    assert kept[tmp_path / "settings.json"].startswith("foreign") and kept[tmp_path / "notes.txt"].startswith("foreign")
    assert "schema_version 0" in kept[named_like_ours] and kept[linked].startswith("foreign: a symlink to ")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([linked.name, named_like_ours.name, "notes.txt",
                                                                 "settings.json"])


def test_read_file_reports_a_file_holding_another_keys_record(tmp_path):
    cache, key = ConfigCache(tmp_path), make_key(TINY, DEV)
    cache.store(key, stub_table(tmp_path))
    other = tmp_path / make_key(TINY_UP, DEV).file_name()
    shutil.copyfile(cache.path(key), other)
    data, why = read_file(other)
    assert data is None and f"holds the key of {key.file_name()}" in why
    assert read_file(cache.path(key))[1] is None


def test_read_file_never_follows_a_symlink(tmp_path):
    cache, key = ConfigCache(tmp_path), make_key(TINY, DEV)
    cache.store(key, stub_table(tmp_path))
    other = tmp_path / make_key(TINY_UP, DEV).file_name()
    other.symlink_to(cache.path(key))
    data, why = read_file(other)
    assert data is None and why == f"a symlink to {cache.path(key)}: the cache opens regular files only, never " \
                                   f"through a link"


def test_the_tests_never_use_the_users_cache(tmp_path_factory):
    """conftest points EP_MOE_CACHE_DIR at a directory of this pytest session."""
    assert Path(tmp_path_factory.getbasetemp()) in cache_dir().parents
    assert Path.home() / ".cache" / "ep_moe" not in [cache_dir(), *cache_dir().parents]
