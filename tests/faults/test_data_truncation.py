"""Fault probes of memory-mapped data truncated while the trainer uses it (issue 46).

A token file (``data.path``, ``data.eval_path``) and the token cache of tokenized text are
memory-mapped; reading a page past the end of a file that shrank raises SIGBUS, which kills
the process without naming anything. The trainer checks each mapped file's size against
the length it mapped when it maps it and before each epoch (and each evaluation), and
stops with a ``DataError`` naming the file and the fix (exit status 2, one line).

Each probe runs the trainer in a subprocess (a SIGBUS there fails the probe instead of
killing pytest): a wrapper around the trainer's ``main`` truncates the file at a chosen
point. A truncation in the middle of an epoch is not caught before the epoch ends (the
checks cost one ``fstat`` per file and epoch, none per step).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_trainer import tiny_hf_model

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "moe.num_experts=4", "--set", "moe.intermediate_size=32", "--set", "moe.top_k=2",
        "--set", "training.batch_size=2", "--set", "training.seq_len=16", "--set", "training.device='cpu'",
        "--set", "logging.progress_bar=false", "--set", "logging.sample_prompt=''", "--set", "logging.log_interval=1"]
WINDOWS = 20
"""Windows of 16 tokens per epoch of the token file: 10 steps of batch 2 (one rank)."""

WRAPPER = """
import os, sys
from ep_moe.train import train, trainer

VICTIM, WHEN = sys.argv[1], sys.argv[2]


def victim():
    if VICTIM == "cache":  # the token cache of the text file, next to it
        import pathlib
        return str(next(pathlib.Path(sys.argv[3] + ".ep_moe-tokens").glob("*.tokens")))
    return VICTIM


if WHEN == "start":  # after the data is mapped, before step 1
    original_resume = trainer.Trainer._resume

    def _resume(self):
        original_resume(self)
        os.truncate(victim(), 0)
        print("truncated before step 1", flush=True)

    trainer.Trainer._resume = _resume
else:  # right after step WHEN
    original_step = trainer.Trainer.train_step

    def train_step(self, step):
        out = original_step(self, step)
        if step == int(WHEN):
            os.truncate(victim(), 0)
            print(f"truncated after step {step}", flush=True)
        return out

    trainer.Trainer.train_step = train_step
train.main(sys.argv[4:])
"""


def _run(tmp_path: Path, victim: str, when: str, source: str, argv: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "truncate.py"
    script.write_text(WRAPPER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(script), victim, when, source, *argv], cwd=REPO,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)


def _token_file(path: Path, tokens: int, seed: int) -> Path:
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    path.write_bytes(ids.to(torch.uint16).numpy().tobytes())
    return path


def _assert_named(proc: subprocess.CompletedProcess, option: str, file: Path | str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode != -signal.SIGBUS, f"killed by SIGBUS: {output[-2000:]}"
    assert proc.returncode == 2, output[-3000:]
    errors = re.findall(r"train\.py: error: .*", proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    message = errors[0]
    assert f"{option}=" in message and str(file) in message, message
    assert re.search(r"shrank to 0 bytes.*mapped", message) and "restore" in message, message
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("when", ["start", "10"])
def test_token_file_truncated(tmp_path, when):
    """``data.path`` truncated after it was mapped (before step 1), or at the end of epoch 0
    (step 10): stopped naming the file, not killed by SIGBUS."""
    data = _token_file(tmp_path / "train.bin", WINDOWS * 16 + 1, seed=0)
    held_out = _token_file(tmp_path / "val.bin", 200, seed=1)
    proc = _run(tmp_path, str(data), when, "", [*TINY, "--steps", "30", "--data", str(data), "--eval-data",
                                                str(held_out), "--set", "logging.eval_interval=0",
                                                "--checkpoint-dir", str(tmp_path / "ckpt")])
    _assert_named(proc, "data.path", data)
    if when == "10":
        assert "step    10/30" in proc.stdout and "step    11/30" not in proc.stdout, proc.stdout[-2000:]


def test_eval_file_truncated(tmp_path):
    """``data.eval_path`` truncated after step 2: the evaluation of step 4 stops naming it."""
    data = _token_file(tmp_path / "train.bin", WINDOWS * 16 + 1, seed=0)
    held_out = _token_file(tmp_path / "val.bin", 2000, seed=1)
    proc = _run(tmp_path, str(held_out), "2", "", [*TINY, "--steps", "8", "--data", str(data), "--eval-data",
                                                   str(held_out), "--set", "logging.eval_interval=4",
                                                   "--checkpoint-dir", str(tmp_path / "ckpt")])
    _assert_named(proc, "data.eval_path", held_out)


def test_token_cache_truncated(tmp_path):
    """The token cache of tokenized text (an HF model's) truncated after it was mapped:
    stopped naming the cache file and the fix, not killed by SIGBUS."""
    pytest.importorskip("transformers")
    hf = tiny_hf_model(tmp_path)
    hf_dir, corpus = hf.folder, hf.corpus
    proc = _run(tmp_path, "cache", "start", str(corpus),
                ["--hf-model", str(hf_dir), "--data", str(corpus), "--steps", "2", "--set", "logging.eval_interval=0",
                 "--set", "logging.progress_bar=false", "--set", "training.batch_size=2",
                 "--set", "training.seq_len=16", "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-hf", ""])
    cache = next(Path(f"{corpus}.ep_moe-tokens").glob("*.tokens"))
    _assert_named(proc, "data.path", cache)
    assert "token cache" in proc.stderr and "delete" in proc.stderr, proc.stderr[-2000:]
