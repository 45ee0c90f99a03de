"""Fault probes of the trainer's output paths (``ep_moe/train/trainer.py``; issue 46): each one
that is of the wrong kind or cannot be written stops the run before step 1, in seconds,
with a ``ConfigError`` naming the option and the fix, instead of a raw ``OSError`` at the
first save (after up to ``checkpoint.interval`` steps) or a traceback:

- ``checkpoint.dir`` (written by every rank: checked on every rank before the process
  group starts): a file, a path under a file, a directory that cannot be written;
- ``logging.metrics_file``, ``logging.tensorboard_dir`` (written by rank 0 only: checked
  by rank 0 once the process group is up, its verdict broadcast, so every rank fails
  alike): a directory as the metrics file, a file as the TensorBoard folder, paths under a
  file, folders that cannot be written;
- ``checkpoint.export_hf`` of an HF model: a file as the export folder;
- under ``torchrun --nproc-per-node 2``: one line, exit status 2, no rank left waiting.

The tests run as root, for whom every permission check passes, so "cannot be written"
is simulated by monkeypatching ``os.access`` (which the trainer consults) to deny the
path; a path under a regular file (``somefile/sub``) is the real, root-proof case.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tiny_trainer import TINY as TINY_RUN, tiny_hf_model

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROBE_TIMEOUT_S = 120
TINY = [*TINY_RUN, "--steps", "2"]


@pytest.fixture
def no_training(train, monkeypatch):
    """Fails the probe if any step runs: the error must come before step 1."""
    def train_step(self, step):
        raise AssertionError(f"step {step} ran: the output path was to be refused before step 1")

    monkeypatch.setattr(train.trainer.Trainer, "train_step", train_step)


def _deny_writes(monkeypatch, denied: Path) -> None:
    """``os.access`` says no write access to ``denied`` (and anything under it)."""
    real = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path).absolute().is_relative_to(denied.absolute()):
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def _refused(train, argv: list[str], option: str, pattern: str, before_group: bool, base=TINY) -> str:
    job = train.config.parse_args([*base, *argv])
    with pytest.raises(train.errors.ConfigError) as err:
        train.trainer.Trainer(job)
    message = str(err.value)
    assert message.startswith(f"{option}="), message
    assert re.search(pattern, message), message
    assert "\n" not in message
    if before_group:
        assert not dist.is_initialized(), "checked before the process group starts"
    return message


# --- checkpoint.dir -----------------------------------------------------------------------------

def test_checkpoint_dir_that_is_a_file(train, no_training, tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    _refused(train, ["--checkpoint-dir", str(path)], "checkpoint.dir",
             r"is a file, not a directory: pass a directory for the checkpoints \(--checkpoint-dir", True)
    assert path.read_text() == "not a directory"


def test_checkpoint_dir_under_a_file(train, no_training, tmp_path):
    (tmp_path / "somefile").write_text("x")
    path = tmp_path / "somefile" / "sub"
    _refused(train, ["--checkpoint-dir", str(path)], "checkpoint.dir",
             rf"cannot be created: '{re.escape(str(tmp_path / 'somefile'))}' is a file, not a directory: "
             r"pass another path \(--checkpoint-dir\)", True)


@pytest.mark.parametrize("exists", [True, False])
def test_checkpoint_dir_that_cannot_be_written(train, no_training, monkeypatch, tmp_path, exists):
    """A read-only directory (simulated: ``os.access`` denies writes; the tests run as
    root), or a missing one whose parent is read-only."""
    parent = tmp_path / "readonly"
    parent.mkdir()
    path = parent / "ckpt"
    if exists:
        path.mkdir()
    _deny_writes(monkeypatch, parent)
    _refused(train, ["--checkpoint-dir", str(path)], "checkpoint.dir",
             r"cannot be (written|created).*(permission denied|not writable).*--checkpoint-dir", True)
    assert path.exists() == exists


def test_checkpoint_dir_never_written_is_not_checked(train, tmp_path):
    """checkpoint.interval=-1 (never save), no resume, no export: the directory is not
    used, so a bad one does not stop the run."""
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    run = train.trainer.Trainer(train.config.parse_args([*TINY, "--checkpoint-dir", str(path),
                                                           "--set", "checkpoint.interval=-1"]))
    try:
        run.train()
    finally:
        run.close()
    assert run.step == 2


# --- rank 0's files -----------------------------------------------------------------------------

def test_metrics_file_that_is_a_directory(train, no_training, tmp_path):
    path = tmp_path / "metrics"
    path.mkdir()
    _refused(train, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(path)],
             "logging.metrics_file", r"is a directory: pass a file path \(--metrics-file\)", False)
    assert not (tmp_path / "ckpt" / ".lock").exists(), "no lock left behind"


def test_metrics_file_under_a_file(train, no_training, tmp_path):
    (tmp_path / "somefile").write_text("x")
    _refused(train, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file",
                      str(tmp_path / "somefile" / "run.jsonl")],
             "logging.metrics_file", r"cannot be created: '.*somefile' is a file, not a directory", False)


def test_metrics_file_that_cannot_be_written(train, no_training, monkeypatch, tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("")
    _deny_writes(monkeypatch, path)
    _refused(train, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(path)],
             "logging.metrics_file", r"cannot be written \(permission denied\).*--metrics-file", False)


class _Writer:
    """A stand-in for TensorBoard's SummaryWriter (not installed here), which creates its
    folder as the real one does."""

    def __init__(self, logdir, purge_step=None):
        os.makedirs(logdir, exist_ok=True)

    def add_scalar(self, *args):
        pass

    def flush(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("under_a_file", [False, True])
def test_tensorboard_dir_that_is_a_file(train, no_training, monkeypatch, tmp_path, under_a_file):
    monkeypatch.setattr(train.trainer, "tensorboard_writer_class", lambda: _Writer)
    (tmp_path / "runs").write_text("x")
    path = tmp_path / "runs" / "sub" if under_a_file else tmp_path / "runs"
    pattern = (r"cannot be created: '.*runs' is a file, not a directory" if under_a_file else
               r"is a file, not a directory: pass a directory \(--tensorboard")
    _refused(train, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--tensorboard", str(path)],
             "logging.tensorboard_dir", pattern, False)


def test_good_paths_train(train, monkeypatch, tmp_path):
    """Paths that do not exist yet, under writable folders: the run trains and writes them."""
    monkeypatch.setattr(train.trainer, "tensorboard_writer_class", lambda: _Writer)
    out = tmp_path / "out"
    run = train.trainer.Trainer(train.config.parse_args(
        [*TINY, "--checkpoint-dir", str(out / "ckpt"), "--metrics-file", str(out / "logs" / "run.jsonl"),
         "--tensorboard", str(out / "runs" / "tiny")]))
    try:
        run.train()
    finally:
        run.close()
    assert (out / "logs" / "run.jsonl").read_text().count("\n") >= 1
    assert (out / "runs" / "tiny").is_dir() and (out / "ckpt" / "step_00000002").is_dir()


def test_export_hf_that_is_a_file(train, no_training, tmp_path):
    """An HF model whose ``--export-hf`` names a file: refused before step 1, not after the
    run with the export's raw error."""
    pytest.importorskip("transformers")
    hf = tiny_hf_model(tmp_path)
    hf_dir, corpus = hf.folder, hf.corpus
    target = tmp_path / "export"
    target.write_text("x")
    _refused(train, ["--hf-model", str(hf_dir), "--data", str(corpus), "--checkpoint-dir", str(tmp_path / "ckpt"),
                      "--export-hf", str(target)],
             "checkpoint.export_hf", r"is a file, not a directory: pass a folder for the HF export \(--export-hf.*"
                                     r"or '' for no export", False,
             base=["--steps", "2", "--set", "logging.progress_bar=false", "--set", "training.batch_size=2",
                   "--set", "training.seq_len=16"])


# --- every rank alike ---------------------------------------------------------------------------

def test_bad_metrics_file_under_torchrun(tmp_path):
    """Two ranks, a directory as the metrics file (only rank 0 writes it): both stop before
    step 1 with exit status 2, one line from rank 0, no rank's traceback (torchrun prints its
    own summary), no rank left waiting."""
    (tmp_path / "metrics").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--standalone", "launch/train.py", *TINY,
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / "metrics")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    lines = re.findall(r"train\.py: error: .*", output)
    assert len(lines) == 1 and "logging.metrics_file=" in lines[0] and "is a directory" in lines[0], output[-3000:]
    assert not re.search(r'File ".*(launch|ep_moe/train)/\w+\.py"', output), "no rank's traceback (torchrun prints its own)"
    codes = set(re.findall(r"exitcode\s*: (-?\d+)", output))  # a rank still tearing down gets torchrun's SIGTERM
    assert "2" in codes and codes <= {"2", "-15"}, output[-3000:]
    assert "step     1" not in output, output[-3000:]
    assert not list((tmp_path / "ckpt").glob("step_*"))
