"""Fault injection for what the autotune cache opens, names and writes (issue 46): entries
named like cache files that are not regular files (FIFOs, sockets, symlinks leaving the
directory, one to ``/dev/zero``) or are too large, file names that are not UTF-8 or hold
control characters, cache keys whose fields would put a path into a file name, NaN and
infinite timings, and warmup timeouts outside their range.

Probes that used to hang or read until memory ran out run in a forked child with a deadline
and an address-space limit, so a regression fails the probe instead of the test run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import multiprocessing
import os
import resource
import socket
import sys
from pathlib import Path

import pytest
import torch

from ep_moe import cli
from ep_moe.autotune import GemmProblem, Tuner, clear_memory_cache, get_kernel_configs, warmup
from ep_moe.autotune.bench import Timing, device_limits, time_configs
from ep_moe.autotune.cache import CacheKey, ConfigCache, make_key, read_file
from ep_moe.autotune.space import CandidateTiming, TunedBucket, heuristic_configs
from ep_moe.kernels.config import DEFAULT_CONFIGS, PASSES, GemmConfigs, KernelConfig

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs, /proc and /dev/zero")]

PROBLEM = GemmProblem(projection="down", num_local_experts=4, n=64, k=48, top_k=2, dtype="float32")
CPU = device_limits(torch.device("cpu"))
KEY = make_key(PROBLEM, CPU)
STUB = KernelConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=3, num_warps=2, num_stages=1)
CHILD_SECONDS = 30.0  # every probe in a child returns in well under a second
CHILD_MEMORY = 1 << 30  # address space a child may add: far above the bound of one read


def table(buckets=(1024,)):
    timing = CandidateTiming(config=STUB, median_ms=1.0, p20_ms=0.9, p80_ms=1.1)
    return {b: TunedBucket(configs=GemmConfigs(forward=STUB, dx=STUB, dw=STUB), timings={"forward": (timing,)},
                           default_ms={"forward": 2.0}) for b in buckets}


@pytest.fixture
def cache_env(cache_env):
    """The shared fresh cache directory (``conftest.py``), created."""
    cache_env.mkdir()
    return cache_env
    clear_memory_cache()


def strict_json(text: str):
    """``json.loads`` that refuses NaN and Infinity, as every JSON parser but Python's does."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


# --- running a probe that may hang or eat memory -----------------------------------------------

