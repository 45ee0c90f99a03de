"""Fault probes of the checkpoint directory (``ep_moe/train/checkpoint.py``, ``ep_moe/train/trainer.py``;
issue 46), in process on the CPU unless said otherwise:

- what the trainer did not write is never deleted nor renamed: a symlink to an archived
  checkpoint (as ``step_N``, ``step_N.partial`` or ``step_N.deleting``) is left alone by
  pruning, by the cleanup of interrupted saves and deletions, and by ``--resume latest``
  finishing an interrupted save, and the archive stays complete; ``--resume`` may still
  read through such a link. A stray file named like a step is left alone, a save of its
  step refuses naming it, and the trainer refuses before step 1 when its schedule would
  save that step;
- steps of any width (``step_100000000`` is newer than ``step_99999999``);
- a checkpoint whose name disagrees with its ``meta.json`` step is refused (``latest``:
  skipped), naming both;
- one trainer per ``checkpoint.dir``: a second one refuses to start, naming the holder
  (host, pid) and the fix; a stale lock of a dead process of this host is taken over
  with a warning; the lock goes at close and when the start fails; two real trainer
  processes on one directory (subprocesses);
- a resume whose ``training.steps`` is reached says so (a warning; exit 0), and an HF
  model is still exported.

A group of one (gloo, ``HashStore``) stands in for torchrun; the model is a one-layer
transformer with 4 experts (``TINY``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiny_trainer import TINY, build, layout, tiny_hf_model

pytestmark = pytest.mark.faults

PROBE_TIMEOUT_S = 120
STEPS = (10, 20, 30)


def _save(train, root: Path, step: int, built, keep: int = 0) -> Path:
    job, net, optimizer = built
    return train.checkpoint.save_checkpoint(root, step, layout(train), net, optimizer,
                                             {"step": step, "data": {"step": step}}, {"config": job.to_dict()}, keep)


def _resume(train, spec: str, root: Path):
    job, net, optimizer = build(train)
    return train.checkpoint.resume(spec, root, layout(train), net, optimizer, job.to_dict())


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def saved(train, group, tmp_path):
    """Complete checkpoints of steps 10, 20 and 30 in ``tmp_path / "ckpt"``, and a complete
    archived one of step 5 in ``tmp_path / "archive"``."""
    root, archive = tmp_path / "ckpt", tmp_path / "archive"
    built = build(train)
    for step in STEPS:
        _save(train, root, step, built)
    _save(train, archive, 5, built)
    return SimpleNamespace(root=root, archive=archive, built=built)


def _assert_archive_intact(train, saved) -> None:
    """The archived step_5 is complete and resumes."""
    path = _ckpt(saved.archive, 5)
    assert (path / train.checkpoint.MARKER).is_file(), f"the archive lost its marker: {_names(path)}"
    found, extra = _resume(train, str(path), saved.archive)
    assert (found, extra["step"]) == (path, 5)


# --- what the trainer did not write ----------------------------------------------------------

def test_pruning_leaves_a_symlinked_archive_alone(train, saved, caplog):
    """The issue's case: ``step_00000005`` in checkpoint.dir is a symlink to an archived
    step. Pruning (keep=2) deletes step_10 and step_20 only; the link stays, the archive
    keeps its marker and resumes, no ``.deleting`` is left, and the log names the link."""
    link = _ckpt(saved.root, 5)
    link.symlink_to(_ckpt(saved.archive, 5), target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        _save(train, saved.root, 40, saved.built, keep=2)
    assert _names(saved.root) == ["step_00000005", "step_00000030", "step_00000040"]
    assert link.is_symlink()
    _assert_archive_intact(train, saved)
    assert re.search(r"step_00000005.*symlink", caplog.text), caplog.text


def test_resume_reads_through_a_link_but_pruning_does_not_delete_it(train, saved):
    """A link to an archived step newer than the others is what ``--resume latest`` loads
    (reading is fine); the next save with keep=1 prunes the real ones, never the link."""
    archived = _save(train, saved.archive, 50, saved.built)
    link = _ckpt(saved.root, 50)
    link.symlink_to(archived, target_is_directory=True)
    found, extra = _resume(train, "latest", saved.root)
    assert (found, extra["step"]) == (link, 50)
    _save(train, saved.root, 60, saved.built, keep=1)
    assert _names(saved.root) == ["step_00000050", "step_00000060"]
    assert link.is_symlink() and (archived / train.checkpoint.MARKER).is_file()


@pytest.mark.parametrize("suffix", [".partial", ".deleting"])
def test_a_linked_partial_or_deleting_is_never_cleaned_through(train, saved, suffix, caplog):
    """``step_40.partial`` or ``step_7.deleting`` as a link to the archive: the save's
    cleanup of interrupted saves and deletions does not follow it. A ``.partial`` in the
    way of the save refuses it, naming it and the fix; a ``.deleting`` is left, named."""
    step = 40 if suffix == ".partial" else 7
    link = saved.root / f"step_{step:08d}{suffix}"
    link.symlink_to(_ckpt(saved.archive, 5), target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        if suffix == ".partial":
            with pytest.raises(train.errors.CheckpointError,
                               match=r"step_00000040\.partial.*symlink.*move it out of checkpoint\.dir"):
                _save(train, saved.root, 40, saved.built, keep=2)
        else:
            _save(train, saved.root, 40, saved.built, keep=2)
            assert re.search(r"step_00000007\.deleting.*symlink", caplog.text), caplog.text
    assert link.is_symlink()
    assert not list(saved.root.glob(f"*{suffix}.deleting")), _names(saved.root)
    _assert_archive_intact(train, saved)


def test_latest_does_not_finish_a_linked_partial(train, saved, caplog):
    """``step_30.partial`` linking to a complete archived step looks like an interrupted
    re-save; ``--resume latest`` must not replace the real step_30 with the link."""
    link = saved.root / "step_00000030.partial"
    link.symlink_to(_ckpt(saved.archive, 5), target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        found, extra = _resume(train, "latest", saved.root)
    assert (found, extra["step"]) == (_ckpt(saved.root, 30), 30)
    assert not _ckpt(saved.root, 30).is_symlink() and link.is_symlink()
    assert re.search(r"step_00000030\.partial.*symlink", caplog.text), caplog.text
    _assert_archive_intact(train, saved)


def test_a_stray_file_named_like_a_step(train, saved, caplog):
    """A regular file ``step_00000004``: pruning leaves it (it is no checkpoint); a save of
    step 4 refuses, naming it and the fix, instead of renaming it and crashing with
    NotADirectoryError; the file is untouched."""
    stray = _ckpt(saved.root, 4)
    stray.write_text("my notes")
    _save(train, saved.root, 40, saved.built, keep=1)
    with pytest.raises(train.errors.CheckpointError,
                       match=r"step_00000004 is in the way: it is a file, not a checkpoint directory this trainer "
                             r"wrote; move it out of checkpoint\.dir"):
        _save(train, saved.root, 4, saved.built, keep=1)
    assert stray.read_text() == "my notes"
    assert _names(saved.root) == ["step_00000004", "step_00000040"]


def _main(train, capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        train.train.main([*TINY, *argv])
    return exc.value.code, capsys.readouterr().err


def test_trainer_refuses_a_stray_entry_it_would_save_over(train, capsys, monkeypatch, tmp_path):
    """checkpoint.dir holds a file ``step_00000004`` and the run saves step 4 (interval 2):
    refused before step 1 (not after 4 steps), one line naming the entry and the fix."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "step_00000004").write_text("my notes")
    steps = []
    original = train.trainer.Trainer.train_step
    monkeypatch.setattr(train.trainer.Trainer, "train_step",
                        lambda self, step: steps.append(step) or original(self, step))
    code, err = _main(train, capsys, "--steps", "6", "--set", "checkpoint.interval=2", "--checkpoint-dir", str(root))
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"checkpoint\.dir=.* holds step_00000004 \(a file, not a checkpoint directory this trainer "
                     r"wrote\), where this run saves step 4: move it away, or pass another checkpoint\.dir", err), err
    assert steps == [], "refused before step 1"
    assert (root / "step_00000004").read_text() == "my notes"


