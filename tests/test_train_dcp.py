"""The trainer's DCP checkpoints (``checkpoint.format = "dcp"``, the default), on CPU.

Under ``torchrun`` (gloo, the ``tiny`` preset shortened to ``STEPS`` steps; a
wrapper around the trainer's ``main`` dumps every rank's weights and AdamW state, keyed by
global expert id, after each save and after resuming):

- a run at (world 4, EP 4) saves step 2; resumed at EP 2 (EP 2 x DP 2), EP 1 (DP 4) and at
  (world 2, EP 2), every rank holds exactly the saved weights and AdamW state of its
  experts and of the dense layers; at world 4 the next steps' losses are the
  uninterrupted run's (to float rounding: the expert sums run in another order);
- the EP 2 run, whose ``--resume latest`` passes over a newer checkpoint without its
  marker (named in the log), is killed (SIGKILL) in its save of step 4 once DCP has
  written all its files but the ``COMPLETE`` marker is not: that save does not count, and
  the world-2 run's ``--resume latest`` in that directory resumes from step 2.

In process (a gloo group of one, a one-layer model): the config value and its errors;
both formats round trip exactly and resume from one directory; each DCP file damaged is
named with an earlier step (explicit ``--resume``) or skipped by name (``latest``); a save
killed at each of its steps leaves nothing that looks complete and does not load, and
never loses the newest complete checkpoint; non-finite state is never saved (another model
config's error: tests/faults/test_trainer_faults.py).
The whole file takes about 50 s on 2 cores (load average 3), 36 s of it the four trainer
runs (three at world 4: mostly the start of 4 processes that import torch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

import file_faults
from test_dcp import _assert_equal_views

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 4
SAVED = 2
"""The step of the checkpoint every resumed run starts from."""
RUN_ARGS = ["--config", "tiny", "--steps", str(STEPS), "--set", "training.batch_size=4",
            "--set", "logging.log_interval=1", "--set", "logging.eval_interval=0",
            "--set", "logging.progress_bar=false", "--set", "logging.sample_prompt=''"]

WRAPPER = """
import os, signal
import torch
from ep_moe.parallel import is_expert_param
from ep_moe.train import checkpoint, train, trainer

DUMP = {dump!r}
KILL_AT = int(os.environ.get("KILL_SAVE_AT", "0"))


def view(model, optimizer):
    # weights and AdamW state by global name (experts by global id), from the model and optimizer themselves
    out = {{f"model.{{k}}": v.detach().clone() for k, v in model.state_dict().items()}}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param, {{}})
        if not is_expert_param(param):
            out.update({{f"optim.{{name}}.{{k}}": v.clone() for k, v in state.items()}})
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        for j, g in enumerate(owner.global_ids()):
            out.update({{f"optim.{{name}}.{{g}}.{{k}}": (v[j] if v.dim() else v).clone() for k, v in state.items()}})
    return out


def dump(self, what):
    os.makedirs(DUMP, exist_ok=True)
    torch.save(view(self.model, self.optimizer), os.path.join(DUMP, f"{{what}}-rank{{self.ranks.rank}}.pt"))


original_save, original_resume = trainer.Trainer._save, trainer.Trainer._resume
original_mark = checkpoint._mark_complete


def _save(self, step):
    original_save(self, step)
    dump(self, f"saved{{step}}")


def _resume(self):
    original_resume(self)
    if self.step:
        dump(self, "resumed")


def _mark_complete(path, step):
    if step == KILL_AT:  # everything written, DCP's .metadata included: only the marker is missing
        os.kill(os.getpid(), signal.SIGKILL)
    original_mark(path, step)


trainer.Trainer._save, trainer.Trainer._resume, checkpoint._mark_complete = _save, _resume, _mark_complete
train.main()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", **extra)
    return env


