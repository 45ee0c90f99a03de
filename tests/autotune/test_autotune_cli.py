"""The ``ep-moe`` console script, in process, with the stub tuner."""

from __future__ import annotations

import json

import pytest
from _dist import CountingTuner, isolated, tune_calls  # noqa: F401

from ep_moe import cli
from ep_moe.autotune.cache import cache_dir


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
    (cache_dir() / "down-broken.json").write_text("{")
    cli.main(["cache", "list"])
    assert "down-broken.json  INVALID" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out and list(cache_dir().glob("*.json")) == []


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "presets:"),
    (["--model", "tiny", "--ep-size", "3"], "ep_size=3"),
])
def test_autotune_bad_input_exits_2(stub_tuner, capsys, args, message):
    assert cli.main(["autotune", *args]) == 2
    assert message in capsys.readouterr().err
