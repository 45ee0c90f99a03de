"""Fault injection for the autotune cache, its lookups and warmup coordination, and the
``ep-moe`` CLI: corrupt, truncated, empty and wrong-schema files, symlinks, foreign files,
read-only and missing directories, a directory that is a file, locks held by stopped or
sleeping processes, concurrent writers, failing tuners and stores.

Every probe ends clean: a clear error naming the thing and the fix (the CLI: one line on
stderr, a non-zero exit status, no traceback), or a warning and a correct fallback; never a
hang (each wait is bounded and checked), never lost data (a file that is not the cache's is
left byte for byte; a failed write leaves the old file whole).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ep_moe import cli
from ep_moe.autotune import GemmProblem, WarmupTimeout, coordinate, get_kernel_configs, warmup
from ep_moe.autotune.bench import device_limits
from ep_moe.autotune.cache import (
    CacheLockTimeout,
    ConfigCache,
    default_cache,
    device_dir_name,
    load_shipped,
    make_key,
    read_file,
)
from ep_moe.autotune.space import CandidateTiming, TunedBucket, heuristic_configs
from ep_moe.kernels.config import GemmConfigs, KernelConfig

pytestmark = pytest.mark.faults

PROBLEM = GemmProblem(projection="down", num_local_experts=4, n=64, k=48, top_k=2, dtype="float32")
OTHER_PROBLEM = dataclasses.replace(PROBLEM, n=128)
CPU = device_limits(torch.device("cpu"))
KEY = make_key(PROBLEM, CPU)
OTHER_KEY = make_key(OTHER_PROBLEM, CPU)
STUB = KernelConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=3, num_warps=2, num_stages=1)
STUB_CONFIGS = GemmConfigs(forward=STUB, dx=STUB, dw=STUB)
BOUND_S = 5.0  # a bounded wait of 0.5 s must return well within this


def table(buckets=(1024,)):
    """A tuned-looking table: the stub configs for each bucket."""
    timing = CandidateTiming(config=STUB, median_ms=1.0, p20_ms=0.9, p80_ms=1.1)
    return {b: TunedBucket(configs=STUB_CONFIGS, timings={"forward": (timing,)}, default_ms={"forward": 2.0})
            for b in buckets}


class StubTuner:
    """Counts its calls, optionally sleeps, raises or returns something that is not a table."""

    def __init__(self, delay=0.0, result="table"):
        self.calls, self.delay, self.result = 0, delay, result

    def __call__(self, problem, dev, buckets):
        self.calls += 1
        time.sleep(self.delay)
        if self.result == "raise":
            raise RuntimeError("stub tuning failure")
        return {"table": table(buckets), "empty": {}, "none": None}[self.result]


def run_cli(capsys, *args):
    """(exit status, stdout, stderr) of ``ep-moe ARGS``; a traceback would fail the probe."""
    try:
        status = cli.main(list(args))
    except SystemExit as e:  # argparse's own usage errors
        status = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def one_error_line(err: str) -> str:
    """The CLI's error output is exactly one line."""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry of ``directory`` by name: file bytes, or what a symlink or directory is."""
    found = {}
    for p in sorted(directory.iterdir()):
        found[p.name] = (f"-> {os.readlink(p)}" if p.is_symlink() else "<dir>" if p.is_dir() else p.read_bytes())
    return found


def stored(directory: Path, key=KEY, buckets=(1024,)) -> Path:
    """Write a valid cache file of ``key`` into ``directory``; its path."""
    cache = ConfigCache(directory)
    cache.store(key, table(buckets))
    return cache.path(key)


# --- A. bad contents of a cache file -----------------------------------------------------------


def _edit(change):
    """A bad-content maker that edits the decoded valid record."""
    def make(text: str) -> bytes:
        data = json.loads(text)
        change(data)
        return json.dumps(data).encode()
    return make


def _first_bucket(data):
    return next(iter(data["buckets"].values()))