def _train(out: Path, world: int, ep: int, *extra: str, ckpt: Path, kill_at: int = 0) -> SimpleNamespace:
    """One run of the wrapped trainer; its metrics, dumps, log and exit status."""
    out.mkdir(parents=True, exist_ok=True)
    script = out / "train_dumping.py"
    script.write_text(WRAPPER.format(dump=str(out / "dump")))
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(world), "--standalone", str(script), *RUN_ARGS,
           "--ep-size", str(ep), "--checkpoint-dir", str(ckpt), "--metrics-file", str(out / "metrics.jsonl"), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(KILL_SAVE_AT=str(kill_at)), capture_output=True, text=True,
                          timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 or kill_at, f"{' '.join(cmd)} failed:\n{log[-4000:]}"
    assert f"world {world}, EP {ep}," in log, "the run did not use the layout asked for"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dumps = {}
    for file in sorted((out / "dump").glob("*-rank*.pt")):
        what, _, rank = file.stem.rpartition("-rank")
        dumps.setdefault(what, {})[int(rank)] = torch.load(file, weights_only=True)
    views = {what: [by_rank[r] for r in sorted(by_rank)] for what, by_rank in dumps.items()}
    return SimpleNamespace(records=records, views=views, log=log, returncode=proc.returncode)


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The saving run at (4, EP 4); its step-2 checkpoint resumed at (4, EP 2), killed in its
    own save of step 4, at (4, EP 1), and by ``--resume latest`` at (2, EP 2) in the
    directory of the killed run."""
    root = tmp_path_factory.mktemp("train_dcp")
    saved = _train(root / "saved", 4, 4, "--set", f"checkpoint.interval={SAVED}", "--set", "checkpoint.keep=0",
                   ckpt=root / "saved" / "ckpt")
    saved_ckpt = root / "saved" / "ckpt" / f"step_{SAVED:08d}"
    killed_dir = root / "w4ep2" / "ckpt"
    shutil.copytree(saved_ckpt, killed_dir / saved_ckpt.name)
    unmarked = killed_dir / f"step_{STEPS:08d}"  # the saving run's step 4 without its marker
    shutil.copytree(saved_ckpt.with_name(unmarked.name), unmarked)
    (unmarked / "COMPLETE").unlink()
    out = SimpleNamespace(root=root, saved=saved, killed_dir=killed_dir, resumed={})
    out.resumed[(4, 2)] = _train(root / "w4ep2", 4, 2, "--resume", "latest", "--set", f"checkpoint.interval={STEPS}",
                                 ckpt=killed_dir, kill_at=STEPS)
    out.listing_after_kill = sorted(p.name for p in killed_dir.iterdir())
    out.resumed[(4, 1)] = _train(root / "w4ep1", 4, 1, "--resume", str(saved_ckpt), "--set",
                                 "checkpoint.interval=-1", ckpt=root / "w4ep1" / "ckpt")
    out.resumed[(2, 2)] = _train(root / "w2ep2", 2, 2, "--resume", "latest", "--set", "checkpoint.interval=-1",
                                 ckpt=killed_dir)
    out.listing_after_resume = sorted(p.name for p in killed_dir.iterdir())
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [(4, 2), (4, 1), (2, 2)])
def test_resume_at_another_layout_is_exact(runs, layout):
    """Saved at (world 4, EP 4), resumed at ``layout`` = (world, EP): every rank's weights and
    AdamW state (moments and step of every expert it now holds) equal the saved ones."""
    resumed = runs.resumed[layout]
    assert re.search(rf"resumed from \S+/step_{SAVED:08d} at step {SAVED}\n", resumed.log), resumed.log[-3000:]
    assert len(resumed.views["resumed"]) == layout[0]
    _assert_equal_views(resumed.views["resumed"], runs.saved.views[f"saved{SAVED}"])


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [2, 1])
def test_resumed_run_continues_the_uninterrupted_one(runs, ep):
    """At the same world size (the same batches) the losses after the resume are those of
    the uninterrupted EP 4 run, to float rounding."""
    want = {s: v for s, v in _losses(runs.saved.records).items() if s > SAVED}
    assert sorted(want) == list(range(SAVED + 1, STEPS + 1))
    assert _losses(runs.resumed[(4, ep)].records) == pytest.approx(want, rel=1e-5)


@pytest.mark.distributed
def test_killed_save_resumes_from_the_last_complete_one(runs):
    """``--resume latest`` passed over a newer step-4 checkpoint without its marker (named
    in the log); that run was killed in its own save of step 4 after DCP had written all
    its files, ``.metadata`` included, so the save left only ``step_4.partial`` (and the
    killed run's lock of the directory); the next ``--resume latest`` (at world 2) took the
    stale lock over (its pid no longer runs), passed over both and resumed from step 2, and
    released the lock at its end."""
    killed = runs.resumed[(4, 2)]
    assert killed.returncode != 0 and "Signal 9 (SIGKILL)" in killed.log, killed.log[-3000:]
    skipped = rf"skipping \S+step_{STEPS:08d}: incomplete \(no COMPLETE marker"
    assert re.search(skipped, killed.log), killed.log[-3000:]
    assert f"saved{STEPS}" not in killed.views, "the save of step 4 was to be killed"
    partial = runs.killed_dir / f"step_{STEPS:08d}.partial"
    assert runs.listing_after_kill == [".lock", f"step_{SAVED:08d}", f"step_{STEPS:08d}", partial.name]
    assert (partial / ".metadata").is_file() and not (partial / "COMPLETE").exists()
    again = runs.resumed[(2, 2)]
    assert re.search(skipped, again.log) and f"resumed from {runs.killed_dir / f'step_{SAVED:08d}'} at" in again.log
    assert re.search(r"taking over the stale lock \S+/\.lock of pid \d+ on this host", again.log), again.log[-3000:]
    assert sorted(_losses(again.records)) == list(range(SAVED + 1, STEPS + 1))
    assert ".lock" not in runs.listing_after_resume, runs.listing_after_resume


# --- in process: a gloo group of one -------------------------------------------------------

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "moe.num_experts=4", "--set", "moe.intermediate_size=32", "--set", "moe.top_k=2",
        "--set", "training.batch_size=2", "--set", "training.seq_len=16", "--set", "training.device='cpu'",
        "--set", "logging.eval_interval=0", "--set", "data.synthetic_bytes=8192"]
STEPS_SAVED = (10, 20, 30)


class Kill(BaseException):
    """A simulated kill: a BaseException, so no ``except Exception`` in the code catches it."""


@pytest.fixture
def train(monkeypatch):
    """The trainer's modules (no torchrun environment) and a gloo group of one, torn down
    afterwards."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from ep_moe.train import checkpoint, config, errors, model, trainer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield SimpleNamespace(checkpoint=checkpoint, config=config, errors=errors, model=model, trainer=trainer,
                          layout=checkpoint.Layout(rank=0, world_size=1, ep_rank=0, ep_size=1))
    if dist.is_initialized():
        dist.destroy_process_group()