# --- steps of any width ------------------------------------------------------------------------

def test_steps_of_any_width(train, saved):
    """step_100000000 (9 digits) is newer than step_99999999: ``latest`` picks it, and
    pruning orders by step, not by name."""
    for step in (99_999_999, 100_000_000):
        _save(train, saved.root, step, saved.built)
    assert _ckpt(saved.root, 100_000_000).name == "step_100000000"
    found, extra = _resume(train, "latest", saved.root)
    assert (found.name, extra["step"]) == ("step_100000000", 100_000_000)
    _save(train, saved.root, 100_000_001, saved.built, keep=2)
    assert _names(saved.root) == ["step_100000000", "step_100000001"]


# --- a name that disagrees with meta.json ------------------------------------------------------

def test_name_that_disagrees_with_meta_json(train, saved, caplog):
    """step_20 copied by hand as step_40: an explicit resume is refused, naming both steps;
    ``latest`` skips it by name and loads step_30."""
    shutil.copytree(_ckpt(saved.root, 20), _ckpt(saved.root, 40))
    with pytest.raises(train.errors.CheckpointError) as err:
        _resume(train, str(_ckpt(saved.root, 40)), saved.root)
    message = str(err.value)
    assert re.search(r"checkpoint \S+step_00000040: its name says step 40 but its meta\.json says step 20", message)
    assert "\n" not in message
    with caplog.at_level(logging.WARNING):
        found, extra = _resume(train, "latest", saved.root)
    assert (found, extra["step"]) == (_ckpt(saved.root, 30), 30)
    assert re.search(r"skipping \S+step_00000040: .*its name says step 40 but its meta\.json says step 20",
                     caplog.text), caplog.text


