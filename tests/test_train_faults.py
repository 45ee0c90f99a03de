"""Faults of a training run, on CPU: non-finite losses, gradients, weights and config values.

- a model that turns NaN mid-run stops at the next step with an error naming it, before
  any non-finite checkpoint is written, and the earlier good checkpoints survive pruning;
- a NaN weight at a save step: the checkpoint is refused, the earlier ones are kept;
- ``training.max_skipped_steps`` skips that many non-finite steps, then stops;
- under torchrun (2 ranks), a NaN loss on one rank only stops every rank (no hang), and the
  job exits non-zero;
- NaN and inf config values are rejected, naming the field;
- under torchrun (2 ranks), a config error is printed once, as one line, with no
  traceback from the ranks, and the job exits non-zero before any process group exists.

The in-process runs use a group of one (``init_distributed`` without torchrun) and a
small batch; the NaN comes from a patched ``Trainer.train_step`` / ``Trainer._loss``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NORM = "layers.0.attn_norm.weight"


@pytest.fixture
def train_modules(monkeypatch):
    """The trainer's config and trainer modules, no torchrun environment; the process group
    a Trainer starts is torn down afterwards."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from ep_moe.train import config, trainer

    yield config, trainer
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _job(config, out: Path, *extra: str):
    return config.parse_args([
        "--set", "training.batch_size=2", "--set", "training.seq_len=32", "--set", "training.device='cpu'",
        "--set", "logging.log_interval=100", "--set", "logging.eval_interval=0",
        "--set", "logging.progress_bar=false", "--set", "logging.sample_prompt=''",
        "--set", "checkpoint.interval=10", "--set", "checkpoint.keep=2",
        "--checkpoint-dir", str(out / "ckpt"), *extra])


def _corrupt_after(trainer, monkeypatch, at_step: int) -> None:
    """Write a NaN into one norm weight right after the optimizer step of ``at_step``."""
    original = trainer.Trainer.train_step

    def train_step(self, step):
        result = original(self, step)
        if step == at_step:
            with torch.no_grad():
                self.model.get_parameter(NORM)[0] = float("nan")
        return result

    monkeypatch.setattr(trainer.Trainer, "train_step", train_step)


