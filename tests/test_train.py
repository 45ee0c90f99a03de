"""End-to-end tests of the training entry points, on CPU.

- ``launch/train.py`` (the checkout's entry point of ``ep_moe.train``) under ``torchrun
  --nproc-per-node 2`` (gloo, torch experts, EP=2): the loss falls; resuming from a checkpoint logs exactly the losses of the uninterrupted
  run, also with activation checkpointing (and, to rounding, with compiled blocks); the
  EP=2 checkpoint also resumes at EP=1 (experts resharded on load). These runs save in the
  default format, DCP (``tests/test_train_dcp.py``: other layouts, faults).
- resuming from an earlier checkpoint of a directory that holds newer ones: pruning keeps
  the newer ones and this run's own, the metrics file drops the records past the resumed
  step; a resume takes the optimizer's hyper-parameters from the config, not the checkpoint
  (either format).
- a validation split too short for one sequence: named in the error, or not needed when
  evaluation is off.
- in-process: config overrides and their errors (type checks included), every preset,
  checkpoint discovery, data batches.
- the other entry points, ``python -m ep_moe.train`` and ``ep-moe train``.
- ``launch/warmup_node.sh``: the first run tunes, the second is a pure cache hit.

Each trainer run is a subprocess, so the Triton interpreter that ``conftest.py`` switches
on for this process is switched off for them (the trainer's CPU path is the torch one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 30
CKPT_EVERY = 10
# The tiny default config, shortened: every step logged, checkpoints kept, no sample.
RUN_ARGS = [
    "--steps", str(STEPS),
    "--set", "logging.log_interval=1",
    "--set", "logging.eval_interval=10",
    "--set", "logging.progress_bar=false",
    "--set", "logging.sample_prompt=''",
    "--set", f"checkpoint.interval={CKPT_EVERY}",
    "--set", "checkpoint.keep=0",
    "--set", "training.batch_size=8",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _train_cmd(out: Path, *extra: str) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--standalone", "launch/train.py", *RUN_ARGS,
            "--checkpoint-dir", str(out / "ckpt"), "--metrics-file", str(out / "metrics.jsonl"), *extra]


def _train(out: Path, *extra: str) -> list[dict]:
    """Run the trainer on 2 gloo ranks (EP=2 unless ``extra`` says otherwise); return its
    metrics records. Rank 0's log goes to ``out / "train.log"``."""
    proc = _run(_train_cmd(out, *extra), _env(), timeout=300)
    (out / "train.log").write_text(proc.stdout)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _by_step(records: list[dict], field: str) -> dict[int, float]:
    return {r["step"]: r[field] for r in records if field in r}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One uninterrupted 30-step run at EP=2, checkpointing every 10 steps."""
    out = tmp_path_factory.mktemp("full")
    return out, _train(out, "--ep-size", "2")


def test_loss_falls(full_run):
    out, records = full_run
    loss = _by_step(records, "loss")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss[1] > 5.0, "a fresh byte-level model starts near ln(256) = 5.5"
    assert loss[STEPS] < 0.6 * loss[1], f"loss did not fall enough: {loss[1]:.3f} -> {loss[STEPS]:.3f}"
    val = _by_step(records, "val_loss")
    assert sorted(val) == [10, 20, 30] and val[30] < val[10]
    last = records[-2]
    assert last["load_min"] <= last["load_mean"] <= last["load_max"]
    assert last["aux_loss"] > 0 and last["tokens_per_s"] > 0
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [f"step_{s:08d}" for s in (10, 20, 30)]


def test_run_starts_with_its_config_and_ends_with_a_summary(full_run):
    """The log opens with the config in a few lines and closes with the run's summary; the
    loss curve is drawn beside the metrics file (matplotlib is in the test extra)."""
    out, _ = full_run
    log = (out / "train.log").read_text()
    assert re.search(r"model: built-in, 2 layers, dim 128, .* 8 experts top-2", log)
    assert re.search(rf"training: {STEPS} steps of 8 x 64 tokens per rank", log)
    summary = re.search(r"run done: steps 1-30 in [\d.]+ s, [\d,]+ tokens/s in the steps; final loss [\d.]+; "
                        r"val loss [\d.]+; last checkpoint (\S+); metrics \S+, loss curve (\S+)", log)
    assert summary, log[-2000:]
    assert summary.group(1).endswith("step_00000030") and Path(summary.group(2)).is_file()
    assert len(log.splitlines()[0]) < 200, "no config dump of a thousand characters"


def test_resume_is_exact(full_run, tmp_path):
    """A copy of the step-10 checkpoint, picked up by ``--resume latest``, continues with
    exactly the losses, gradient norms and expert loads of the uninterrupted run."""
    out, records = full_run
    shutil.copytree(out / "ckpt" / "step_00000010", tmp_path / "ckpt" / "step_00000010")
    resumed = _train(tmp_path, "--ep-size", "2", "--resume", "latest")
    for field in ("loss", "aux_loss", "grad_norm", "load_min", "load_max", "val_loss"):
        want = {s: v for s, v in _by_step(records, field).items() if s > CKPT_EVERY}
        assert _by_step(resumed, field) == want, field


def test_resume_reshards_experts(full_run, tmp_path):
    """The EP=2 checkpoint loads at EP=1: each rank then holds all 8 experts, read from
    the DCP checkpoint, optimizer state included; the run continues up to float rounding."""
    out, records = full_run
    resumed = _train(tmp_path, "--ep-size", "1", "--resume", str(out / "ckpt" / "step_00000010"))
    want = {s: v for s, v in _by_step(records, "loss").items() if s > CKPT_EVERY}
    assert _by_step(resumed, "loss") == pytest.approx(want, abs=1e-4)


def test_all_gather_dispatch_continues_the_run(full_run, tmp_path):
    """The step-10 checkpoint continued with ``moe.dispatch='all_gather'`` (no host sync;
    every rank gets every token) gives the all-to-all run's losses up to float rounding."""
    out, records = full_run
    shutil.copytree(out / "ckpt" / "step_00000010", tmp_path / "ckpt" / "step_00000010")
    resumed = _train(tmp_path, "--ep-size", "2", "--resume", "latest", "--set", "moe.dispatch='all_gather'")
    for field in ("loss", "val_loss"):
        want = {s: v for s, v in _by_step(records, field).items() if s > CKPT_EVERY}
        assert _by_step(resumed, field) == pytest.approx(want, abs=1e-4), field


