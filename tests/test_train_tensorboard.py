"""The trainer's ``--tensorboard DIR``: rank 0 writes what it logs as TensorBoard scalars,
and without the ``tensorboard`` package the run stops at once with one line naming the fix.

Each run is one process of the trainer (no torchrun: a group of one), on the CPU
with the torch experts (``TRITON_INTERPRET`` off, as in ``tests/test_train.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Four steps of the tiny default config, each logged, evaluated at step 2 and at the end.
RUN_ARGS = ["--steps", "4", "--set", "logging.log_interval=1", "--set", "logging.eval_interval=2",
            "--set", "logging.progress_bar=false", "--set", "logging.sample_prompt=''",
            "--set", "checkpoint.interval=-1", "--set", "training.batch_size=4"]
TRAIN_TAGS = {"train/loss", "train/aux_loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
              "train/load_min", "train/load_max", "train/load_mean"}


def _train(tmp_path: Path, *extra: str, prelude: str = "") -> subprocess.CompletedProcess:
    """The trainer's ``main`` in one process from the repository root; ``prelude`` runs
    first in the same interpreter."""
    code = f"{prelude}\nfrom ep_moe.train.train import main\nmain({[*RUN_ARGS, *extra]!r})\n"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)


def test_scalars_match_the_metrics_file(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = _train(tmp_path, "--tensorboard", str(tmp_path / "tb"), "--metrics-file", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == TRAIN_TAGS | {"val/loss"}
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    for tag in TRAIN_TAGS | {"val/loss"}:
        name = "val_loss" if tag == "val/loss" else tag.removeprefix("train/")
        want = [(r["step"], r[name]) for r in records if name in r]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]


def test_missing_tensorboard_is_one_line_naming_the_install(tmp_path):
    # ``import tensorboard`` fails, as where the package is not installed
    proc = _train(tmp_path, "--tensorboard", str(tmp_path / "tb"),
                  prelude="import sys; sys.modules['tensorboard'] = None")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "train.py: error: --tensorboard (logging.tensorboard_dir) needs the tensorboard package, which is not "
        "installed: pip install tensorboard"]
    assert not (tmp_path / "tb").exists()