# --- one trainer per directory -----------------------------------------------------------------

HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
print("holding", flush=True)
time.sleep(120)
"""


def test_second_trainer_on_a_held_dir_is_refused(train, capsys, tmp_path):
    """Another live process holds ``checkpoint.dir/.lock``: the trainer refuses to start, in
    one line naming the holder's host and pid and the fix; the holder's lock is untouched."""
    root = tmp_path / "ckpt"
    root.mkdir()
    lock = root / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        code, err = _main(train, capsys, "--steps", "2", "--checkpoint-dir", str(root))
        assert code == 2 and err.count("\n") == 1, err
        assert re.search(rf"checkpoint\.dir='{re.escape(str(root))}' is in use by another trainer "
                         rf"\(host {re.escape(socket.gethostname())}, pid {holder.pid}\b", err), err
        assert "pass another checkpoint.dir" in err and "stop that run" in err, err
        assert json.loads(lock.read_text())["pid"] == holder.pid
        assert not list(root.glob("step_*")), "nothing trained"
    finally:
        holder.kill()
        holder.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_of_a_dead_process_is_taken_over(train, tmp_path, caplog):
    """A lock left by a process of this host that no longer runs (a SIGKILLed trainer):
    taken over with a warning naming it; held with this process's pid while the trainer
    lives; gone after close."""
    root = tmp_path / "ckpt"
    root.mkdir()
    lock = root / ".lock"
    dead = _dead_pid()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead}))
    job = train.config.parse_args([*TINY, "--steps", "2", "--checkpoint-dir", str(root)])
    with caplog.at_level(logging.WARNING):
        run = train.trainer.Trainer(job)
    try:
        assert re.search(rf"stale lock .*\.lock.* pid {dead}\b.*no longer runs", caplog.text), caplog.text
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        run.train()
    finally:
        run.close()
        train.trainer.destroy_distributed()
    assert not lock.exists(), "released at close"
    assert _names(root) == ["step_00000002"]


def test_lock_of_another_host_is_not_broken(train, tmp_path):
    """A lock naming another host: whether that run lives cannot be told from here, so it
    is refused, naming the lock file to delete if that run is gone."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / ".lock").write_text(json.dumps({"host": "some-other-node", "pid": 4242}))
    job = train.config.parse_args([*TINY, "--steps", "2", "--checkpoint-dir", str(root)])
    with pytest.raises(train.errors.ConfigError, match=r"in use by another trainer \(host some-other-node, pid 4242"
                                                        r".*if that run is gone, delete \S+\.lock"):
        train.trainer.Trainer(job)


def test_lock_of_another_host_without_heartbeat_is_taken_over(train, tmp_path, caplog):
    """A lock of another host whose heartbeat stopped LOCK_STALE_S ago (a job preempted there,
    restarted here): taken over with a warning naming that host."""
    root = tmp_path / "ckpt"
    root.mkdir()
    lock = root / ".lock"
    lock.write_text(json.dumps({"host": "some-other-node", "pid": 4242}))
    past = time.time() - train.checkpoint.LOCK_STALE_S - 5
    os.utime(lock, (past, past))
    job = train.config.parse_args([*TINY, "--steps", "1", "--checkpoint-dir", str(root)])
    with caplog.at_level(logging.WARNING):
        run = train.trainer.Trainer(job)
    try:
        assert re.search(r"taking over the lock \S+\.lock of host some-other-node, pid 4242, not refreshed", caplog.text)
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        run.close()
        train.trainer.destroy_distributed()


def test_the_holder_refreshes_its_lock(train, tmp_path, monkeypatch):
    """The holder's heartbeat keeps the lock file's modification time fresh."""
    monkeypatch.setattr(train.checkpoint, "LOCK_HEARTBEAT_S", 0.05)
    root = tmp_path / "ckpt"
    lock = train.checkpoint.lock_checkpoint_dir(root)
    try:
        past = time.time() - 1000
        os.utime(root / ".lock", (past, past))
        time.sleep(0.3)
        assert time.time() - os.stat(root / ".lock").st_mtime < 5
    finally:
        lock.release()
    assert not (root / ".lock").exists()


def test_lock_is_released_when_the_start_fails(train, tmp_path):
    """A start that fails after the lock was taken (here: a resume path that does not exist)
    leaves no lock behind."""
    root = tmp_path / "ckpt"
    job = train.config.parse_args([*TINY, "--steps", "2", "--checkpoint-dir", str(root),
                                    "--resume", str(root / "step_00000099")])
    with pytest.raises(train.errors.CheckpointError):
        train.trainer.Trainer(job)
    assert not (root / ".lock").exists()


