"""Fault-injection probes of the trainer (``ep_moe.train``), in process, on the CPU.

Each probe feeds one fault and asserts a clean outcome: a ``UserError`` (one line from the
entry point, exit status 2) naming the thing at fault and the fix; no good checkpoint
lost; no hang (every probe runs under an alarm). The groups:

- config: unknown keys (close matches listed first, the command line or the file blamed),
  wrong types, wrong values, values out of range or not finite, malformed ``--set``;
- data: missing, empty, odd-sized files, ids past the vocabulary, a split too short;
  all fail before any process group exists;
- checkpoint files: each file of a checkpoint truncated, overwritten with garbage, emptied,
  deleted or holding the wrong object; an explicit ``--resume`` names the file, the
  checkpoint and an earlier step, ``--resume latest`` skips it (naming it) and loads the
  one before;
- kills in the middle of a save: the save raises (like a kill: a ``BaseException``) at
  each of its file-system steps, in a save that prunes and in a re-save of an existing
  step; every checkpoint that looks complete must load, ``--resume latest`` must find the
  right one, no checkpoint outside the save's own may be lost; and a real SIGKILL of a
  process saving in a loop;
- resume: incomplete, legacy and interrupted checkpoints, other model configs, nothing
  to load;
- non-finite weights, optimizer state, losses and gradients;
- the entry point: exit status 2 and one line for a user error, a traceback for a bug.

A group of one (gloo, ``HashStore``) stands in for torchrun; the model is a one-layer
transformer with 4 experts (``TINY``), so the whole file runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import file_faults
from tiny_trainer import TINY, build, layout

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_S = 60
STEPS = (10, 20, 30)
"""The checkpoints the ``saved`` fixture writes."""


class Kill(BaseException):
    """A simulated kill: a BaseException, so no ``except Exception`` in the code catches it."""


def _save(train, root: Path, step: int, job, net, optimizer, keep: int = 0) -> Path:
    return train.checkpoint.save_checkpoint(root, step, layout(train), net, optimizer, {"step": step, "data": {"step": step}},
                                        {"config": job.to_dict()}, keep)


@pytest.fixture
def saved(train, group, tmp_path):
    """Complete checkpoints of steps 10, 20 and 30 in ``tmp_path / "ckpt"``."""
    root = tmp_path / "ckpt"
    job, net, optimizer = build(train)
    for step in STEPS:
        _save(train, root, step, job, net, optimizer)
    return SimpleNamespace(root=root, job=job, net=net, optimizer=optimizer)


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _load(train, path: Path, *extra: str) -> dict:
    """``load_checkpoint`` of ``path`` into a fresh model of the TINY config (+ ``extra``)."""
    job, net, optimizer = build(train, *extra)
    return train.checkpoint.load_checkpoint(path, layout(train), net, optimizer, job.to_dict())


def _resume(train, spec: str, root: Path, *extra: str):
    job, net, optimizer = build(train, *extra)
    return train.checkpoint.resume(spec, root, layout(train), net, optimizer, job.to_dict())


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- config ------------------------------------------------------------------------------

UNKNOWN_KEYS = {
    "moe.num_expert=16": ("moe.num_expert", "moe.num_experts", "num_experts, "),
    "training.stepz=10": ("training.stepz", "training.steps", "steps, "),
    "model.n_layer=2": ("model.n_layer", "model.n_layers", "n_layers, "),
    "data.pth='x.txt'": ("data.pth", "data.path", "path, "),
    "checkpoint.intervall=5": ("checkpoint.intervall", "checkpoint.interval", "interval, "),
    "logging.log_intervall=5": ("logging.log_intervall", "logging.log_interval", "log_interval, "),
    "parallel.ep=2": ("parallel.ep", None, "autotune_timeout_s, ep_size"),
    "moe.zzz=1": ("moe.zzz", None, "activation, "),
}


@pytest.mark.parametrize("assignment", sorted(UNKNOWN_KEYS))
def test_unknown_key_names_it_and_the_valid_keys(train, assignment):
    """The error blames ``--set`` (not the file), names the key, suggests the closest
    valid key and lists the section's keys, the closest first (``moe`` included: not a
    bare TypeError from MoEConfig)."""
    key, close, listing = UNKNOWN_KEYS[assignment]
    with pytest.raises(train.errors.ConfigError) as err:
        train.config.parse_args(["--set", assignment])
    message = str(err.value)
    assert message.startswith(f"--set {assignment}: unknown key {key}"), message
    assert "tiny.toml" not in message
    if close:
        assert f"did you mean {close}?" in message
    section = key.split(".")[0]
    assert f"[{section}] takes {listing}" in message, message


def test_fp8_experts_on_a_device_without_fp8_are_refused_before_the_process_group(train, monkeypatch):
    """``moe.expert_precision='fp8'`` where the device has no FP8 tensor cores: one config
    error before the process group (not a traceback from the layer's construction)."""
    job = train.config.parse_args([*TINY, "--set", "moe.expert_precision='fp8'"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU without Triton's interpreter: no FP8 kernels
    with pytest.raises(train.errors.ConfigError, match=r"^moe.expert_precision='fp8': FP8 experts run on CUDA GPUs "
                                                       r"with FP8 tensor cores, not on cpu .*moe.expert_precision='bf16'"):
        train.trainer.Trainer(job)
    assert not dist.is_initialized()


def test_unknown_key_in_the_file_blames_the_file(train, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nstepz = 10\n")
    with pytest.raises(train.errors.ConfigError, match=rf"^{re.escape(str(path))}: unknown key training.stepz; "
                                                   r"did you mean training.steps\?"):
        train.config.parse_args(["--config", str(path)])


def test_unknown_table_names_the_close_one(train):
    with pytest.raises(train.errors.ConfigError, match=r"^--set trainng.lr=1: unknown table\(s\) \[trainng\]; "
                                                   r"did you mean \[training\]\?"):
        train.config.parse_args(["--set", "trainng.lr=1"])


WRONG_TYPES = {
    "training.steps=1e1": "an integer", 'training.lr="3e-3"': "a number", "training.betas=[0.9]": "a list of 2",
    "model.qk_norm=1": "true or false", "checkpoint.resume=true": "a string", "training.dtype=16": "one of",
    "training.batch_size=4.0": "an integer", "logging.sample_prompt=42": "a string",
}


@pytest.mark.parametrize("assignment", sorted(WRONG_TYPES))
def test_wrong_type_says_the_type(train, assignment):
    key = assignment.partition("=")[0]
    with pytest.raises(train.errors.ConfigError, match=rf"^--set {re.escape(assignment)}: {re.escape(key)}=.* has the "
                                                   rf"wrong type: expected {WRONG_TYPES[assignment]}"):
        train.config.parse_args(["--set", assignment])


WRONG_VALUES = {
    "training.dtype='fp16'": "'float32', 'bfloat16'", "training.device='gpu'": "'auto', 'cpu', 'cuda'",
    "data.format='csv'": "'auto', 'text', 'uint16', 'int32'", "training.dtype=fp16": "'float32', 'bfloat16'",
}


@pytest.mark.parametrize("assignment", sorted(WRONG_VALUES))
def test_wrong_value_lists_the_allowed_ones(train, assignment):
    """A string that is not one of a field's choices is a wrong value, not a wrong type."""
    with pytest.raises(train.errors.ConfigError) as err:
        train.config.parse_args(["--set", assignment])
    assert "is not an allowed value: use one of " + WRONG_VALUES[assignment] in str(err.value)
    assert "wrong type" not in str(err.value)


OUT_OF_RANGE = {
    "training.lr=inf": "training.lr=inf must be finite", "training.lr=nan": "training.lr=nan must be finite",
    "training.lr=-1": "training.lr=-1.0 must be > 0", "training.grad_clip=nan": "grad_clip=nan must be finite",
    "training.weight_decay=inf": "weight_decay=inf must be finite",
    "training.betas=[nan, 0.9]": "training.betas=(nan, 0.9) must be finite",
    "training.min_lr_ratio=2": "training.min_lr_ratio=2.0 must be in [0, 1]",
    "training.max_skipped_steps=-1": "max_skipped_steps=-1 must be >= 0",
    "training.warmup_steps=-1": "warmup_steps=-1 must be >= 0",
    "checkpoint.keep=-1": "checkpoint.keep=-1 must be >= 0", "checkpoint.interval=-2": "interval=-2 must be >= -1",
    "logging.log_interval=0": "logging.log_interval=0 must be >= 1", "data.val_fraction=0.9": "val_fraction=0.9",
    "model.dim=0": "model.dim=0 must be positive", "moe.top_k=9": "MoEConfig.top_k=9 exceeds num_experts",
    "moe.dispatch='x'": "MoEConfig.dispatch='x': use one of", "moe.num_experts=1.5": "MoEConfig.num_experts=1.5",
    "parallel.ep_size=-1": "parallel.ep_size=-1 must be >= 0", "moe.hidden_size=8": "set from model.dim",
    "moe.transport='nccl'": "MoEConfig.transport no longer exists",
}


@pytest.mark.parametrize("assignment", sorted(OUT_OF_RANGE))
def test_bad_value_blames_the_command_line(train, assignment):
    with pytest.raises(train.errors.ConfigError) as err:
        train.config.parse_args(["--set", assignment])
    assert str(err.value).startswith(f"--set {assignment}: "), str(err.value)
    assert OUT_OF_RANGE[assignment] in str(err.value)


@pytest.mark.parametrize("argv, expected", [
    (["--steps", "0"], r"^--steps 0: training.steps=0 must be positive"),
    (["--set", "training"], r"^--set 'training': expected SECTION.KEY=VALUE"),
    (["--set", "=3"], r"expected SECTION.KEY=VALUE"),
    (["--config", "missing.toml"], r"^--config missing.toml: no such file"),
    (["--config", "tinyy"], r"^--config tinyy: no such file and no preset of that name; presets: .*\btiny\b"),
])
def test_malformed_command_line(train, argv, expected):
    with pytest.raises(train.errors.ConfigError, match=expected):
        train.config.parse_args(argv)


def test_config_file_that_is_not_toml(train, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training\nsteps = 3\n")
    with pytest.raises(train.errors.ConfigError, match=rf"--config {re.escape(str(path))}: not a valid TOML file"):
        train.config.parse_args(["--config", str(path)])


def test_moe_section_missing_required_keys(train, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[moe]\ntop_k = 2\n")
    with pytest.raises(train.errors.ConfigError, match=r"\[moe\] needs moe.intermediate_size, moe.num_experts"):
        train.config.parse_args(["--config", str(path)])


@pytest.mark.parametrize("world, extra", [(2, ["--ep-size", "3"]), (4, ["--set", "moe.num_experts=6", "--ep-size", "4"]),
                                          (3, [])])
def test_ep_size_that_does_not_divide(train, world, extra):
    """Checked from the world size alone, before any process group exists."""
    job = train.config.parse_args([*TINY, *extra])
    with pytest.raises(train.errors.ConfigError, match=r"parallel.ep_size=\d+ must divide the world size .*--ep-size"):
        train.trainer.check_parallel(job, world, job.moe_config().num_experts)
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_device_without_a_gpu(train):
    job = train.config.parse_args([*TINY, "--set", "training.device='cuda'"])
    with pytest.raises(train.errors.ConfigError, match="no CUDA GPU is visible; use 'auto' or 'cpu'"):
        train.trainer.Trainer(job)
    assert not dist.is_initialized()


# --- data --------------------------------------------------------------------------------

DATA_FAULTS = {
    "empty.txt": (b"", r"data.path='.*empty.txt' is empty \(0 bytes\)"),
    "empty.bin": (b"", r"data.path='.*empty.bin' is empty \(0 bytes\)"),
    "missing.txt": (None, r"data.path='.*missing.txt' is not a file"),
    "odd.bin": (b"\x01\x02\x03", r"has 3 bytes, not a multiple of 2 \(uint16\); set data.format"),
    "negative.i32": ((-5).to_bytes(4, "little", signed=True) * 64, r"holds negative token ids"),
    "wide.bin": ((1000).to_bytes(2, "little") * 4096,
                 r"token ids up to 1000, past model.vocab_size \(256 ids\); set model.vocab_size >= 1001"),
    "short.txt": (b"x" * 16, r"training split .* has 15 tokens, fewer than seq_len \+ 2 = 18"),
}


@pytest.mark.parametrize("name", sorted(DATA_FAULTS))
def test_bad_data_file_fails_before_the_process_group(train, tmp_path, name):
    content, expected = DATA_FAULTS[name]
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    job = train.config.parse_args([*TINY, "--data", str(path)])
    with pytest.raises(train.errors.DataError, match=expected):
        train.trainer.Trainer(job)
    assert not dist.is_initialized(), "a data error must come before any collective"


# --- corrupt checkpoint files ------------------------------------------------------------

CKPT_FILES = ("dense.pt", "experts-000-of-001.pt", "rng-00000.pt", "meta.json")


def _wrong_object(path: Path) -> None:
    if path.suffix == ".json":
        path.write_text('{"step": "thirty"}')
    else:
        torch.save([1, 2, 3], path)


CORRUPTIONS = {"truncated": (file_faults.truncate, "cannot be read|is not valid JSON"),
               "garbage": (file_faults.garbage, "cannot be read|is not valid JSON"),
               "empty": (file_faults.empty, r"is empty \(0 bytes\)"), "deleted": (file_faults.delete, "is missing"),
               "wrong_object": (_wrong_object, "does not hold a checkpoint part|holds no RNG state|lacks step")}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("name", CKPT_FILES)
def test_corrupt_file_names_it_and_an_earlier_step(train, saved, name, corruption):
    """``--resume step_30`` with one damaged file: the error names the file, the checkpoint
    and ``--resume`` with step_20; nothing on disk is deleted."""
    damage, problem = CORRUPTIONS[corruption]
    damage(_ckpt(saved.root, 30) / name)
    before = _listing(saved.root)
    with pytest.raises(train.errors.CheckpointError) as err:
        _resume(train, str(_ckpt(saved.root, 30)), saved.root)
    message = str(err.value)
    assert f"checkpoint {_ckpt(saved.root, 30)}: its file {name} " in message, message
    assert re.search(problem, message), message
    assert f"--resume {_ckpt(saved.root, 20)}" in message, message
    assert "Traceback" not in message and "\n" not in message
    assert _listing(saved.root) == before


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("name", CKPT_FILES)
def test_latest_skips_a_corrupt_checkpoint(train, saved, name, corruption, caplog):
    """``--resume latest`` with step_30 damaged loads step_20 and logs why it skipped step_30."""
    CORRUPTIONS[corruption][0](_ckpt(saved.root, 30) / name)
    with caplog.at_level(logging.WARNING):
        path, extra = _resume(train, "latest", saved.root)
    assert (path, extra["step"]) == (_ckpt(saved.root, 20), 20)
    assert re.search(rf"skipping .*step_00000030: .*its file {re.escape(name)} ", caplog.text), caplog.text
    assert _ckpt(saved.root, 30).is_dir(), "a damaged checkpoint is left for the user to inspect"


def test_no_checkpoint_loads(train, saved):
    for step in STEPS:
        file_faults.empty(_ckpt(saved.root, step) / "dense.pt")
    with pytest.raises(train.errors.CheckpointError, match=r"no complete checkpoint in .* loads \(newest first\): "
                                                       r"step_00000030: .*step_00000020: .*step_00000010: "):
        _resume(train, "latest", saved.root)


# --- kills in the middle of a save -------------------------------------------------------

def _delete_some(path: Path) -> None:
    """What a kill during ``rmtree`` leaves: some files gone (the weights), some not (meta.json)."""
    for name in ("dense.pt", "experts-000-of-001.pt"):
        if (path / name).exists():
            os.unlink(path / name)  # not Path.unlink, which a probe may be counting


@contextlib.contextmanager
def _kill_at(monkeypatch, root: Path, op: str, nth: int, seen: Counter):
    """Raise Kill at the ``nth`` call of file-system operation ``op`` on a path under
    ``root`` (counting every operation in ``seen``); a killed ``rmtree`` has deleted
    some files first."""
    originals = {"torch.save": (torch, "save", 1), "rmtree": (shutil, "rmtree", 0),
                 "os.replace": (os, "replace", 0), "rename": (Path, "rename", 0),
                 "write_text": (Path, "write_text", 0), "unlink": (Path, "unlink", 0)}

    def hook(name, original, index):
        def wrapped(*args, **kwargs):
            target = Path(args[index])
            if target.is_relative_to(root):
                seen[name] += 1
                if name == op and seen[name] == nth:
                    if name == "rmtree" and target.is_dir():
                        _delete_some(target)
                    raise Kill(f"killed at {op} #{nth} ({target.name})")
            return original(*args, **kwargs)
        return wrapped

    with monkeypatch.context() as m:
        for name, (owner, attr, index) in originals.items():
            m.setattr(owner, attr, hook(name, getattr(owner, attr), index))
        yield


PRUNE_OPS = [("torch.save", 1), ("torch.save", 2), ("torch.save", 3), ("write_text", 1), ("os.replace", 1),
             ("rename", 1), ("rmtree", 1), ("rename", 2), ("unlink", 1), ("rmtree", 2),
             ("rmtree", 3), ("rename", 3), ("unlink", 2), ("rmtree", 4)]
"""Every file-system step of saving step 40 with keep=2 over 10, 20 and 30: write the
files, the meta, the marker, rename into place, then prune 10 and 20 (clear an old
``.deleting``, rename away, unmark, delete)."""
RESAVE_OPS = [("torch.save", 1), ("torch.save", 2), ("torch.save", 3), ("write_text", 1), ("os.replace", 1),
              ("rmtree", 1), ("rename", 1), ("unlink", 1), ("rmtree", 2), ("rename", 2)]
"""Every file-system step of saving step 20 again over 10, 20 and 30 (keep=0): the new
files, meta and marker, then the old step_20 renamed away, unmarked and deleted, and the
new one renamed into place."""


def _check_after_kill(train, root: Path) -> list[int]:
    """Every checkpoint that looks complete loads; returns their steps."""
    steps = []
    for path in train.checkpoint.complete_checkpoints(root):
        assert _load(train, path)["step"] == train.checkpoint.checkpoint_step(path), path
        steps.append(train.checkpoint.checkpoint_step(path))
    return steps


@pytest.mark.parametrize("op, nth", PRUNE_OPS)
def test_kill_during_save_and_prune(train, saved, monkeypatch, op, nth):
    """Killed at any step of a save that prunes: what looks complete loads, step_30 is never
    lost, ``--resume latest`` takes step_40 once its marker was written (finishing the
    rename into place if need be), else step_30; and the same save then succeeds, leaving
    nothing behind."""
    seen = Counter()
    with pytest.raises(Kill), _kill_at(monkeypatch, saved.root, op, nth, seen):
        _save(train, saved.root, 40, saved.job, saved.net, saved.optimizer, keep=2)
    steps = _check_after_kill(train, saved.root)
    assert 30 in steps, f"step_30 lost: {_listing(saved.root)}"
    at = PRUNE_OPS.index((op, nth))
    assert (40 in steps) == (at > PRUNE_OPS.index(("rename", 1))), "step_40 is in place once renamed"
    path, extra = _resume(train, "latest", saved.root)
    assert extra["step"] == (40 if at > PRUNE_OPS.index(("os.replace", 1)) else 30), "complete once marked"
    _save(train, saved.root, 40, saved.job, saved.net, saved.optimizer, keep=2)
    assert sorted(p.name for p in saved.root.iterdir()) == ["step_00000030", "step_00000040"]


@pytest.mark.parametrize("op, nth", RESAVE_OPS)
def test_kill_during_resave(train, saved, monkeypatch, op, nth):
    """Killed at any step of a re-save of step_20: what looks complete loads, step_10 and
    step_30 are untouched, and after ``--resume latest`` (which finishes an interrupted
    replacement) step_20 is complete and loads: the old one or the new one."""
    seen = Counter()
    with pytest.raises(Kill), _kill_at(monkeypatch, saved.root, op, nth, seen):
        _save(train, saved.root, 20, saved.job, saved.net, saved.optimizer)
    assert {10, 30} <= set(_check_after_kill(train, saved.root))
    path, extra = _resume(train, "latest", saved.root)
    assert extra["step"] == 30
    assert _check_after_kill(train, saved.root) == [10, 20, 30], _listing(saved.root)


@pytest.mark.parametrize("scenario, step, keep, ops", [("prune", 40, 2, PRUNE_OPS), ("resave", 20, 0, RESAVE_OPS)])
def test_kill_points_cover_every_step(train, saved, monkeypatch, scenario, step, keep, ops):
    """The kill points above are every file-system step the save takes (update them when
    the save changes)."""
    seen = Counter()
    with _kill_at(monkeypatch, saved.root, "none", 0, seen):
        _save(train, saved.root, step, saved.job, saved.net, saved.optimizer, keep=keep)
    assert seen == Counter(name for name, _ in ops)


KILL_LOOP = """
import sys, torch, torch.distributed as dist
from ep_moe.train import checkpoint, config, model, trainer
job = config.parse_args({tiny!r})
torch.manual_seed(0)
net = model.MoETransformer(job.model, job.moe_config(), None)
opt = trainer.build_optimizer(net, job.training, torch.device("cpu"))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
layout = checkpoint.Layout(rank=0, world_size=1, ep_rank=0, ep_size=1)
root = checkpoint.Path({root!r})
for step in range(1, 100000):
    for _ in range(2):  # each step saved twice: the second is a re-save
        checkpoint.save_checkpoint(root, step, layout, net, opt, {{"step": step, "data": {{"step": step}}}},
                                   {{"config": job.to_dict()}}, keep=2)
    print(step, flush=True)
"""


@pytest.mark.parametrize("delay_s", [0.05, 0.37])
def test_sigkill_during_a_save_loop(train, group, tmp_path, delay_s):
    """A process saving (and re-saving, and pruning) in a loop is killed with SIGKILL: every
    checkpoint that looks complete loads and ``--resume latest`` finds one."""
    root = tmp_path / "ckpt"
    script = tmp_path / "loop.py"
    script.write_text(KILL_LOOP.format(tiny=TINY, root=str(root)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, str(script)], env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1", "the loop did not start"
        time.sleep(delay_s)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert _check_after_kill(train, root), _listing(root)
    assert _resume(train, "latest", root) is not None


# --- resume ------------------------------------------------------------------------------

def test_latest_skips_a_half_deleted_checkpoint(train, saved, caplog):
    """The issue's case: step_30 lost its weights but kept meta.json (an interrupted
    deletion of the old layout): without its marker it is passed over, by name."""
    path = _ckpt(saved.root, 30)
    (path / train.checkpoint.MARKER).unlink()
    _delete_some(path)
    with caplog.at_level(logging.WARNING):
        found, extra = _resume(train, "latest", saved.root)
    assert extra["step"] == 20
    assert re.search(r"skipping .*step_00000030: incomplete \(no COMPLETE marker", caplog.text), caplog.text


def test_latest_finishes_an_interrupted_resave(train, saved, caplog):
    """A complete ``step_30.partial`` whose old ``step_30`` was already renamed away: put in place."""
    final = _ckpt(saved.root, 30)
    final.rename(final.with_name(final.name + ".partial"))
    with caplog.at_level(logging.WARNING):
        found, extra = _resume(train, "latest", saved.root)
    assert (found, extra["step"]) == (final, 30)
    assert "finished an interrupted save" in caplog.text


def test_legacy_checkpoint_without_marker_is_incomplete(train, saved):
    (_ckpt(saved.root, 30) / train.checkpoint.MARKER).unlink()
    with pytest.raises(train.errors.CheckpointError, match=r"is not a complete checkpoint \(no COMPLETE marker.*"
                                                       r"--resume .*step_00000020"):
        _resume(train, str(_ckpt(saved.root, 30)), saved.root)


@pytest.mark.parametrize("where", ["missing_dir", "empty_dir"])
def test_latest_with_nothing_to_resume_starts_fresh(train, group, tmp_path, where):
    root = tmp_path / "ckpt"
    if where == "empty_dir":
        root.mkdir()
    assert _resume(train, "latest", root) is None


def test_explicit_path_that_does_not_exist(train, saved):
    with pytest.raises(train.errors.CheckpointError, match=r"not a complete checkpoint \(no such directory\).*"
                                                       r"--resume .*step_00000030"):
        _resume(train, str(saved.root / "step_00000099"), saved.root)


@pytest.mark.parametrize("change, named", [
    (["--set", "model.dim=64"], "model.dim=32 in the checkpoint, 64 in this run"),
    (["--set", "model.n_layers=2"], "model.n_layers=1 in the checkpoint, 2 in this run"),
    (["--set", "moe.num_experts=8"], "moe.num_experts=4 in the checkpoint, 8 in this run"),
    (["--set", "moe.intermediate_size=16"], "moe.intermediate_size=32 in the checkpoint, 16 in this run"),
    (["--set", "moe.num_shared_experts=1"], "moe.num_shared_experts=unset in the checkpoint, 1 in this run"),
])
def test_another_model_config_names_the_fields(train, saved, change, named):
    """Not torch's raw ``size mismatch``: the config values that differ come first."""
    with pytest.raises(train.errors.CheckpointError) as err:
        _resume(train, str(_ckpt(saved.root, 30)), saved.root, *change)
    message = str(err.value)
    assert "saved with another model config (" in message and named in message, message
    assert message.index(named) < message.index("so its tensors do not fit this model"), message
    assert message.index(named) < message.find("size mismatch") or "size mismatch" not in message


def test_ep_size_of_the_checkpoint_must_divide_the_experts(train, saved):
    meta = _ckpt(saved.root, 30) / "meta.json"
    meta.write_text(meta.read_text().replace('"ep_size": 1', '"ep_size": 3'))
    with pytest.raises(train.errors.CheckpointError, match=r"saved at EP 3, which does not divide this model's 4 experts"):
        _resume(train, str(_ckpt(saved.root, 30)), saved.root)


# --- non-finite values ---------------------------------------------------------------------

@pytest.mark.parametrize("where, value", [("weight", float("nan")), ("weight", float("inf")),
                                          ("optimizer", float("nan"))])
def test_non_finite_state_is_never_saved(train, saved, where, value):
    """A save of non-finite weights or optimizer state is refused; nothing is pruned."""
    before = _listing(saved.root)
    param = saved.net.get_parameter("layers.0.attn_norm.weight")
    with torch.no_grad():
        target = param if where == "weight" else saved.optimizer.state[param]["exp_avg"]
        target[0] = value
    with pytest.raises(FloatingPointError, match=r"refusing to save the checkpoint of step 40"):
        _save(train, saved.root, 40, saved.job, saved.net, saved.optimizer, keep=1)
    assert _listing(saved.root) == before


@pytest.mark.parametrize("fault", ["nan_loss", "inf_grad"])
def test_non_finite_step_is_flagged_and_left_unclipped(train, group, fault):
    job, net, _ = build(train)
    for p in net.parameters():
        p.grad = torch.full_like(p, 10.0)
    loss = torch.tensor(float("nan") if fault == "nan_loss" else 1.0)
    if fault == "inf_grad":
        next(net.parameters()).grad[0] = float("inf")
    total, finite = train.trainer.clip_gradients(net, 1.0, None, loss)
    assert not finite
    assert next(net.parameters()).grad.flatten()[-1] == 10.0, "a non-finite step's gradients stay unclipped"


# --- the entry point -----------------------------------------------------------------------

def _main(train, capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        train.train.main([*TINY, *argv])
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--set", "moe.num_expert=16"], "--set moe.num_expert=16: unknown key moe.num_expert; did you mean"),
    (["--set", "training.dtype='fp16'"], "training.dtype='fp16' is not an allowed value"),
    (["--data", "/nonexistent/corpus.txt"], "data.path='/nonexistent/corpus.txt' is not a file"),
])
def test_user_error_is_one_line_and_exit_2(train, capsys, argv, expected):
    code, err = _main(train, capsys, *argv)
    assert code == 2
    assert err.startswith("train.py: error: ") and expected in err and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not dist.is_initialized()


def test_empty_data_file_from_the_entry_point(train, capsys, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"")
    code, err = _main(train, capsys, "--data", str(path))
    assert code == 2 and f"data.path='{path}' is empty (0 bytes)" in err, err


def test_corrupt_checkpoint_from_the_entry_point(train, saved, capsys):
    file_faults.truncate(_ckpt(saved.root, 30) / "dense.pt")
    dist.destroy_process_group()  # main() starts its own
    code, err = _main(train, capsys, "--checkpoint-dir", str(saved.root), "--resume", str(_ckpt(saved.root, 30)))
    assert code == 2 and "its file dense.pt cannot be read" in err and "--resume" in err, err
    assert err.count("\n") == 1
    assert not dist.is_initialized(), "main() tears its process group down"


def test_a_bug_keeps_its_traceback(train, monkeypatch, tmp_path):
    def broken(self):
        raise KeyError("a bug")

    monkeypatch.setattr(train.trainer.Trainer, "train", broken)
    with pytest.raises(KeyError, match="a bug"):
        train.train.main([*TINY, "--steps", "1", "--checkpoint-dir", str(tmp_path)])
    assert not dist.is_initialized()