def test_activation_checkpointing_keeps_the_run_exact(full_run, tmp_path):
    """Recomputing every block in the backward (the MoE all-to-alls included) continues the
    run from its step-10 checkpoint with exactly its losses, gradient norms and loads."""
    out, records = full_run
    shutil.copytree(out / "ckpt" / "step_00000010", tmp_path / "ckpt" / "step_00000010")
    resumed = _train(tmp_path, "--ep-size", "2", "--resume", "latest",
                     "--set", "training.activation_checkpointing=true")
    for field in ("loss", "aux_loss", "grad_norm", "load_min", "load_max", "val_loss"):
        want = {s: v for s, v in _by_step(records, field).items() if s > CKPT_EVERY}
        assert _by_step(resumed, field) == want, field


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="torch.compile on the CPU (Inductor) needs a C++ compiler")
def test_compiled_blocks_continue_the_run(full_run, tmp_path):
    """Every block under torch.compile (Inductor) continues the run from its step-20
    checkpoint with its losses, up to the rounding of fused kernels."""
    out, records = full_run
    shutil.copytree(out / "ckpt" / "step_00000020", tmp_path / "ckpt" / "step_00000020")
    resumed = _train(tmp_path, "--ep-size", "2", "--resume", "latest", "--set", "training.compile=true")
    want = {s: v for s, v in _by_step(records, "loss").items() if s > 2 * CKPT_EVERY}
    assert _by_step(resumed, "loss") == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def branched_run(full_run, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A copy of the full run's checkpoints (10, 20, 30) and metrics, resumed by path from
    step 10 up to step 16, saving every 3 steps and keeping 1: a run that branches off an
    earlier step of a directory holding newer checkpoints (another run's, to this one)."""
    out, _ = full_run
    branch = tmp_path_factory.mktemp("branch")
    shutil.copytree(out / "ckpt", branch / "ckpt")
    shutil.copy(out / "metrics.jsonl", branch / "metrics.jsonl")
    records = _train(branch, "--ep-size", "2", "--steps", "16", "--resume", str(branch / "ckpt" / "step_00000010"),
                     "--set", "checkpoint.keep=1", "--set", "checkpoint.interval=3")
    return branch, records


def test_keep_prunes_only_up_to_the_saved_step(branched_run):
    """keep=1 leaves the newest checkpoint up to the step just saved, not the newest in the
    directory: the run's own step 16 stays, and so do the other run's 20 and 30, which
    the start-up warning names."""
    branch, _ = branched_run
    assert sorted(p.name for p in (branch / "ckpt").iterdir()) == [f"step_{s:08d}" for s in (16, 20, 30)]
    log = (branch / "train.log").read_text()
    assert [Path(p).name for p in re.findall(r"saved (\S+)", log)] == [f"step_{s:08d}" for s in (12, 15, 16)]
    assert re.search(r"WARNING .* past the starting step 10, from another run: step_00000020, step_00000030\..*"
                     r"resume='latest' would pick step_00000030", log), log


def test_resume_drops_metrics_past_the_resumed_step(full_run, branched_run):
    """The metrics file of the resumed run keeps the records up to step 10 (the full run's)
    and then holds this run's, each step once."""
    _, records = full_run
    _, resumed = branched_run
    before = [r for r in records if r["step"] <= CKPT_EVERY]
    assert resumed[:len(before)] == before
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, 17))
    assert [r["step"] for r in resumed if "val_loss" in r] == [10, 16]