TRAIN_SLOWLY = """
import sys, time
from ep_moe.train import train, trainer
original = trainer.Trainer.train_step
def train_step(self, step):
    time.sleep(0.05)
    return original(self, step)
trainer.Trainer.train_step = train_step
train.main(sys.argv[1:])
"""


def test_two_trainer_processes_on_one_dir(train, capsys, monkeypatch, tmp_path, caplog):
    """The issue's race: a trainer process runs (saving every step) in checkpoint.dir; a
    second one on the same directory exits 2 at once naming the first's pid, and the
    first keeps going. Once the first is SIGKILLed, a new run takes its stale lock over
    and resumes."""
    root = tmp_path / "ckpt"
    script = tmp_path / "slow.py"
    script.write_text(TRAIN_SLOWLY)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen([sys.executable, str(script), *TINY, "--steps", "100000", "--checkpoint-dir",
                                  str(root), "--set", "checkpoint.interval=1", "--set", "checkpoint.keep=2"],
                                 env={**env, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not list(root.glob("step_*")) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, log.read_text()[-3000:]
        assert json.loads((root / ".lock").read_text())["pid"] == first.pid
        trained = []
        with monkeypatch.context() as m:
            m.setattr(train.trainer.Trainer, "train", lambda self: trained.append(self.step))
            code, err = _main(train, capsys, "--steps", "100000", "--checkpoint-dir", str(root), "--resume", "latest")
        assert code == 2 and f"pid {first.pid}" in err and "in use by another trainer" in err, err
        assert trained == [], "refused before training"
        time.sleep(0.5)
        assert first.poll() is None, "the first run goes on"
    finally:
        first.kill()
        first.wait()
    last = train.checkpoint.complete_checkpoints(root)[-1]
    job = train.config.parse_args([*TINY, "--steps", str(train.checkpoint.checkpoint_step(last) + 1),
                                    "--checkpoint-dir", str(root), "--resume", "latest"])
    with caplog.at_level(logging.WARNING):
        run = train.trainer.Trainer(job)
    try:
        assert f"pid {first.pid}" in caplog.text and "stale lock" in caplog.text, caplog.text
        assert run.step == train.checkpoint.checkpoint_step(last)
    finally:
        run.close()
        train.trainer.destroy_distributed()
    assert not (root / ".lock").exists()


# --- a resume with nothing left to train -------------------------------------------------------

def test_resume_past_the_last_step_says_so(train, tmp_path, caplog):
    """A run resumed at step 4 with training.steps=4 trains nothing, and says so naming the
    step and training.steps (a warning, exit 0); nothing is saved again."""
    root = tmp_path / "ckpt"
    train.train.main([*TINY, "--steps", "4", "--set", "checkpoint.interval=2", "--checkpoint-dir", str(root)])
    before = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    job = train.config.parse_args([*TINY, "--steps", "4", "--checkpoint-dir", str(root), "--resume", "latest"])
    run = train.trainer.Trainer(job)
    try:
        with caplog.at_level(logging.WARNING):
            run.train()
    finally:
        run.close()
        train.trainer.destroy_distributed()
    assert run.step == 4
    assert re.search(r"checkpoint step 4 >= training\.steps=4: nothing to train; raise --steps",
                     caplog.text), caplog.text
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == before


def test_hf_model_resumed_past_the_last_step_is_still_exported(train, tmp_path, caplog):
    """An HF model resumed at training.steps: nothing trained, a warning, and the export
    that ``--export-hf`` asks for is written."""
    transformers = pytest.importorskip("transformers")
    hf = tiny_hf_model(tmp_path, documents=200)
    hf_dir, corpus = hf.folder, hf.corpus
    common = ["--hf-model", str(hf_dir), "--data", str(corpus), "--steps", "2", "--set", "logging.eval_interval=0",
              "--set", "logging.progress_bar=false", "--set", "training.batch_size=2", "--set", "training.seq_len=16",
              "--checkpoint-dir", str(tmp_path / "ckpt")]
    for export, resume in ((str(tmp_path / "first"), []), (str(tmp_path / "again"), ["--resume", "latest"])):
        run = train.trainer.Trainer(train.config.parse_args([*common, "--export-hf", export, *resume]))
        try:
            with caplog.at_level(logging.WARNING):
                run.train()
        finally:
            run.close()
            train.trainer.destroy_distributed()
    assert re.search(r"checkpoint step 2 >= training\.steps=2: nothing to train", caplog.text), caplog.text
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    first = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "first")
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), first.state_dict().items()):
        assert torch.equal(a, b), name