BAD_CONTENTS = {
    "empty": lambda text: b"",
    "whitespace": lambda text: b"  \n\t ",
    "truncated half": lambda text: text.encode()[: len(text) // 2],
    "truncated last byte": lambda text: text.encode()[:-1],
    "garbage": lambda text: b"\x00\xff not json at all",
    "nul bytes": lambda text: b"\x00" * 64,
    "not utf-8": lambda text: text.encode().replace(b'"buckets"', b'"bu\xffckets"'),
    "utf-8 bom": lambda text: b"\xef\xbb\xbf" + text.encode(),
    "json null": lambda text: b"null",
    "json list": lambda text: b"[1, 2, 3]",
    "json string": lambda text: b'"a cache file"',
    "json number": lambda text: b"42",
    "huge number": lambda text: b"[" + b"9" * 5000 + b"]",
    "deep nesting": lambda text: b"[" * 200000,
    "schema missing": _edit(lambda d: d.pop("schema_version")),
    "schema old": _edit(lambda d: d.update(schema_version=0)),
    "schema future": _edit(lambda d: d.update(schema_version=2)),
    "schema as string": _edit(lambda d: d.update(schema_version="1")),
    "schema as true": _edit(lambda d: d.update(schema_version=True)),
    "schema as float": _edit(lambda d: d.update(schema_version=1.0)),
    "key missing": _edit(lambda d: d.pop("key")),
    "key not an object": _edit(lambda d: d.update(key="down-e4")),
    "key with an extra field": _edit(lambda d: d["key"].update(extra=1)),
    "key of another problem": _edit(lambda d: d["key"].update(n=65)),
    "key of another device": _edit(lambda d: d["key"].update(device_name="NVIDIA H200")),
    "key of another kernel version": _edit(lambda d: d["key"].update(kernel_version=-1)),
    "buckets missing": _edit(lambda d: d.pop("buckets")),
    "buckets empty": _edit(lambda d: d.update(buckets={})),
    "buckets a list": _edit(lambda d: d.update(buckets=[1024])),
    "bucket not a number": _edit(lambda d: d.update(buckets={"many": _first_bucket(d)})),
    "bucket zero": _edit(lambda d: d.update(buckets={"0": _first_bucket(d)})),
    "bucket negative": _edit(lambda d: d.update(buckets={"-1024": _first_bucket(d)})),
    "bucket fractional": _edit(lambda d: d.update(buckets={"1024.5": _first_bucket(d)})),
    "bucket entry a string": _edit(lambda d: d.update(buckets={"1024": "fast"})),
    "a pass missing": _edit(lambda d: _first_bucket(d)["configs"].pop("dw")),
    "config field missing": _edit(lambda d: _first_bucket(d)["configs"]["forward"].pop("BLOCK_M")),
    "config unknown field": _edit(lambda d: _first_bucket(d)["configs"]["forward"].update(BLOCK_Q=16)),
    "block not a power of two": _edit(lambda d: _first_bucket(d)["configs"]["forward"].update(BLOCK_M=17)),
    "num_stages fractional": _edit(lambda d: _first_bucket(d)["configs"]["dx"].update(num_stages=1.5)),
    "use_tma a string": _edit(lambda d: _first_bucket(d)["configs"]["dw"].update(use_tma="no")),
    "timings not a list": _edit(lambda d: _first_bucket(d).update(timings={"forward": 3})),
    "default_ms a string": _edit(lambda d: _first_bucket(d).update(default_ms={"forward": "fast"})),
    "timing NaN": lambda text: text.replace('"median_ms": 1.0', '"median_ms": NaN').encode(),
    "timing Infinity": lambda text: text.replace('"p80_ms": 1.1', '"p80_ms": Infinity').encode(),
    "timing 1e999": lambda text: text.replace('"p20_ms": 0.9', '"p20_ms": 1e999').encode(),
    "timing negative": lambda text: text.replace('"median_ms": 1.0', '"median_ms": -1.0').encode(),
    "default_ms NaN": _edit(lambda d: _first_bucket(d).update(default_ms={"forward": float("nan")})),
    "default_ms -Infinity": lambda text: text.replace('"forward": 2.0', '"forward": -Infinity').encode(),
}


def _bad_file(directory: Path, probe: str) -> Path:
    """The cache file of KEY in ``directory`` with the bad contents of ``probe``."""
    path = stored(directory / "src")
    bad = BAD_CONTENTS[probe](path.read_text())
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / path.name
    target.write_bytes(bad)
    shutil.rmtree(directory / "src")
    return target


@pytest.mark.parametrize("probe", sorted(BAD_CONTENTS))
def test_a_bad_file_is_ignored_with_a_warning_and_replaced(tmp_path, caplog, probe):
    path = _bad_file(tmp_path / "cache", probe)
    cache = ConfigCache(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        assert cache.load(KEY) is None
    assert f"ignoring {path}" in caplog.text and "it will be replaced" in caplog.text
    tuner = StubTuner()
    got, source = cache.get_or_tune(KEY, (1024,), lambda b: tuner(PROBLEM, CPU, b), lock_timeout=5)
    assert (source, tuner.calls) == ("tuned", 1) and got == table()
    assert read_file(path)[1] is None and ConfigCache(tmp_path / "cache").load(KEY) == table()


@pytest.mark.parametrize("probe", sorted(BAD_CONTENTS))
def test_a_bad_file_is_listed_invalid_and_clear_keeps_it(cache_env, capsys, probe):
    path = _bad_file(cache_env, probe)
    stored(cache_env, OTHER_KEY)
    before = path.read_bytes()
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and f"{path.name}  INVALID: " in out and f"{OTHER_KEY.file_name()}  cpu" in out
    status, out, _ = run_cli(capsys, "cache", "clear")
    assert status == 0 and "removed 1 cache files" in out and f"left {path.name}: invalid: " in out
    assert snapshot(cache_env) == {path.name: before}


# --- B. the shape of the file system -----------------------------------------------------------


def test_a_cache_file_that_is_a_directory(cache_env, caplog, capsys):
    (cache_env / KEY.file_name()).mkdir(parents=True)
    cache = ConfigCache(cache_env)
    with caplog.at_level(logging.WARNING):
        assert cache.load(KEY) is None
        got, source = cache.get_or_tune(KEY, (1024,), lambda b: table(b), lock_timeout=5)
    assert source == "tuned" and got == table() and cache.load(KEY) == table()
    assert "a directory, not a regular file" in caplog.text and "kept in memory for this process" in caplog.text
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and f"{KEY.file_name()}  FOREIGN: a directory, not a regular file" in out
    assert run_cli(capsys, "cache", "clear")[0] == 0 and (cache_env / KEY.file_name()).is_dir()


def test_a_file_symlinked_to_another_keys_file(cache_env, caplog, capsys):
    """Symlinks are never followed (see test_cache_paths.py for links leaving the directory)."""
    target = stored(cache_env, OTHER_KEY)
    link = cache_env / KEY.file_name()
    link.symlink_to(target)
    with caplog.at_level(logging.WARNING):
        assert ConfigCache(cache_env).load(KEY) is None
    assert f"ignoring {link}: a symlink to {target}: the cache opens regular files only" in caplog.text
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and f"{link.name}  FOREIGN: a symlink to {target}" in out
    status, out, _ = run_cli(capsys, "cache", "clear")
    assert status == 0 and f"left {link.name}: foreign: a symlink" in out and link.is_symlink()


def test_a_dangling_symlink_is_reported_and_replaced_by_a_write(cache_env, tmp_path, capsys):
    cache_env.mkdir()
    link = cache_env / KEY.file_name()
    link.symlink_to(tmp_path / "gone.json")
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and f"{link.name}  FOREIGN: a symlink to {tmp_path / 'gone.json'}" in out
    cache = ConfigCache(cache_env)
    assert cache.load(KEY) is None
    cache.store(KEY, table(), lock_timeout=5)
    assert not link.is_symlink() and ConfigCache(cache_env).load(KEY) == table()


def test_a_symlink_loop(cache_env, caplog, capsys):
    cache_env.mkdir()
    link = cache_env / KEY.file_name()
    link.symlink_to(link)
    with caplog.at_level(logging.WARNING):
        assert ConfigCache(cache_env).load(KEY) is None
    assert f"ignoring {link}: a symlink to {link}" in caplog.text
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and f"{link.name}  FOREIGN: a symlink to {link}" in out
    ConfigCache(cache_env).store(KEY, table(), lock_timeout=5)
    assert ConfigCache(cache_env).load(KEY) == table()


FOREIGN = {
    "settings.json": b'{"schema_version": null, "theme": "dark"}',  # the case: it was deleted
    "notes.txt": b"my notes",
    "down-e4.json": b"{}",  # starts like a cache file name
    "DOWN-e4-n64-k48-top2-float32-cpu-0123456789abcdef.json": b"{}",
    "down-e4-n64-k48-top2-float32-cpu-0123456789abcdef.json.bak": b"{}",
    "settings.json.lock": b"",
    "README": b"",
}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_a_foreign_file_is_listed_and_left_alone(cache_env, capsys, name):
    stored(cache_env)
    (cache_env / name).write_bytes(FOREIGN[name])
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and f"{name}  FOREIGN: not an ep_moe cache file" in out
    status, out, _ = run_cli(capsys, "cache", "clear")
    assert status == 0 and "removed 1 cache files" in out and f"left {name}: foreign" in out
    assert snapshot(cache_env) == {name: FOREIGN[name]}


def test_a_foreign_subdirectory_is_left_alone(cache_env, capsys):
    (cache_env / "old" / "inner").mkdir(parents=True)
    (cache_env / "old" / "inner" / KEY.file_name()).write_text("{}")
    status, out, _ = run_cli(capsys, "cache", "clear")
    assert status == 0 and "left old: foreign" in out and (cache_env / "old" / "inner" / KEY.file_name()).exists()


@pytest.mark.parametrize("action", [("list",), ("clear",), ("show", "down")])
@pytest.mark.parametrize("layout", ["is a file", "lies under a file"])
def test_a_cache_directory_that_is_not_one(cache_env, capsys, monkeypatch, action, layout):
    blocker = cache_env if layout == "is a file" else cache_env.parent / "blocker"
    blocker.write_text("precious")
    if layout == "lies under a file":
        monkeypatch.setenv("EP_MOE_CACHE_DIR", str(blocker / "cache"))
    status, _, err = run_cli(capsys, "cache", *action)
    assert status == 1 and f"{layout}, not a directory; move that file away" in one_error_line(err)
    assert blocker.read_text() == "precious"


def test_writes_to_a_cache_directory_that_is_a_file_stay_in_memory(cache_env, caplog):
    cache_env.write_text("precious")
    with caplog.at_level(logging.WARNING):
        resolved = warmup([PROBLEM], num_tokens=64, tuner=StubTuner())
        assert resolved[PROBLEM].source == "tuned" and get_kernel_configs(PROBLEM, 128) == STUB_CONFIGS
        default_cache().store(OTHER_KEY, table(), lock_timeout=5)
    warnings = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Set EP_MOE_CACHE_DIR to a writable directory" in warnings[0]
    assert cache_env.read_text() == "precious"


def test_a_missing_cache_directory(cache_env, capsys):
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and out == f"cache is empty: {cache_env} (the directory does not exist yet)\n"
    status, out, _ = run_cli(capsys, "cache", "clear")
    assert status == 0 and out == f"removed 0 cache files from {cache_env}\n" and not cache_env.exists()
    status, _, err = run_cli(capsys, "cache", "show", "down")
    assert status == 1 and "no single cache file matches 'down'" in one_error_line(err)


def test_an_empty_cache_directory(cache_env, capsys):
    cache_env.mkdir()
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and out == f"cache is empty: {cache_env}\n"


@contextlib.contextmanager
def immutable(path: Path):
    """``chattr +i``: not even root may change ``path`` (a read-only directory or file for the
    tests, which run as root); skips the probe where chattr is not available."""
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_clear_in_a_read_only_directory_prints_one_line(cache_env, capsys):
    for key in (KEY, OTHER_KEY):
        stored(cache_env, key)
    before = snapshot(cache_env)
    with immutable(cache_env):
        status, out, err = run_cli(capsys, "cache", "clear")
        assert status == 1 and "removed 0 cache files" in out
        assert "could not remove 2 cache file(s)" in one_error_line(err) and "Operation not permitted" in err
        assert "check that this user may write to that directory" in err
        assert run_cli(capsys, "cache", "list")[0] == 0
    assert snapshot(cache_env) == before


def test_tuning_into_a_read_only_directory_stays_in_memory(cache_env, caplog):
    cache_env.mkdir()
    with immutable(cache_env), caplog.at_level(logging.WARNING):
        resolved = warmup([PROBLEM], num_tokens=64, tuner=StubTuner())
        assert resolved[PROBLEM].source == "tuned" and list(cache_env.iterdir()) == []
    assert "cannot write to" in caplog.text


def test_a_read_only_lock_file(cache_env, capsys, caplog):
    path = stored(cache_env)
    lock = Path(str(path) + ".lock")
    with immutable(lock):
        status, _, err = run_cli(capsys, "cache", "clear")
        assert status == 1 and "could not remove 1 cache file(s)" in one_error_line(err)
        with caplog.at_level(logging.WARNING):
            ConfigCache(cache_env).store(KEY, table((16,)), lock_timeout=5)
        assert "cannot write to" in caplog.text
    assert ConfigCache(cache_env).load(KEY) == table(), "the file on disk is untouched"


def test_an_unreadable_cache_file(cache_env, capsys, caplog, monkeypatch):
    path = stored(cache_env)
    real = os.open

    def denied(file, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with caplog.at_level(logging.WARNING):
        assert ConfigCache(cache_env).load(KEY) is None
    assert "unreadable: [Errno 13] Permission denied" in caplog.text
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and f"{path.name}  INVALID: unreadable" in out


def test_an_unlistable_cache_directory(cache_env, capsys, monkeypatch):
    cache_env.mkdir()

    def denied(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "listdir", denied)
    for action in (("list",), ("clear",)):
        status, _, err = run_cli(capsys, "cache", *action)
        assert status == 1 and f"cannot list the cache directory {cache_env}: Permission denied" in one_error_line(err)


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_write_keeps_the_old_file_whole(cache_env, caplog, monkeypatch, failing):
    path = stored(cache_env)
    before = path.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, failing, disk_full)
    cache = ConfigCache(cache_env)
    with caplog.at_level(logging.WARNING):
        cache.store(KEY, table((4096,)), lock_timeout=5)
    assert "No space left on device" in caplog.text and cache.load(KEY) == table((4096,))
    assert path.read_bytes() == before and not list(cache_env.glob(".*.tmp")), "no temp file left"


def test_leftovers_of_a_killed_writer(cache_env, capsys):
    path = stored(cache_env)
    leftover = cache_env / f".{path.name}.x1y2z3.tmp"
    leftover.write_text('{"schema_ver')
    orphan_lock = cache_env / (OTHER_KEY.file_name() + ".lock")
    orphan_lock.touch()
    assert ConfigCache(cache_env).load(KEY) == table()
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and out.count("\n") == 1 and path.name in out
    status, out, _ = run_cli(capsys, "cache", "clear")
    assert status == 0 and "removed 1" in out and list(cache_env.iterdir()) == []


# --- C. locks held by other processes ----------------------------------------------------------

_HOLDER = """import filelock, os, signal, sys, time
locks = [filelock.FileLock(path) for path in sys.argv[2:]]
for lock in locks:
    lock.acquire()
print("held", flush=True)
if sys.argv[1] == "stopped":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(600)
"""


@contextlib.contextmanager
def held(*paths: Path, how="stopped"):
    """Another process holds the locks of the cache files ``paths``, stopped (SIGSTOP) or
    sleeping, until the probe ends."""
    lock_paths = [str(p) + ".lock" for p in paths]
    Path(lock_paths[0]).parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, how, *lock_paths], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held", "the lock holder failed to start"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def within(seconds: float = BOUND_S):
    start = time.monotonic()
    yield
    assert time.monotonic() - start < seconds, "a bounded wait took too long"


HOLDERS = ["stopped", "sleeping"]


@pytest.mark.parametrize("how", HOLDERS)
def test_store_under_a_held_lock_keeps_the_table_in_memory(cache_env, caplog, how):
    path = stored(cache_env)
    before = path.read_bytes()
    cache = ConfigCache(cache_env)
    with held(path, how=how), within(), caplog.at_level(logging.WARNING):
        cache.store(KEY, table((4096,)), lock_timeout=0.5)
    assert f"{path}.lock stayed locked for 0.5s: another process is tuning this key" in caplog.text
    assert cache.load(KEY) == table((4096,)) and path.read_bytes() == before


@pytest.mark.parametrize("how", HOLDERS)
def test_tuning_under_a_held_lock_raises_a_clear_timeout(cache_env, how):
    tuner = StubTuner()
    with held(cache_env / KEY.file_name(), how=how), within():
        with pytest.raises(CacheLockTimeout, match=r"stayed locked for 0.5s: .* let it finish, or stop it"):
            ConfigCache(cache_env).get_or_tune(KEY, (1024,), lambda b: tuner(PROBLEM, CPU, b), lock_timeout=0.5)
    assert tuner.calls == 0


@pytest.mark.parametrize("how", HOLDERS)
def test_a_tuning_lookup_under_a_held_lock_falls_back(cache_env, caplog, how):
    with held(cache_env / KEY.file_name(), how=how), within(), caplog.at_level(logging.WARNING):
        assert get_kernel_configs(PROBLEM, 128, allow_tuning=True, lock_timeout=0.5) == heuristic_configs(
            PROBLEM, 128, CPU)
    assert "using heuristic configs" in caplog.text


def test_merge_under_a_held_lock_gives_up(cache_env, caplog):
    path = stored(cache_env)
    with held(path), within(), caplog.at_level(logging.WARNING):
        assert not ConfigCache(cache_env).merge(KEY, table((4096,)), lock_timeout=0.5)
    assert "not updated" in caplog.text and ConfigCache(cache_env).load(KEY) == table()


def test_warmup_under_a_held_lock_falls_back_by_its_timeout(cache_env, caplog):
    tuner = StubTuner()
    with held(cache_env / KEY.file_name()), within(), caplog.at_level(logging.WARNING):
        resolved = warmup([PROBLEM], num_tokens=64, timeout=0.5, tuner=tuner)
    assert resolved[PROBLEM].source == "fallback" and "CacheLockTimeout" in resolved[PROBLEM].error
    assert tuner.calls == 0


def test_reading_needs_no_lock(cache_env, capsys):
    path = stored(cache_env)
    with held(path), within():
        assert get_kernel_configs(PROBLEM, 1024) == STUB_CONFIGS
        status, out, _ = run_cli(capsys, "cache", "list")
        assert status == 0 and f"{path.name}  cpu  rows=1024" in out


def test_clear_leaves_a_locked_file_and_says_so(cache_env, capsys):
    path = stored(cache_env)
    stored(cache_env, OTHER_KEY)
    with held(path), within(15):
        cache = ConfigCache(cache_env)
        report = cache.clear(lock_timeout=0.5)
    assert report.removed == [cache.path(OTHER_KEY)] and report.kept == [(path, "locked for 0.5s (being tuned?)")]
    assert ConfigCache(cache_env).load(KEY) == table()


def test_clear_leaves_a_held_orphan_lock(cache_env, capsys):
    with held(cache_env / KEY.file_name()), within(15):
        status, out, _ = run_cli(capsys, "cache", "clear")
        assert status == 0 and Path(str(cache_env / KEY.file_name()) + ".lock").exists()


def test_a_killed_holder_frees_the_lock(cache_env):
    path = stored(cache_env)
    with held(path) as holder:
        holder.kill()
        holder.wait()
        with within():
            ConfigCache(cache_env).store(KEY, table((4096,)), lock_timeout=2)
    assert ConfigCache(cache_env).load(KEY) == table((4096,))


@pytest.mark.parametrize("timeout", [-1, float("inf"), float("nan")])
def test_an_unbounded_lock_wait_is_refused(cache_env, timeout):
    with pytest.raises(ValueError, match=r"lock_timeout=.*: give seconds >= 0 \(a wait for a cache lock is always"):
        ConfigCache(cache_env).store(KEY, table(), lock_timeout=timeout)


# --- D. concurrent processes -------------------------------------------------------------------

_FORK = multiprocessing.get_context("fork")


def _in_processes(target, n: int, *args, timeout: float = 60):
    """Run ``target(i, *args)`` in ``n`` forked processes; each must exit 0 in time."""
    procs = [_FORK.Process(target=target, args=(i, *args)) for i in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    assert not alive, "a process hung"
    assert [p.exitcode for p in procs] == [0] * n


def _store_many(i, directory):
    ConfigCache(directory).store(KEY, table((2 ** (4 + i),)), lock_timeout=30)


def _merge_one(i, directory):
    assert ConfigCache(directory).merge(KEY, table((2 ** (4 + i),)), lock_timeout=30)


def _tune_once(i, directory, log):
    def tune(buckets):
        with open(log, "a") as f:
            f.write(f"{i}\n")
        time.sleep(0.3)
        return table(buckets)

    assert ConfigCache(directory).get_or_tune(KEY, (1024,), tune, lock_timeout=30)[0] == table()


def _write_or_clear(i, directory):
    cache = ConfigCache(directory)
    for j in range(15):
        if i == 0:
            cache.clear(lock_timeout=30)
        else:
            cache.store(KEY if j % 2 else OTHER_KEY, table((2 ** (4 + i),)), lock_timeout=30)


def test_concurrent_writers_leave_one_whole_file(cache_env):
    _in_processes(_store_many, 8, cache_env)
    got = ConfigCache(cache_env).load(KEY)
    assert got in [table((2 ** (4 + i),)) for i in range(8)]
    assert [p.name for p in cache_env.glob(".*.tmp")] == []


def test_concurrent_merges_lose_no_bucket(cache_env):
    _in_processes(_merge_one, 8, cache_env)
    assert sorted(ConfigCache(cache_env).load(KEY)) == [2 ** (4 + i) for i in range(8)]


def test_concurrent_tuners_tune_once(cache_env, tmp_path):
    log = tmp_path / "tunes.log"
    _in_processes(_tune_once, 6, cache_env, str(log))
    assert len(log.read_text().splitlines()) == 1


def test_clear_racing_writers_never_leaves_a_bad_file(cache_env, capsys):
    _in_processes(_write_or_clear, 4, cache_env)
    for path in ConfigCache(cache_env).files():
        assert read_file(path)[1] is None
    assert [p.name for p in cache_env.glob(".*.tmp")] == []
    status, out, _ = run_cli(capsys, "cache", "list")
    assert status == 0 and "INVALID" not in out and "FOREIGN" not in out


def _store_repeatedly(i, directory):
    cache = ConfigCache(directory)
    for j in range(40):
        cache.store(KEY, table((2 ** (4 + j % 8),)), lock_timeout=30)


def test_a_reader_during_writes_sees_only_whole_files(cache_env):
    path = stored(cache_env)
    writer = _FORK.Process(target=_store_repeatedly, args=(0, cache_env))
    writer.start()
    reads = []
    while writer.is_alive():
        reads.append(read_file(path)[1])
    writer.join()
    assert writer.exitcode == 0 and len(reads) > 1 and set(reads) == {None}


# --- E. the CLI --------------------------------------------------------------------------------


@pytest.fixture
def no_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' interpreter would tune


@pytest.mark.parametrize("extra", [(), ("--force",), ("--tokens", "8192")], ids=["plain", "force", "tokens"])
@pytest.mark.parametrize("world", ["1", "2"])
def test_autotune_without_a_gpu(cache_env, capsys, no_gpu, monkeypatch, extra, world):
    monkeypatch.setenv("WORLD_SIZE", world)  # under torchrun too: no process group is started
    status, out, err = run_cli(capsys, "autotune", "--model", "tiny", *extra)
    assert status == 1 and out == "" and "tuning times the Triton kernels on a CUDA GPU" in one_error_line(err)
    assert not cache_env.exists(), "no cache directory, no lock files"


def _model(tmp_path, content) -> str:
    path = tmp_path / "model.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


TINY_SHAPE = {"name": "t", "num_experts": 4, "hidden_size": 64, "intermediate_size": 48, "top_k": 2}
BAD_ARGS = {
    "unknown model": (lambda tmp: ["--model", "no-such-model"], r"no such file and no preset of that name"),
    "model json corrupt": (lambda tmp: ["--model", _model(tmp, "{")], r"not valid JSON"),
    "model json a list": (lambda tmp: ["--model", _model(tmp, [1])], r"expected a JSON object"),
    "model unknown field": (lambda tmp: ["--model", _model(tmp, {**TINY_SHAPE, "experts": 4})], r"unknown fields"),
    "model missing field": (lambda tmp: ["--model", _model(tmp, {"name": "t"})], r"lacks fields"),
    "model zero experts": (lambda tmp: ["--model", _model(tmp, {**TINY_SHAPE, "num_experts": 0})], r"integer >= 1"),
    "model top_k > experts": (lambda tmp: ["--model", _model(tmp, {**TINY_SHAPE, "top_k": 9})], r"exceeds"),
    "model path a directory": (lambda tmp: ["--model", str(tmp)], r"no such file and no preset"),
    "ep size 0": (lambda tmp: ["--model", "tiny", "--ep-size", "0"], r"ep_size=0"),
    "ep size not a divisor": (lambda tmp: ["--model", "tiny", "--ep-size", "3"], r"pick a divisor of 4"),
    "tokens 0": (lambda tmp: ["--model", "tiny", "--tokens", "0"], r"num_tokens=\[0\]: give tokens per rank"),
    "timeout 0": (lambda tmp: ["--model", "tiny", "--timeout", "0"], r"timeout=0.0: give a finite number of seconds in"),
    "timeout negative": (lambda tmp: ["--model", "tiny", "--timeout", "-5"], r"timeout=-5.0: give a finite number"),
    "timeout nan": (lambda tmp: ["--model", "tiny", "--timeout", "nan"], r"timeout=nan: give a finite number"),
    "timeout inf": (lambda tmp: ["--model", "tiny", "--timeout", "inf"], r"timeout=inf: give a finite number"),
}


@pytest.mark.parametrize("probe", sorted(BAD_ARGS))
def test_autotune_bad_arguments_give_one_line(cache_env, capsys, tmp_path, probe):
    make_args, message = BAD_ARGS[probe]
    status, out, err = run_cli(capsys, "autotune", *make_args(tmp_path), "--dtype", "float32")
    assert status == 2 and out == "" and err.startswith("ep-moe: error: ")
    assert re.search(message, one_error_line(err)), err


def test_an_unreadable_model_file(cache_env, capsys, tmp_path, monkeypatch):
    model = _model(tmp_path, TINY_SHAPE)
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if str(self) == model:
            raise PermissionError(errno.EACCES, "Permission denied", model)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    status, _, err = run_cli(capsys, "autotune", "--model", model)
    assert status == 1 and "Permission denied" in one_error_line(err) and model in err


ARGPARSE_ERRORS = {
    "no command": [],
    "unknown command": ["bench"],
    "cache without action": ["cache"],
    "unknown cache action": ["cache", "purge"],
    "bad dtype": ["autotune", "--model", "tiny", "--dtype", "int8"],
    "ep size not a number": ["autotune", "--model", "tiny", "--ep-size", "two"],
    "show without key": ["cache", "show"],
}


@pytest.mark.parametrize("probe", sorted(ARGPARSE_ERRORS))
def test_usage_errors_exit_2(cache_env, capsys, probe):
    status, out, err = run_cli(capsys, *ARGPARSE_ERRORS[probe])
    assert status == 2 and out == "" and "usage: ep-moe" in err and "error:" in err


def test_show_errors(cache_env, capsys):
    stored(cache_env)
    stored(cache_env, OTHER_KEY)
    bad = cache_env / make_key(dataclasses.replace(PROBLEM, n=256), CPU).file_name()
    bad.write_text("{")
    status, _, err = run_cli(capsys, "cache", "show", "down-e4-n")  # three files match
    assert status == 1 and "no single cache file matches 'down-e4-n'" in one_error_line(err)
    status, _, err = run_cli(capsys, "cache", "show", bad.name)
    assert status == 1 and f"{bad} is invalid: not valid JSON" in one_error_line(err)
    status, out, _ = run_cli(capsys, "cache", "show", KEY.digest())
    assert status == 0 and json.loads(out)["digest"] == KEY.digest()


def test_help_is_plain_text(capsys):
    parser = cli._parser()
    texts, todo = [parser.format_help()], [parser]
    while todo:
        for action in todo.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                texts += [sub.format_help() for sub in action.choices.values()]
                todo += list(action.choices.values())
    assert len(texts) == 8  # ep-moe, autotune, cache and its four actions, train
    assert not [t for t in texts if "``" in t or ":func:" in t or ":class:" in t]


def test_cache_path_with_a_tilde(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EP_MOE_CACHE_DIR", "~/c")
    assert run_cli(capsys, "cache", "path")[1] == f"{tmp_path / 'c'}\n"


# --- F. shipped configs ------------------------------------------------------------------------


def _ship(cache_env, text=None, key=KEY) -> Path:
    directory = cache_env.parent / "shipped" / device_dir_name(key.device_name)
    directory.mkdir(parents=True, exist_ok=True)
    path = stored(cache_env.parent / "tuned", key)
    shipped = directory / path.name
    shipped.write_text(path.read_text() if text is None else text)
    return shipped


SHIPPED_FAULTS = {
    "missing directory": lambda env: None,
    "directory is a file": lambda env: (env.parent / "shipped").write_text("x"),
    "corrupt file": lambda env: _ship(env, "{"),
    "other kernel version": lambda env: _ship(env, key=dataclasses.replace(KEY, kernel_version=-1)),
    "other device's directory": lambda env: _ship(env).rename(env.parent / "shipped" / "elsewhere.json"),
}


@pytest.mark.parametrize("probe", sorted(SHIPPED_FAULTS))
def test_shipped_faults_serve_the_heuristic(cache_env, caplog, probe):
    SHIPPED_FAULTS[probe](cache_env)
    with caplog.at_level(logging.WARNING):
        assert load_shipped(KEY) is None
        assert get_kernel_configs(PROBLEM, 128) == heuristic_configs(PROBLEM, 128, CPU)
    assert ("ignoring" in caplog.text) == (probe == "corrupt file")


# --- G. tuners and the store in warmup ---------------------------------------------------------


@pytest.mark.parametrize("result", ["raise", "empty", "none"])
def test_a_bad_tuner_leaves_the_heuristic(cache_env, caplog, result):
    with caplog.at_level(logging.WARNING):
        resolved = warmup([PROBLEM], num_tokens=64, tuner=StubTuner(result=result))
    assert resolved[PROBLEM].source == "fallback" and "using heuristic configs" in caplog.text
    assert get_kernel_configs(PROBLEM, 128) == heuristic_configs(PROBLEM, 128, CPU)
    assert not cache_env.exists() or ConfigCache(cache_env).files() == []


def _no_hang(fn, seconds: float):
    """Run ``fn`` in a thread; it must finish (return or raise) within ``seconds``."""
    done = threading.Event()
    outcome = {}

    def run():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the outcome is what the probe checks
            outcome["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), "the store wait never returned"
    return outcome.get("error")


@pytest.mark.parametrize("kind", ["hash", "file"])
def test_a_store_wait_whose_deadline_has_passed_returns(tmp_path, kind):
    """A zero timedelta means no deadline to FileStore and HashStore: the split-tuning waits
    after the deadline would have waited forever."""
    store = dist.HashStore() if kind == "hash" else dist.FileStore(str(tmp_path / "store"), 1)
    error = _no_hang(lambda: coordinate._store_wait(store, ["never-set"], 0.0), seconds=10)
    assert isinstance(error, RuntimeError)


@pytest.mark.parametrize("first", ["rank 0", "a peer that gave up"])
def test_the_first_settled_outcome_is_what_every_rank_reads(first):
    store = dist.HashStore()
    payload, gave_up = {"ok": True, "problems": []}, {"ok": False, "timed_out": True, "error": "late"}
    order = [payload, gave_up] if first == "rank 0" else [gave_up, payload]
    results = [coordinate._settle(store, "k", value) for value in order]
    assert results == [order[0], order[0]]


class _SilentStore:
    """A store whose wait times out and whose other calls fail as when the rank hosting it is
    gone; ``published``: rank 0 set its payload just after the wait timed out."""

    def __init__(self, published=None):
        self.published = published

    def wait(self, keys, timeout):
        raise dist.DistStoreError("wait timeout")

    def compare_set(self, key, expected, desired):
        if self.published is None:
            raise dist.DistStoreError("Connection reset by peer")
        return json.dumps(self.published).encode()


def test_a_store_that_stops_answering_raises_a_warmup_timeout_naming_the_fix(monkeypatch):
    monkeypatch.setattr(coordinate.dist, "get_rank", lambda: 1)
    with pytest.raises(WarmupTimeout, match=r"store does not answer: it is hosted by rank 0 .* torchrun .* shorter"):
        coordinate._await_root(_SilentStore(), "k", 0, 1.0, 0.5)


def test_a_payload_set_just_after_the_wait_timed_out_is_taken(monkeypatch):
    monkeypatch.setattr(coordinate.dist, "get_rank", lambda: 1)
    payload = {"ok": True, "host": "h", "problems": []}
    assert coordinate._await_root(_SilentStore(published=payload), "k", 0, 1.0, 0.5) == payload


def test_a_settled_timeout_is_one_warning_and_the_heuristic_on_rank_0(monkeypatch, cache_env, caplog):
    """Rank 0 reaches the store after a peer gave up: it takes the heuristic too."""
    store = dist.HashStore()
    monkeypatch.setattr(coordinate.dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(coordinate.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(coordinate.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(coordinate, "_exchange_key", lambda ranks: "exchange")
    store.set("exchange", json.dumps({"ok": False, "timed_out": True, "error": "rank 1 gave up for every rank"}))
    with caplog.at_level(logging.WARNING):
        resolved = coordinate._warmup_group({PROBLEM: (128,)}, None, 1.0, False, StubTuner(), torch.device("cpu"),
                                            False)
    assert resolved[PROBLEM].source == "fallback" and "rank 1 gave up" in resolved[PROBLEM].error
    assert resolved[PROBLEM].for_rows(128) == heuristic_configs(PROBLEM, 128, CPU)
    assert "every rank uses heuristic configs" in caplog.text