@pytest.mark.parametrize("fmt", ["dcp", "native"])
def test_resume_takes_optimizer_settings_from_the_config(train_modules, tmp_path, caplog, fmt):
    """A resume with other AdamW settings uses them (and says which differ), while the
    per-parameter state comes from the checkpoint, in either format; a checkpoint's
    ``fused`` flag (here as if saved on a GPU) does not carry over either. A group of one."""
    checkpoint, config, _ = train_modules
    import torch.distributed as dist

    from ep_moe.train import model, trainer

    def build(*argv):
        job = config.parse_args(["--set", "model.n_layers=1", *argv])
        torch.manual_seed(0)
        net = model.MoETransformer(job.model, job.moe_config(), None)
        return job, net, trainer.build_optimizer(net, job.training, torch.device("cpu"))

    layout = checkpoint.Layout(rank=0, world_size=1, ep_rank=0, ep_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job, net, optimizer = build()
        for _ in range(3):
            for p in net.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
        for group in optimizer.param_groups:
            group["fused"] = True
        checkpoint.save_checkpoint(tmp_path, 3, layout, net, optimizer, {"step": 3, "data": {"step": 3}},
                                   {"config": job.to_dict()}, keep=0, format=fmt)
        job, net, optimizer = build("--set", "training.weight_decay=0.0", "--set", "training.betas=[0.8, 0.99]")
        with caplog.at_level(logging.WARNING, logger=checkpoint.logger.name):
            extra = checkpoint.load_checkpoint(tmp_path / "step_00000003", layout, net, optimizer, job.to_dict())
    finally:
        dist.destroy_process_group()
    assert extra["step"] == 3
    groups = [(g["weight_decay"], g["betas"], g["fused"]) for g in optimizer.param_groups]
    assert groups == [(0.0, (0.8, 0.99), False)] * 2
    assert len(optimizer.state) == len(list(net.parameters()))
    assert {int(state["step"]) for state in optimizer.state.values()} == {3}
    assert "betas=(0.9, 0.95) -> (0.8, 0.99), weight_decay=0.1 -> 0.0" in caplog.text


def test_short_validation_split(tmp_path):
    """A file whose validation tail is shorter than one sequence: the error names the split
    and data.val_fraction; with evaluation off the split is not needed and training runs."""
    corpus = tmp_path / "small.txt"
    corpus.write_bytes(b"count 1 2 3\n" * 1000)  # 12,000 bytes: 60 held out at 0.5%
    args = ["--steps", "2", "--data", str(corpus), "--set", "data.val_fraction=0.005"]
    proc = subprocess.run(_train_cmd(tmp_path, *args), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert re.search(r"train.py: error: the validation split \(data.val_fraction=0.005 held out\) has 60 tokens.*"
                     r"raise data.val_fraction", proc.stderr), proc.stderr[-3000:]
    assert proc.stderr.count("train.py: error:") == 1, "printed by rank 0 only"
    records = _train(tmp_path, *args, "--set", "logging.eval_interval=0")
    assert [r["step"] for r in records] == [1, 2]


# --- in-process checks of the trainer's modules ---------------------------------------------

@pytest.fixture
def train_modules():
    from ep_moe.train import checkpoint, config, data

    return checkpoint, config, data


def test_config_overrides(train_modules):
    _, config, _ = train_modules
    job = config.parse_args(["--set", "moe.num_experts=16", "--set", "training.lr=1e-3", "--steps", "7",
                             "--data", "corpus.txt", "--set", "training.betas=[0.8, 0.9]"])
    assert job.moe_config().num_experts == 16 and job.moe_config().hidden_size == job.model.dim
    assert (job.training.lr, job.training.steps, job.training.betas) == (1e-3, 7, (0.8, 0.9))
    assert job.data.path == "corpus.txt"
    with pytest.raises(ValueError, match=r"^--set model.n_layer=2: unknown key model.n_layer; did you mean "
                                         r"model.n_layers\? \[model\] takes n_layers, "):
        config.parse_args(["--set", "model.n_layer=2"])
    with pytest.raises(ValueError, match="training.steps=0 must be positive"):
        config.parse_args(["--steps", "0"])
    with pytest.raises(ValueError, match="top_k"):
        config.parse_args(["--set", "moe.top_k=9"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OptionalField:
    limit: Optional[int] = None


def test_config_values_are_type_checked(train_modules):
    """A value of the wrong type fails in parsing, naming the field and the type it takes
    (a value of the right type outside a field's choices is a wrong value); ints pass for
    floats (converted), TOML arrays become tuples."""
    _, config, _ = train_modules
    wrong = {"training.steps=1e1": "an integer", 'training.lr="3e-3"': "a number",
             "training.betas=[0.9]": "a list of 2 values", "training.betas=[0.9, '1']": "a list of 2 values",
             "checkpoint.resume=true": "a string", "logging.sample_prompt=42": "a string",
             "training.batch_size=4.0": "an integer", "training.steps=true": "an integer",
             "model.qk_norm=1": "true or false", "training.device=1": "one of 'auto', 'cpu', 'cuda'"}
    for assignment, expected in wrong.items():
        message = rf"{re.escape(assignment.partition('=')[0])}=.* has the wrong type: expected {re.escape(expected)}"
        with pytest.raises(ValueError, match=message):
            config.parse_args(["--set", assignment])
    with pytest.raises(ValueError, match=r"training.device='gpu' is not an allowed value: use one of 'auto', 'cpu'"):
        config.parse_args(["--set", "training.device='gpu'"])
    job = config.parse_args(["--set", "training.lr=1", "--set", "training.betas=[1, 0.99]"])
    assert type(job.training.lr) is float and job.training.betas == (1.0, 0.99)
    assert all(type(b) is float for b in job.training.betas)
    assert config._section("x", _OptionalField, {"limit": None}, "test").limit is None
    with pytest.raises(ValueError, match=r"x.limit=1.5 .*expected an integer or none"):
        config._section("x", _OptionalField, {"limit": 1.5}, "test")


def test_every_preset_parses(train_modules, monkeypatch, tmp_path):
    """Every preset of ep_moe/configs/train/ parses by name (the GPU presets' host memory is
    not this host's business: the check is off here), and a file of the user's by path, also
    one named like a preset."""
    from ep_moe.configs import preset_dir, preset_names

    _, config, _ = train_modules
    monkeypatch.setattr(config, "host_memory_bytes", lambda: None)
    presets = preset_names("train")
    assert {"tiny", "gpu", "hf"} <= set(presets)
    for name in presets:
        hf = ["--hf-model", "some/folder", "--data", "corpus.txt"] if name == "hf" else []
        config.parse_args(["--config", name, *hf])
    with pytest.raises(ValueError, match=r"model.hf is empty: pass the Hugging Face model folder with --hf-model"):
        config.parse_args(["--config", "hf"])
    mine = tmp_path / "tiny"
    mine.write_text((preset_dir("train") / "tiny.toml").read_text().replace("steps = 200", "steps = 7"))
    monkeypatch.chdir(tmp_path)
    assert config.parse_args(["--config", "tiny"]).training.steps == 7, "a file by that name comes first"
    assert config.parse_args(["--config", str(preset_dir("train") / "gpu.toml")]).model.dim > 128


def test_latest_checkpoint_skips_partial_ones(train_modules, tmp_path):
    """Only directories holding the COMPLETE marker are candidates, newest first; a
    ``.partial`` without it, or a step directory without it (a save or a deletion was
    interrupted), is passed over; a path must be complete."""
    checkpoint, _, _ = train_modules
    assert checkpoint.resume_candidates("latest", tmp_path / "missing") == []
    for name in ("step_00000010", "step_00000020", "step_00000030.partial", "step_00000040"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text("{}")
    for name in ("step_00000010", "step_00000020"):
        (tmp_path / name / checkpoint.MARKER).write_text("")
    assert checkpoint.resume_candidates("latest", tmp_path) == [tmp_path / "step_00000020", tmp_path / "step_00000010"]
    assert checkpoint.resume_candidates("", tmp_path) == []
    with pytest.raises(checkpoint.CheckpointError, match=r"not a complete checkpoint \(no COMPLETE marker.*"
                                                         r"--resume .*step_00000020"):
        checkpoint.resume_candidates(str(tmp_path / "step_00000040"), tmp_path)


def test_batches_are_a_function_of_step_and_rank(train_modules, tmp_path):
    _, _, data = train_modules
    corpus = data.synthetic_corpus(1 << 14, seed=3)
    assert corpus.equal(data.synthetic_corpus(1 << 14, seed=3))
    ranks = [data.TokenBatches(corpus, seq_len=32, batch_size=4, dp_rank=r, dp_size=2, seed=0) for r in (0, 1)]
    x0, y0 = ranks[0].batch(5)
    assert x0.shape == (4, 32) and x0[:, 1:].equal(y0[:, :-1])
    assert not x0.equal(ranks[1].batch(5)[0]), "ranks read different windows"
    resumed = data.TokenBatches(corpus, seq_len=32, batch_size=4, dp_rank=0, dp_size=2, seed=0)
    resumed.load_state_dict({"step": 5})
    assert next(resumed)[0].equal(x0)
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(range(10)) * 2)  # ten uint16 ids 0x0100, 0x0302, ...
    ids, vocab = data.load_tokens(str(tokens))
    assert ids.numel() == 10 and vocab == 0x0908 + 1


def test_module_and_console_entry_points(tmp_path):
    """``python -m ep_moe.train`` trains from outside the checkout (one process: a group of
    one); ``ep-moe train`` runs the same main: its help, and a bad ``--config`` in one line
    with exit status 2."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ep_moe.train", "--steps", "2", "--set", "logging.log_interval=1",
           "--set", "logging.progress_bar=false", "--set", "logging.sample_prompt=''",
           "--checkpoint-dir", str(out / "ckpt"), "--metrics-file", str(out / "metrics.jsonl")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    if shutil.which("ep-moe", path=str(BIN)) is None:
        pytest.skip("the ep-moe console script is not installed (pip install -e .)")
    help_text = subprocess.run(["ep-moe", "train", "--help"], cwd=tmp_path, env=_env(), capture_output=True,
                               text=True, timeout=120).stdout
    assert help_text.startswith("usage: ep-moe train") and "--config" in help_text
    bad = subprocess.run(["ep-moe", "train", "--config", "no-such-preset"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--config no-such-preset: no such file and no preset of that name; presets: " in bad.stderr


MICRO_MODEL = {"name": "micro", "num_experts": 2, "hidden_size": 16, "intermediate_size": 16,
               "top_k": 1, "gated": False}
_SOURCE = re.compile(r"\s(tuned|cache|shipped|heuristic|fallback)\s")


def test_warmup_second_run_is_a_cache_hit(tmp_path):
    """First run tunes (in the Triton interpreter: a micro shape keeps it short), second
    run serves every config from the cache and writes nothing."""
    if shutil.which("ep-moe", path=str(BIN)) is None:
        pytest.skip("the ep-moe console script is not installed (pip install -e .)")
    model = tmp_path / "micro.json"
    model.write_text(json.dumps(MICRO_MODEL))
    cache = tmp_path / "cache"
    env = _env(EP_MOE_CACHE_DIR=str(cache), TRITON_INTERPRET="1", NPROC="1")
    cmd = ["launch/warmup_node.sh", "--model", str(model), "--ep-size", "1", "--tokens", "8",
           "--dtype", "float32", "--no-progress"]

    first = _run(cmd, env, timeout=300)
    assert set(_SOURCE.findall(first.stdout)) == {"tuned"}, first.stdout
    files = {p: p.stat().st_mtime_ns for p in cache.glob("*.json")}
    assert len(files) == 2, "one cache file per projection (gate_up, down)"

    start = time.monotonic()
    second = _run(cmd, env, timeout=120)
    assert time.monotonic() - start < 60
    assert set(_SOURCE.findall(second.stdout)) == {"cache"}, second.stdout
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*.json")} == files