_FORK = multiprocessing.get_context("fork")


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def in_child(fn):
    """``fn()`` run in a forked child that may add at most ``CHILD_MEMORY`` bytes of address
    space; its return value. The probe fails (instead of the test run hanging or running out of
    memory) if the child raises, or has not answered within ``CHILD_SECONDS``."""
    receive, send = _FORK.Pipe(duplex=False)

    def target():
        limit = _address_space() + CHILD_MEMORY
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            send.send(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - reported to the probe
            send.send(("raised", f"{type(e).__name__}: {e}"))

    child = _FORK.Process(target=target)
    child.start()
    try:
        if not receive.poll(CHILD_SECONDS):
            pytest.fail(f"hung: no answer within {CHILD_SECONDS:g}s")
        outcome, value = receive.recv()
    finally:
        child.kill()
        child.join()
    if outcome != "ok":
        pytest.fail(f"the probe raised {value}")
    return value


def run_cli(*args):
    """(exit status, stdout, stderr) of ``ep-moe ARGS``, printed to strict UTF-8 streams like a
    terminal's; a traceback fails the probe."""
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict") for _ in range(2))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(list(args))
        except SystemExit as e:
            status = e.code
        out.flush()
        err.flush()
    texts = [s.buffer.getvalue().decode("utf-8") for s in (out, err)]
    assert "Traceback" not in texts[0] + texts[1]
    return status, texts[0], texts[1]


def lookup_with_warnings():
    """(whether ``get_kernel_configs`` served the heuristic, the warnings logged meanwhile)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("ep_moe")
    log.addHandler(Keep(logging.WARNING))
    log.setLevel(logging.WARNING)
    configs = get_kernel_configs(PROBLEM, 128)
    return configs == heuristic_configs(PROBLEM, 128, CPU), seen


def valid_file(directory: Path, key=KEY) -> Path:
    cache = ConfigCache(directory)
    cache.store(key, table())
    return cache.path(key)


# --- 1. entries that are not regular files, or too large ---------------------------------------


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "a FIFO"


def _socket(path: Path) -> str:
    with socket.socket(socket.AF_UNIX) as sock, contextlib.chdir(path.parent):
        sock.bind(path.name)  # relative: a socket's path may have 107 bytes at most
    return "a socket"


def _dev_zero(path: Path) -> str:
    path.symlink_to("/dev/zero")
    return "a symlink"


def _outside(path: Path) -> str:
    """A symlink to a valid file of the same key outside the cache directory."""
    path.symlink_to(valid_file(path.parent.parent / "elsewhere"))
    return "a symlink"


def _padded(path: Path) -> str:
    """A valid record padded with whitespace past the 16 MiB a cache file may have."""
    text = valid_file(path.parent.parent / "src").read_text()
    path.write_text(text + " " * (16 << 20))
    return "larger than"


NOT_REGULAR = {"fifo": _fifo, "socket": _socket, "symlink to /dev/zero": _dev_zero,
               "symlink leaving the directory": _outside, "too large": _padded}


@pytest.mark.parametrize("probe", sorted(NOT_REGULAR))
def test_a_lookup_skips_an_entry_that_is_not_a_regular_cache_file(cache_env, probe):
    path = cache_env / KEY.file_name()
    what = NOT_REGULAR[probe](path)
    served_heuristic, warnings = in_child(lookup_with_warnings)
    assert served_heuristic
    assert len(warnings) == 1 and str(path) in warnings[0] and what in warnings[0], warnings


@pytest.mark.parametrize("probe", sorted(NOT_REGULAR))
def test_list_and_clear_show_such_an_entry_as_foreign_and_leave_it(cache_env, probe):
    path = cache_env / KEY.file_name()
    what = NOT_REGULAR[probe](path)
    ours = valid_file(cache_env, make_key(dataclasses.replace(PROBLEM, n=128), CPU))
    outside = [p for p in cache_env.parent.rglob("*") if cache_env not in p.parents and p.is_file()]
    before = {p: p.read_bytes() for p in outside}
    status, out, err = in_child(lambda: run_cli("cache", "list"))
    line = [x for x in out.splitlines() if x.startswith(path.name)]
    assert status == 0 and len(line) == 1 and "FOREIGN: " in line[0] and what in line[0], out + err
    assert f"{ours.name}  cpu" in out
    status, out, err = in_child(lambda: run_cli("cache", "clear"))
    assert status == 0 and "removed 1 cache files" in out and f"left {path.name}: foreign: " in out, out + err
    assert os.path.lexists(path) and not ours.exists()
    assert {p: p.read_bytes() for p in outside} == before, "nothing outside the directory changed"


def test_a_write_replaces_a_fifo_with_the_cache_file(cache_env):
    path = cache_env / KEY.file_name()
    os.mkfifo(path)
    resolved = in_child(lambda: warmup([PROBLEM], num_tokens=64, tuner=lambda p, d, b: table(b))[PROBLEM].source)
    assert resolved == "tuned" and path.is_file() and read_file(path)[1] is None


def test_show_refuses_an_entry_that_is_not_a_regular_file(cache_env):
    path = cache_env / KEY.file_name()
    os.mkfifo(path)
    status, out, err = in_child(lambda: run_cli("cache", "show", KEY.digest()))
    assert status == 1 and out == "" and err.count("\n") == 1 and "no single cache file matches" in err


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_clear_leaves_a_lock_file_that_is_not_a_regular_file(cache_env, tmp_path, kind):
    lock = cache_env / (KEY.file_name() + ".lock")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(victim)
    status, out, err = in_child(lambda: run_cli("cache", "clear"))
    assert status == 0 and f"left {lock.name}: foreign: " in out, out + err
    assert os.path.lexists(lock) and victim.read_text() == "precious"


def test_a_write_never_opens_a_lock_file_that_is_a_fifo(cache_env, caplog):
    lock = cache_env / (KEY.file_name() + ".lock")
    os.mkfifo(lock)
    cache = ConfigCache(cache_env)
    with caplog.at_level(logging.WARNING):
        cache.store(KEY, table(), lock_timeout=5)
    assert f"the lock file {lock} is a FIFO (named pipe), not a regular file; remove it" in caplog.text
    assert cache.load(KEY) == table() and sorted(os.listdir(cache_env)) == [lock.name]


# --- 1. file names that are not UTF-8, or not one printable line -------------------------------

ODD_NAMES = {
    "latin-1": b"caf\xe9.json",
    "invalid utf-8 like a cache file": KEY.file_name().encode().replace(b"down", b"d\xffown"),
    "newline": b"two\nlines.json",
    "escape sequence": b"\x1b[31mred.json",
}
SHOWN = {"latin-1": "caf\\xe9.json", "invalid utf-8 like a cache file": "d\\xffown-e4-",
         "newline": "two\\nlines.json", "escape sequence": "\\x1b[31mred.json"}


@pytest.mark.parametrize("probe", sorted(ODD_NAMES))
def test_odd_file_names_are_listed_escaped_on_one_line(cache_env, probe):
    with open(os.path.join(os.fsencode(cache_env), ODD_NAMES[probe]), "wb") as f:
        f.write(b"{}")
    ours = valid_file(cache_env)
    status, out, err = run_cli("cache", "list")
    assert status == 0 and err == "" and len(out.splitlines()) == 2, out + err
    assert [x for x in out.splitlines() if x.startswith(SHOWN[probe]) and "FOREIGN" in x]
    status, out, err = run_cli("cache", "clear")
    assert status == 0 and len(out.splitlines()) == 2 and f"left {SHOWN[probe]}" in out, out + err
    assert os.listdir(os.fsencode(cache_env)) == [ODD_NAMES[probe]] and not ours.exists()


# --- 2. cache keys that would put a path into a file name --------------------------------------

BAD_FIELDS = {
    "projection ../../x": ("projection", "../../x", r"GemmProblem.projection='../../x': .*'gate_up' or 'down'"),
    "projection with a slash": ("projection", "down/../../x", r"projection=.*'gate_up' or 'down'"),
    "projection with NUL": ("projection", "down\0", r"projection=.*'gate_up' or 'down'"),
    "projection empty": ("projection", "", r"projection=''"),
    "dtype ../x": ("dtype", "../x", r"GemmProblem.dtype='../x': .*lowercase"),
    "dtype with a separator": ("dtype", "float32/..", r"dtype=.*lowercase"),
    "dtype with a newline": ("dtype", "float32\n", r"dtype=.*lowercase"),
    "dtype not a string": ("dtype", torch.float32, r"dtype=torch.float32: .*a string"),
    "n a path": ("n", "64/..", r"GemmProblem.n='64/..': .*an integer >= 1"),
    "n zero": ("n", 0, r"GemmProblem.n=0: .*an integer >= 1"),
    "k negative": ("k", -48, r"GemmProblem.k=-48"),
    "top_k a bool": ("top_k", True, r"GemmProblem.top_k=True"),
    "num_local_experts a float": ("num_local_experts", 4.0, r"GemmProblem.num_local_experts=4.0"),
}


@pytest.mark.parametrize("probe", sorted(BAD_FIELDS))
def test_a_problem_whose_fields_are_not_safe_in_a_file_name_is_refused(probe):
    field, value, message = BAD_FIELDS[probe]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PROBLEM, **{field: value})


@pytest.mark.parametrize("probe", ["projection ../../x", "dtype ../x", "n a path"])
def test_a_cache_key_whose_fields_are_not_safe_in_a_file_name_is_refused(probe):
    field, value, _ = BAD_FIELDS[probe]
    with pytest.raises(ValueError, match=rf"{field}=.*"):
        dataclasses.replace(KEY, **{field: value})
    with pytest.raises(ValueError, match=rf"{field}=.*"):
        CacheKey.from_dict({**KEY.to_dict(), field: value})  # a file's or rank 0's key


def test_a_file_holding_an_unsafe_key_is_invalid(cache_env):
    path = valid_file(cache_env)
    data = json.loads(path.read_text())
    data["key"]["projection"] = "../../x"
    path.write_text(json.dumps(data))
    assert read_file(path)[1].startswith("its key is not a valid cache key: ")
    status, out, _ = run_cli("cache", "list")
    assert status == 0 and f"{path.name}  INVALID: its key is not a valid cache key" in out


# --- 3. NaN and infinite timings ---------------------------------------------------------------

NON_FINITE = [math.nan, math.inf, -math.inf, -1.0]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("field", ["median_ms", "p20_ms", "p80_ms"])
def test_a_timing_that_is_not_a_finite_duration_is_refused(field, value):
    times = {"median_ms": 1.0, "p20_ms": 0.9, "p80_ms": 1.1, field: value}
    with pytest.raises(ValueError, match=rf"CandidateTiming.{field}={value!r}: .*finite"):
        CandidateTiming(config=STUB, **times)


@pytest.mark.parametrize("value", NON_FINITE)
def test_a_default_time_that_is_not_a_finite_duration_is_refused(value):
    with pytest.raises(ValueError, match=rf"TunedBucket.default_ms\['dx'\]={value!r}: .*finite"):
        TunedBucket(configs=GemmConfigs(forward=STUB, dx=STUB, dw=STUB), default_ms={"dx": value})


class _Launch:
    """Stands in for a PassLaunch: every config writes the same output."""

    out = torch.zeros(4, 2)

    def __call__(self, config, index=None):
        self.out.fill_(1.0)
        return self.out


@pytest.mark.parametrize("value", NON_FINITE)
def test_a_non_finite_time_is_a_failed_candidate(value, caplog):
    first, second = KernelConfig(BLOCK_M=32), KernelConfig(BLOCK_M=64)
    timer = iter([Timing(1.0, 0.9, 1.1), Timing(value, value, value)])
    with caplog.at_level(logging.WARNING):
        results, _ = time_configs(_Launch(), [first, second], "float32", lambda fn: next(timer))
    assert results == [Timing(1.0, 0.9, 1.1), None]
    assert f"{second.short()} timed" in caplog.text and "skipped" in caplog.text


def test_tuning_with_a_timer_that_returns_nan_writes_valid_json(cache_env):
    """The challenger's timing is NaN: it counts as failed, and the file holds only numbers."""
    small = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=1)
    calls = iter([1.0, math.nan] * len(PASSES))
    tuner = Tuner(timer=lambda fn: Timing(next(calls), 0.9, 1.1), refine_top=0, progress=False,
                  candidates=lambda p, w, rows, dev: [DEFAULT_CONFIGS[w], small])
    problem = GemmProblem(projection="down", num_local_experts=4, n=32, k=16, top_k=2, dtype="float32")
    resolved = warmup([problem], num_tokens=32, tuner=tuner)[problem]
    assert resolved.source == "tuned"
    (path,) = ConfigCache(cache_env).files()
    data = strict_json(path.read_text())
    for bucket in data["buckets"].values():
        for which in PASSES:
            assert [t["median_ms"] for t in bucket["timings"][which]] == [1.0]
            assert bucket["configs"][which] == DEFAULT_CONFIGS[which].to_dict()


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_file_with_a_non_finite_timing_is_invalid_and_show_prints_only_json(cache_env, caplog, literal):
    path = valid_file(cache_env)
    text = path.read_text()
    assert '"median_ms": 1.0' in text
    path.write_text(text.replace('"median_ms": 1.0', f'"median_ms": {literal}'))
    with caplog.at_level(logging.WARNING):
        assert ConfigCache(cache_env).load(KEY) is None
    assert f"ignoring {path}" in caplog.text
    status, out, err = run_cli("cache", "show", KEY.digest())
    assert status == 1 and out == "" and f"{path} is invalid: " in err and err.count("\n") == 1
    status, out, _ = run_cli("cache", "list")
    assert status == 0 and f"{path.name}  INVALID: " in out


