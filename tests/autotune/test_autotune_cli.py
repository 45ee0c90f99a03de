"""The ``ep-moe`` console script, in process, with the stub tuner."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from _dist import TINY, TINY_UP, CountingTuner, isolated, tune_calls  # noqa: F401

from ep_moe import cli
from ep_moe.autotune import device_limits
from ep_moe.autotune.cache import ConfigCache, cache_dir, make_key


@pytest.fixture
def stub_tuner(isolated, monkeypatch):
    log = isolated / "tunes.log"
    monkeypatch.setattr(cli, "Tuner", lambda **kwargs: CountingTuner(str(log)))
    return log


def test_autotune_prints_summary_and_fills_cache(stub_tuner, capsys):
    assert cli.main(["autotune", "--model", "tiny", "--ep-size", "2", "--tokens", "32", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "gate_up e2 n96 k64 top2 float32" in out and "down e2 n64 k48 top2 float32" in out
    assert "16x16x16 g3 w2 s1" in out and "2.00x" in out and "tuned" in out
    assert str(cache_dir()) in out
    assert len(tune_calls(stub_tuner)) == 2
    assert cli.main(["autotune", "--model", "tiny", "--ep-size", "2", "--tokens", "32", "--dtype", "float32"]) == 0
    assert "cache" in capsys.readouterr().out and len(tune_calls(stub_tuner)) == 2


def test_cache_commands(stub_tuner, capsys):
    assert cli.main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(cache_dir())
    cli.main(["autotune", "--model", "tiny", "--tokens", "32", "--dtype", "float32"])
    capsys.readouterr()
    assert cli.main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("cpu" in line and "rows=64" in line for line in lines)
    digest = lines[0].split()[0].rsplit("-", 1)[-1].removesuffix(".json")
    assert cli.main(["cache", "show", digest]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == digest
    assert cli.main(["cache", "show", "no-such-key"]) == 1
    broken = make_key(TINY, device_limits(torch.device("cpu"))).file_name().replace("-e4-", "-e8-")
    (cache_dir() / broken).write_text("{")
    (cache_dir() / "down-broken.json").write_text("{")
    cli.main(["cache", "list"])
    out = capsys.readouterr().out
    assert f"{broken}  INVALID: not valid JSON" in out and "down-broken.json  FOREIGN" in out
    assert cli.main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 cache files" in out and f"left {broken}: invalid" in out and "left down-broken.json" in out
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted([broken, "down-broken.json"])


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "presets:"),
    (["--model", "tiny", "--ep-size", "3"], "ep_size=3"),
])
def test_autotune_bad_input_exits_2(stub_tuner, capsys, args, message):
    assert cli.main(["autotune", *args]) == 2
    assert message in capsys.readouterr().err


def test_autotune_without_a_gpu_exits_1_with_one_line_and_writes_nothing(isolated, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' interpreter would tune
    assert cli.main(["autotune", "--model", "tiny", "--tokens", "32"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "tuning times the Triton kernels on a CUDA GPU" in captured.err and "run it on a GPU node" in captured.err
    assert not cache_dir().exists(), "no cache directory, no lock files"


def test_autotune_dry_run_resolves_the_shipped_preset_without_a_gpu(isolated, monkeypatch, capsys):
    """``--dry-run`` names the problems and row buckets of a preset (package data) and
    stops: no GPU, no tuning, no cache directory."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["autotune", "--model", "qwen3-30b-a3b", "--ep-size", "8", "--tokens", "8192", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == ["gate_up e16 n1536 k2048 top8 bfloat16  rows 65536",
                                                    "down e16 n2048 k768 top8 bfloat16  rows 65536"]
    assert not cache_dir().exists()


def test_train_runs_the_trainers_main(monkeypatch):
    """``ep-moe train ARGS``: everything after ``train`` goes to the trainer's own parser."""
    import ep_moe.train.train as train_module

    calls = []
    monkeypatch.setattr(train_module, "main", lambda argv, prog: calls.append((argv, prog)))
    assert cli.main(["train", "--config", "gpu", "--steps", "3", "-v", "--help"]) == 0
    assert cli.main(["-v", "train"]) == 0
    assert calls == [(["--config", "gpu", "--steps", "3", "-v", "--help"], "ep-moe train"), ([], "ep-moe train")]


@pytest.mark.parametrize("exists", [False, True])
def test_list_of_an_empty_cache_says_so(isolated, capsys, exists):
    if exists:
        cache_dir().mkdir(parents=True)
    assert cli.main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"cache is empty: {cache_dir()}") and ("does not exist" in out) != exists


def test_list_reports_a_symlink_as_foreign(isolated, capsys):
    dev = device_limits(torch.device("cpu"))
    cache = ConfigCache(cache_dir())
    cache.store(make_key(TINY, dev), CountingTuner("/dev/null")(TINY, dev, (64,)))
    linked = cache.path(make_key(TINY_UP, dev))
    linked.symlink_to(cache.path(make_key(TINY, dev)))
    assert cli.main(["cache", "list"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(linked.name)][0]
    assert f"FOREIGN: a symlink to {cache.path(make_key(TINY, dev))}: the cache opens regular files only" in line


@pytest.mark.parametrize("action", [["list"], ["clear"], ["show", "down"]])
def test_a_cache_directory_that_is_a_file_is_an_error(isolated, capsys, action):
    cache_dir().parent.mkdir(parents=True, exist_ok=True)
    cache_dir().write_text("not a directory")
    assert cli.main(["cache", *action]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the cache directory {cache_dir()} is a file" in err
    assert cache_dir().read_text() == "not a directory"


def test_clear_that_cannot_delete_prints_one_line(isolated, capsys, monkeypatch):
    """As a user without write access (the tests run as root, so chmod would not deny)."""
    dev = device_limits(torch.device("cpu"))
    for problem in (TINY, TINY_UP):
        ConfigCache(cache_dir()).store(make_key(problem, dev), CountingTuner("/dev/null")(problem, dev, (64,)))

    def denied(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", denied)
    assert cli.main(["cache", "clear"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not remove 2 cache file(s)" in err and "Permission denied" in err
    assert "Traceback" not in err and len(list(cache_dir().glob("*.json"))) == 2


def _help_texts() -> list[str]:
    parser = cli._parser()
    texts = [parser.format_help()]
    todo = [parser]
    while todo:
        for action in todo.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    texts.append(sub.format_help())
                    todo.append(sub)
    return texts


def test_help_is_plain_text():
    texts = _help_texts()
    assert len(texts) == 8  # ep-moe, autotune, cache and its four actions, train (its options are the trainer's)
    for text in texts:
        assert "``" not in text and ":func:" not in text and ":mod:" not in text, text