def _build(train, *extra: str, seed: int = 0, steps: int = 2):
    """This config's job, model and AdamW with state (``seed``: of the weights and of
    ``steps`` steps of random gradients)."""
    job = train.config.parse_args([*TINY, *extra])
    torch.manual_seed(seed)
    net = train.model.MoETransformer(job.model, job.moe_config(), None)
    optimizer = train.trainer.build_optimizer(net, job.training, torch.device("cpu"))
    for _ in range(steps):
        for p in net.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return job, net, optimizer


def _save(train, root: Path, step: int, job, net, optimizer, keep: int = 0, fmt: str = "dcp") -> Path:
    return train.checkpoint.save_checkpoint(root, step, train.layout, net, optimizer,
                                             {"step": step, "data": {"step": step}}, {"config": job.to_dict()},
                                             keep, format=fmt)


def _resume(train, spec: str, root: Path, *extra: str):
    """``checkpoint.resume`` into a new model and optimizer, as the trainer does."""
    job, net, optimizer = _build(train, *extra, seed=1, steps=0)
    found = train.checkpoint.resume(spec, root, train.layout, net, optimizer, job.to_dict())
    return found, net, optimizer


def _state(net, optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v for k, v in net.state_dict().items()}
    for i, (name, _) in enumerate(net.named_parameters()):
        state.update({f"optim.{name}.{k}": v for k, v in optimizer.state_dict()["state"][i].items()})
    return state


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def saved(train, tmp_path):
    """Complete DCP checkpoints of steps 10, 20 and 30 in ``tmp_path / "ckpt"``."""
    root = tmp_path / "ckpt"
    job, net, optimizer = _build(train)
    for step in STEPS_SAVED:
        _save(train, root, step, job, net, optimizer)
    return SimpleNamespace(root=root, job=job, net=net, optimizer=optimizer)