def _names(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []


def _assert_finite(path: Path, scratch: Path) -> None:
    """Every weight of checkpoint ``path`` is finite (either format; ``scratch``: a file
    that a DCP checkpoint is converted into)."""
    files = [file for file in path.glob("*.pt") if not file.name.startswith("rng-")]
    if (path / ".metadata").is_file():  # DCP: converted into one torch.save file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, scratch)
        files.append(scratch)
    assert files, f"{path} holds no weights"
    for file in files:
        state = torch.load(file, weights_only=True)
        assert state["model"]
        for key, value in state["model"].items():
            assert torch.isfinite(value).all(), f"{file.name}: {key}"


def test_nan_weights_stop_the_run_and_keep_the_good_checkpoints(train_modules, monkeypatch, tmp_path):
    """The issue's run: NaN in a norm weight at step 25, 40 steps, a checkpoint every 10,
    keep 2. It stops at step 26 naming it; step_10 and step_20 stay, nothing later exists."""
    config, trainer = train_modules
    _corrupt_after(trainer, monkeypatch, 25)
    run = trainer.Trainer(_job(config, tmp_path, "--steps", "40"))
    with pytest.raises(FloatingPointError, match=r"step 26: non-finite loss or gradient norm.*"
                                                 r"newest complete checkpoint .* is step_00000020"):
        run.train()
    run.close()
    assert run.step == 25
    assert _names(tmp_path / "ckpt") == ["step_00000010", "step_00000020"]
    for path in (tmp_path / "ckpt").iterdir():
        _assert_finite(path, tmp_path / "converted.pt")


def test_nan_weights_are_never_saved(train_modules, monkeypatch, tmp_path):
    """NaN written right after the optimizer step of a save step: the save refuses, names
    the step and the tensor, and the earlier checkpoints are not pruned."""
    config, trainer = train_modules
    _corrupt_after(trainer, monkeypatch, 30)
    run = trainer.Trainer(_job(config, tmp_path, "--steps", "40"))
    with pytest.raises(FloatingPointError, match=rf"refusing to save the checkpoint of step 30: .*{NORM}"):
        run.train()
    run.close()
    assert _names(tmp_path / "ckpt") == ["step_00000010", "step_00000020"]


def _nan_loss_at(trainer, monkeypatch, steps: set[int]) -> None:
    """``_loss`` returns a NaN cross-entropy at ``steps`` (a bad batch: the weights stay finite)."""
    original = trainer.Trainer._loss

    def loss(self, inputs, targets):
        ce, aux = original(self, inputs, targets)
        if self.step + 1 in steps:  # self.step is the last finished step
            ce = ce * float("nan")
        return ce, aux

    monkeypatch.setattr(trainer.Trainer, "_loss", loss)


def test_max_skipped_steps_skips_then_stops(train_modules, monkeypatch, tmp_path, caplog):
    config, trainer = train_modules
    _nan_loss_at(trainer, monkeypatch, {3, 5})
    run = trainer.Trainer(_job(config, tmp_path, "--steps", "6", "--set", "training.max_skipped_steps=1"))
    with pytest.raises(FloatingPointError, match=r"step 5: non-finite .*max_skipped_steps=1, 1 skipped"):
        run.train()
    run.close()
    assert "step 3: non-finite loss or gradient norm" in caplog.text and "step skipped" in caplog.text
    import torch.distributed as dist

    dist.destroy_process_group()
    run = trainer.Trainer(_job(config, tmp_path / "two", "--steps", "6", "--set", "training.max_skipped_steps=2"))
    run.train()
    run.close()
    assert run.skipped_steps == 2 and run.step == 6
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert _names(tmp_path / "two" / "ckpt") == ["step_00000006"]


WRAPPER = """
from ep_moe.train import train, trainer

original = trainer.Trainer._loss

def _loss(self, inputs, targets):
    ce, aux = original(self, inputs, targets)
    if self.ranks.rank == 1 and self.step + 1 == 3:
        ce = ce + float("nan")  # this rank's loss only: its gradients stay finite
    return ce, aux

trainer.Trainer._loss = _loss
train.main()
"""


def test_nan_loss_on_one_rank_stops_every_rank(tmp_path):
    """Two gloo ranks, a NaN loss on rank 1 only at step 3 (finite gradients, so only the
    shared finite flag sees it): both ranks stop at step 3, the job exits non-zero in
    time, and only the step-2 checkpoint exists."""
    script = tmp_path / "nan_train.py"
    script.write_text(textwrap.dedent(WRAPPER))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--standalone", str(script), "--steps", "6",
           "--set", "training.batch_size=2", "--set", "training.seq_len=32", "--set", "logging.eval_interval=0",
           "--set", "logging.progress_bar=false", "--set", "logging.sample_prompt=''",
           "--set", "checkpoint.interval=2", "--set", "checkpoint.keep=0",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert len(re.findall(r"FloatingPointError: step 3: non-finite loss", output)) >= 2, output[-3000:]
    assert _names(tmp_path / "ckpt") == ["step_00000002"]


@pytest.mark.parametrize("assignment", ["training.lr=inf", "training.lr=nan", "training.weight_decay=nan",
                                        "training.grad_clip=nan", "training.min_lr_ratio=nan",
                                        "training.weight_decay=inf", "training.betas=[nan, 0.95]"])
def test_non_finite_config_values_are_rejected(train_modules, assignment):
    config, _ = train_modules
    field = assignment.partition("=")[0]
    with pytest.raises(ValueError, match=rf"{re.escape(field)}=.* must be finite"):
        config.parse_args(["--set", assignment])


def test_max_skipped_steps_is_checked(train_modules):
    config, _ = train_modules
    with pytest.raises(ValueError, match=r"training.max_skipped_steps=-1 must be >= 0"):
        config.parse_args(["--set", "training.max_skipped_steps=-1"])
    assert config.parse_args([]).training.max_skipped_steps == 0
    assert math.isfinite(config.parse_args([]).training.lr)


@pytest.mark.parametrize("assignment, expected", [
    ("moe.num_expert=16", "--set moe.num_expert=16: unknown key moe.num_expert; did you mean moe.num_experts?"),
    ("training.stepz=10", "--set training.stepz=10: unknown key training.stepz; did you mean training.steps?"),
    ("training.dtype='fp16'", "training.dtype='fp16' is not an allowed value: use one of 'float32', 'bfloat16'"),
])
def test_config_error_under_torchrun_is_printed_once(tmp_path, assignment, expected):
    """Both ranks of ``torchrun -m ep_moe.train`` exit with status 2 (torchrun reports them);
    rank 0 alone prints the error, as one line; neither rank prints a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--standalone", "-m", "ep_moe.train", "--set", assignment,
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("train.py: error:") == 1, output
    line = next(line for line in output.splitlines() if "train.py: error:" in line)
    assert expected in line, line
    assert "exitcode  : 2" in output, output[-2000:]
    assert "ConfigError" not in output and 'File "' + str(REPO / "ep_moe" / "train") not in output, output[-3000:]
    assert not (tmp_path / "ckpt").exists()