def test_show_prints_strict_json(cache_env):
    valid_file(cache_env)
    status, out, _ = run_cli("cache", "show", KEY.digest())
    assert status == 0 and strict_json(out)["digest"] == KEY.digest()


# --- 4. warmup timeouts ------------------------------------------------------------------------

BAD_TIMEOUTS = [math.nan, math.inf, -math.inf, 0, 0.0, -5, 1e300, 8 * 24 * 3600]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_a_warmup_timeout_out_of_range_is_refused(cache_env, timeout):
    tuned = []
    with pytest.raises(ValueError, match=r"warmup: timeout=.*: give a finite number of seconds in \(0, 604800\]"):
        warmup([PROBLEM], timeout=timeout, tuner=lambda p, d, b: tuned.append(p) or table(b))
    assert tuned == [] and os.listdir(cache_env) == []


@pytest.mark.parametrize("timeout", ["600", None, True])
def test_a_warmup_timeout_that_is_not_a_number_is_refused(timeout):
    with pytest.raises(ValueError, match=r"warmup: timeout=.*: give a finite number of seconds"):
        warmup([PROBLEM], timeout=timeout, tuner=lambda p, d, b: table(b))


@pytest.mark.parametrize("timeout", ["inf", "nan", "-5", "1e300"])
def test_the_cli_refuses_a_timeout_out_of_range_in_one_line(cache_env, monkeypatch, timeout):
    monkeypatch.setattr(cli, "Tuner", lambda **kwargs: lambda p, d, b: table(b))  # never the real one
    status, out, err = run_cli("autotune", "--model", "tiny", "--dtype", "float32", "--timeout", timeout)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("ep-moe: error: warmup: timeout=") and "(0, 604800]" in err


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1])
def test_a_tuning_lookup_refuses_an_unbounded_lock_timeout(cache_env, timeout):
    with pytest.raises(ValueError, match=r"lock_timeout=.*: give seconds >= 0"):
        get_kernel_configs(PROBLEM, 128, allow_tuning=True, lock_timeout=timeout)