def test_format_config(train):
    """``dcp`` is the default; another value names the field and the choices."""
    assert train.config.parse_args([]).checkpoint.format == "dcp"
    assert train.config.parse_args(["--set", "checkpoint.format='native'"]).checkpoint.format == "native"
    with pytest.raises(train.errors.ConfigError, match=r"^--set checkpoint.format='torch': checkpoint.format="
                                                        r"'torch' is not an allowed value: use one of 'dcp', 'native'"):
        train.config.parse_args(["--set", "checkpoint.format='torch'"])
    with pytest.raises(ValueError, match=r"checkpoint.format='x': use 'dcp' or 'native'"):
        train.checkpoint.CheckpointConfig(format="x")


def test_both_formats_round_trip_and_resume_from_one_directory(train, tmp_path):
    """Each format loads back exactly (weights, AdamW state, RNG); a directory holding both
    resumes from the newest, whatever its format."""
    root = tmp_path / "ckpt"
    job, net, optimizer = _build(train)
    _save(train, root, 10, job, net, optimizer, fmt="native")
    rng = torch.get_rng_state()
    _save(train, root, 20, job, net, optimizer, fmt="dcp")
    assert (_ckpt(root, 20) / ".metadata").is_file() and not (_ckpt(root, 20) / "dense.pt").exists()
    assert json.loads((_ckpt(root, 20) / "meta.json").read_text())["format"] == "dcp"
    want = {k: v.clone() for k, v in _state(net, optimizer).items()}
    for step in (20, 10):
        torch.manual_seed(123)
        (path, extra), other, other_optimizer = _resume(train, "latest", root)
        assert (path, extra) == (_ckpt(root, step), {"step": step, "data": {"step": step}})
        got = _state(other, other_optimizer)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
        assert torch.equal(torch.get_rng_state(), rng)
        shutil.rmtree(_ckpt(root, step))


CORRUPTIONS = {"truncated": file_faults.truncate, "garbage": file_faults.garbage, "deleted": file_faults.delete}
DAMAGE = {(".metadata", "deleted"): r"its file \.metadata is missing",
          (".metadata", "truncated"): r"it cannot be read \(UnpicklingError: ",
          ("__0_0.distcp", "deleted"): r"it cannot be read \(rank 0: FileNotFoundError: .*__0_0\.distcp",
          ("__0_0.distcp", "truncated"): r"it cannot be read \(rank 0: RuntimeError: ",
          ("__0_0.distcp", "garbage"): r"it cannot be read \(rank 0: UnpicklingError: ",
          ("meta.json", "garbage"): r"its file meta.json is not valid JSON",
          ("rng-00000.pt", "deleted"): r"its file rng-00000.pt is missing"}
"""Each file of a DCP checkpoint (world 1), damaged: the reason the error gives. The files
the native format shares (meta.json, rng) are probed in every way in tests/faults/."""


@pytest.mark.parametrize("name, corruption", sorted(DAMAGE))
def test_damaged_file(train, saved, name, corruption, caplog):
    """``--resume step_30`` with one damaged file: the error names the checkpoint, why and
    ``--resume`` with step_20; ``--resume latest`` skips it, naming it, and loads step_20."""
    CORRUPTIONS[corruption](_ckpt(saved.root, 30) / name)
    before = _listing(saved.root)
    with pytest.raises(train.errors.CheckpointError) as err:
        _resume(train, str(_ckpt(saved.root, 30)), saved.root)
    message = str(err.value)
    assert message.startswith(f"cannot resume from checkpoint {_ckpt(saved.root, 30)}: "), message
    assert re.search(DAMAGE[name, corruption], message), message
    assert f"--resume {_ckpt(saved.root, 20)}" in message and "\n" not in message, message
    assert _listing(saved.root) == before
    with caplog.at_level(logging.WARNING):
        (path, extra), _, _ = _resume(train, "latest", saved.root)
    assert (path, extra["step"]) == (_ckpt(saved.root, 20), 20)
    assert re.search(r"skipping \S+step_00000030: cannot resume from checkpoint", caplog.text), caplog.text


@contextlib.contextmanager
def _kill_at(monkeypatch, root: Path, op: str, nth: int, seen: list[str]):
    """Raise Kill at the ``nth`` call of ``op`` on a path under ``root``, appending each op
    to ``seen``: DCP's writes of its data files and of its ``.metadata``, and the file-system
    steps of ``ep_moe/train/checkpoint.py`` (DCP's ``.metadata`` is a temp file renamed into place)."""
    originals = {"dcp.write_data": (FileSystemWriter, "write_data", None),
                 "dcp.finish": (FileSystemWriter, "finish", None),
                 "torch.save": (torch, "save", 1), "rmtree": (shutil, "rmtree", 0), "os.replace": (os, "replace", 0),
                 "rename": (Path, "rename", 0), "write_text": (Path, "write_text", 0)}

    def hook(name, original, index):
        def wrapped(*args, **kwargs):
            target = args[0].path if index is None else args[index]
            if isinstance(target, (str, os.PathLike)) and Path(target).is_relative_to(root):
                seen.append(name)
                if name == op and seen.count(name) == nth:
                    raise Kill(f"killed at {op} #{nth} ({Path(target).name})")
            return original(*args, **kwargs)
        return wrapped

    with monkeypatch.context() as m:
        for name, (owner, attr, index) in originals.items():
            m.setattr(owner, attr, hook(name, getattr(owner, attr), index))
        yield


SAVE_STEPS = ["dcp.write_data", "dcp.finish", "rename", "torch.save", "write_text", "os.replace", "rename",
              "rmtree", "rename", "rmtree", "rmtree", "rename", "rmtree"]
"""Every file-system step of saving step 40 with keep=2 over 10, 20 and 30, in order: DCP
writes its data, then its ``.metadata`` (a temp file renamed), the RNG file, meta.json, the
marker (a temp file replaced into place), the rename into place, then pruning steps 10 and
20 (clear an old ``.deleting``, rename away, delete)."""
KILL_POINTS = [(op, SAVE_STEPS[:i + 1].count(op)) for i, op in enumerate(SAVE_STEPS)]
MARKED = KILL_POINTS.index(("os.replace", 1))
"""Killed past this point, the save is complete (in place, or left for ``--resume latest``)."""
IN_PLACE = KILL_POINTS.index(("rename", 2))


@pytest.mark.parametrize("op, nth", KILL_POINTS)
def test_kill_during_save(train, saved, monkeypatch, op, nth):
    """Killed at any step of a DCP save that prunes: every checkpoint that looks complete
    loads, step_30 is never lost, a save killed before its marker does not count (DCP's own
    ``.metadata`` is not enough), ``--resume latest`` takes step_40 once marked; the same save
    then succeeds, leaving nothing behind."""
    with pytest.raises((Kill, CheckpointException)), _kill_at(monkeypatch, saved.root, op, nth, []):
        _save(train, saved.root, 40, saved.job, saved.net, saved.optimizer, keep=2)
    at = KILL_POINTS.index((op, nth))
    complete = train.checkpoint.complete_checkpoints(saved.root)
    assert _ckpt(saved.root, 30) in complete, _listing(saved.root)
    assert (_ckpt(saved.root, 40) in complete) == (at > IN_PLACE), _listing(saved.root)
    marked = [p.name for p in saved.root.glob("step_00000040*") if (p / train.checkpoint.MARKER).is_file()]
    assert bool(marked) == (at > MARKED), _listing(saved.root)
    for path in complete:
        (_, extra), _, _ = _resume(train, str(path), saved.root)
        assert extra["step"] == train.checkpoint.checkpoint_step(path)
    (_, extra), _, _ = _resume(train, "latest", saved.root)
    assert extra["step"] == (40 if at > MARKED else 30)
    _save(train, saved.root, 40, saved.job, saved.net, saved.optimizer, keep=2)
    assert sorted(p.name for p in saved.root.iterdir()) == ["step_00000030", "step_00000040"]


def test_kill_points_cover_every_step(train, saved, monkeypatch):
    """The kill points above are every file-system step the save takes (update them when
    the save changes)."""
    seen = []
    with _kill_at(monkeypatch, saved.root, "none", 0, seen):
        _save(train, saved.root, 40, saved.job, saved.net, saved.optimizer, keep=2)
    assert seen == SAVE_STEPS


def test_non_finite_state_is_never_saved(train, saved):
    before = _listing(saved.root)
    param = saved.net.get_parameter("layers.0.moe.experts.gate_up")
    with torch.no_grad():
        saved.optimizer.state[param]["exp_avg"][1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"refusing to save the checkpoint of step 40: .*experts.gate_up"):
        _save(train, saved.root, 40, saved.job, saved.net, saved.optimizer, keep=1)
    assert _listing(saved.root) == before
