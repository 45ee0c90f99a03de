"""The trainer on Hugging Face models (``ep_moe.train --hf-model DIR --data FILES``), on CPU.

A tiny random Qwen3-MoE saved with ``save_pretrained`` beside a BPE tokenizer trained here
(no network), fine-tuned on jsonl text tokenized into the trainer's cache:

- in-process: step 1's loss and router loss equal what plain transformers computes for the
  same batch; the exported HF folder loads in plain transformers with the trained model's
  logits; pure-bf16 parameters train; every bad input stops the run before step 1 with a
  message naming it.
- ``torchrun --nproc-per-node 2`` (gloo): EP=2 logs the losses and gradient norms of EP=1
  and exports the same weights; ``--resume`` continues exactly, also at another EP size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hf_models import tiny_model  # noqa: E402
from text_data import sample_documents, train_tokenizer, write_jsonl  # noqa: E402

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
VOCAB = 320
"""The tiny model's vocabulary: the tokenizer's ids (300) and room."""
STEPS = 4
COMMON = ["--steps", str(STEPS), "--set", "logging.log_interval=1", "--set", "logging.eval_interval=2",
          "--set", "logging.progress_bar=false", "--set", "training.batch_size=2", "--set", "training.seq_len=16",
          "--set", "training.lr=1e-2", "--set", "training.warmup_steps=1", "--set", "checkpoint.interval=2",
          "--set", "checkpoint.keep=0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2, router loss on) with its tokenizer, as
    ``save_pretrained`` writes them."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model = tiny_model("qwen3_moe", vocab=VOCAB, std=0.05)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.01
    model.save_pretrained(folder)
    train_tokenizer(folder, sample_documents(60, seed=1))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A jsonl file of documents, long enough for a few hundred windows of 16 tokens."""
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    write_jsonl(path, sample_documents(200, seed=2))
    return path


@pytest.fixture
def train_modules():
    from ep_moe.train import config, trainer

    return config, trainer


def _in_process(train_modules, args: list[str]):
    """A Trainer of this process alone (a group of one, gloo)."""
    config, trainer = train_modules
    return trainer.Trainer(config.parse_args(args))


def _close(trainer_module, trainer) -> None:
    trainer.close()
    trainer_module.destroy_distributed()


def _train_two_steps(train_modules, folder: Path, corpus: Path, tmp_path: Path):
    """Fine-tune the HF folder two steps in this process (checkpoints and the export under
    ``tmp_path / "ckpt"``, metrics in ``tmp_path / "metrics.jsonl"``); step 1's batch
    (inputs, targets) and the trained model's logits on its inputs."""
    _, trainer_module = train_modules
    trainer = _in_process(train_modules, ["--hf-model", str(folder), "--data", str(corpus), *COMMON, "--steps", "2",
                                           "--checkpoint-dir", str(tmp_path / "ckpt"),
                                           "--metrics-file", str(tmp_path / "metrics.jsonl")])
    try:
        inputs, targets = trainer.batches.batch(0)
        trainer.train()
        return inputs, targets, trainer.model(inputs).detach()
    finally:
        _close(trainer_module, trainer)


def test_step1_loss_matches_transformers_and_export_round_trips(train_modules, hf_dir, corpus, tmp_path):
    """Fine-tuning the saved model: step 1's loss and router loss are plain transformers'
    (eager experts) on the same batch; after two steps the exported folder loads in plain
    transformers, tokenizer included, with the trained model's logits."""
    metrics = tmp_path / "metrics.jsonl"
    inputs, targets, trained_logits = _train_two_steps(train_modules, hf_dir, corpus, tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    out = plain(input_ids=inputs, output_router_logits=True)
    record = json.loads(metrics.read_text().splitlines()[0])
    assert record["step"] == 1
    assert record["loss"] == pytest.approx(float(F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())),
                                           rel=1e-5)
    assert record["aux_loss"] == pytest.approx(0.01 * float(out.aux_loss), rel=1e-5)
    exported = tmp_path / "ckpt" / "hf"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.config._experts_implementation != "ep_moe"
    torch.testing.assert_close(reloaded(input_ids=inputs).logits, trained_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(trained_logits, out.logits, atol=1e-3), "two steps at lr 1e-2 changed nothing"
    assert transformers.AutoTokenizer.from_pretrained(exported).eos_token is not None


def test_pure_bf16_parameters_train(train_modules, hf_dir, corpus, tmp_path):
    """``training.param_dtype='bfloat16'``: parameters and AdamW state in bf16, no autocast;
    the loss is finite and the weights move."""
    _, trainer_module = train_modules
    trainer = _in_process(train_modules, ["--hf-model", str(hf_dir), "--data", str(corpus), *COMMON, "--steps", "2",
                                           "--set", "training.dtype='bfloat16'",
                                           "--set", "training.param_dtype='bfloat16'",
                                           "--set", "checkpoint.interval=-1", "--export-hf", "",
                                           "--checkpoint-dir", str(tmp_path / "ckpt")])
    try:
        params = dict(trainer.model.named_parameters())
        assert {p.dtype for p in params.values()} == {torch.bfloat16}
        before = {n: p.detach().clone() for n, p in params.items()}
        trainer.train()
        moved = [n for n, p in params.items() if not torch.equal(p.detach(), before[n])]
        assert len(moved) > len(params) // 2
        state = trainer.optimizer.state[params["hf.model.embed_tokens.weight"]]
        assert state["exp_avg"].dtype == torch.bfloat16
    finally:
        _close(trainer_module, trainer)


# ---------------------------------------------------------------------------------------
# torchrun, two gloo ranks


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _torchrun(out: Path, hf_dir: Path, corpus: Path, *extra: str) -> list[dict]:
    """``torchrun --nproc-per-node 2 launch/train.py --hf-model ... --data ...`` (the checkout's
    entry point); its metrics."""
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--standalone", "launch/train.py", "--hf-model",
           str(hf_dir), "--data", str(corpus), *COMMON, "--checkpoint-dir", str(out / "ckpt"),
           "--metrics-file", str(out / "metrics.jsonl"), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (out / "train.log").write_text(proc.stdout)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _by_step(records: list[dict], field: str) -> dict[int, float]:
    return {r["step"]: r[field] for r in records if field in r}


@pytest.fixture(scope="module")
def ep2_run(hf_dir, corpus, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Four steps at EP=2 (each rank reads its 4 experts), checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ep2")
    return out, _torchrun(out, hf_dir, corpus, "--ep-size", "2")


def test_ep2_matches_ep1(ep2_run, hf_dir, corpus, tmp_path):
    """EP=2 and EP=1 (two data-parallel ranks holding all experts) log the same losses,
    router losses, gradient norms and validation losses, and export the same weights."""
    out, records = ep2_run
    ep1 = _torchrun(tmp_path, hf_dir, corpus, "--ep-size", "1")
    for field in ("loss", "aux_loss", "grad_norm", "val_loss"):
        assert _by_step(records, field) == pytest.approx(_by_step(ep1, field), rel=1e-5, abs=1e-6), field
    assert sorted(_by_step(records, "loss")) == list(range(1, STEPS + 1))
    log = (out / "train.log").read_text()
    assert "exported the model at step 4" in log
    ep2_weights = transformers.AutoModelForCausalLM.from_pretrained(out / "ckpt" / "hf").state_dict()
    ep1_weights = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf").state_dict()
    assert ep2_weights.keys() == ep1_weights.keys()
    # AdamW divides each gradient by its own RMS: the summation order's rounding of a small
    # gradient (a rare token's embedding row) can move its weight by ~1e-3 of the lr (1e-2)
    for name, value in ep2_weights.items():
        torch.testing.assert_close(value, ep1_weights[name], rtol=1e-4, atol=2e-5, msg=name)


def test_resume_is_exact(ep2_run, hf_dir, corpus, tmp_path):
    """``--resume`` of the step-2 checkpoint continues with exactly the uninterrupted run's
    losses and gradient norms (the data position is the step); at EP=1 it reshards the
    experts and continues to rounding."""
    out, records = ep2_run
    step2 = out / "ckpt" / "step_00000002"
    resumed = _torchrun(tmp_path / "same", hf_dir, corpus, "--ep-size", "2", "--resume", str(step2))
    for field in ("loss", "aux_loss", "grad_norm", "val_loss"):
        want = {s: v for s, v in _by_step(records, field).items() if s > 2}
        assert _by_step(resumed, field) == want, field
    resharded = _torchrun(tmp_path / "ep1", hf_dir, corpus, "--ep-size", "1", "--resume", str(step2))
    want = {s: v for s, v in _by_step(records, "loss").items() if s > 2}
    assert _by_step(resharded, "loss") == pytest.approx(want, rel=1e-5)


def test_fsdp_run_matches_replicated(ep2_run, hf_dir, corpus, tmp_path):
    """``parallel.fsdp=true`` at EP=2 (experts sharded over their replicas, the rest over both
    ranks) logs the replicated run's losses and exports its weights (gathered from FSDP's
    shards, then over the EP group)."""
    out, records = ep2_run
    fsdp = _torchrun(tmp_path, hf_dir, corpus, "--ep-size", "2", "--set", "parallel.fsdp=true")
    assert _by_step(fsdp, "loss") == pytest.approx(_by_step(records, "loss"), rel=1e-5)
    want = transformers.AutoModelForCausalLM.from_pretrained(out / "ckpt" / "hf").state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf").state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-5, msg=name)


# ---------------------------------------------------------------------------------------
# Bad input: one line naming it, before any process group


def _fails(train_modules, args: list[str], error: str, match: str) -> None:
    """The Trainer raises ``error`` (of ep_moe/train/errors.py) matching ``match``; before the
    process group exists, except for a checkpoint (read once the ranks are up)."""
    config, trainer_module = train_modules
    from ep_moe.train import errors

    try:
        with pytest.raises(getattr(errors, error), match=match):
            trainer_module.Trainer(config.parse_args(args))
        assert error == "CheckpointError" or not torch.distributed.is_initialized()
    finally:
        trainer_module.destroy_distributed()


def test_model_folder_errors(train_modules, hf_dir, corpus, tmp_path):
    """A folder without config.json, a family without MoE layers, weights that are not
    safetensors, a folder without a tokenizer for text data."""
    data = ["--data", str(corpus)]
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(train_modules, ["--hf-model", str(empty), *data], "ConfigError", r"model.hf=.*empty' has no config.json")
    _fails(train_modules, ["--hf-model", str(tmp_path / "nowhere"), *data], "ConfigError", r"is not a folder")
    dense = tmp_path / "dense"
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    transformers.Qwen3ForCausalLM(config).save_pretrained(dense)
    _fails(train_modules, ["--hf-model", str(dense), *data], "ConfigError", r"'qwen3' model without MoE layers")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"0")
    _fails(train_modules, ["--hf-model", str(pickled), *data], "ConfigError",
           r"holds weights as pytorch_model.bin, not safetensors")
    untokenized = tmp_path / "no_tokenizer"
    tiny_model("qwen3_moe", vocab=VOCAB).save_pretrained(untokenized)
    _fails(train_modules, ["--hf-model", str(untokenized), *data], "DataError", r"holds no tokenizer files")


def test_refused_experts_and_ep_size(train_modules, hf_dir, corpus, monkeypatch):
    """Experts ep_moe cannot run exactly, and an EP size that does not divide the experts."""
    import ep_moe.integrations.transformers as ep_hf

    config, trainer_module = train_modules
    job = config.parse_args(["--hf-model", str(hf_dir), "--data", str(corpus), "--ep-size", "3"])
    with pytest.raises(ValueError, match=r"parallel.ep_size=3 must divide the world size \(3\) and the model's 8 "
                                         r"experts \(model.hf\)"):
        trainer_module.check_parallel(job, 3, 8)
    monkeypatch.setattr(ep_hf, "unsupported_reason", lambda module: "a post-expert norm")
    _fails(train_modules, ["--hf-model", str(hf_dir), "--data", str(corpus)], "ConfigError",
           r"ep_moe cannot run the experts of this 'qwen3_moe' model \(model.layers.0.mlp.experts: a post-expert norm")


def test_data_errors(train_modules, hf_dir, tmp_path):
    """Token ids past the model's vocabulary; an empty data file."""
    wide = tmp_path / "wide.u32"
    torch.full((4096,), VOCAB + 5, dtype=torch.int32).numpy().tofile(wide)
    _fails(train_modules, ["--hf-model", str(hf_dir), "--data", str(wide)], "DataError",
           rf"has token ids up to {VOCAB + 5}, past the vocabulary of model.hf=.* \({VOCAB} ids\); tokenize the data "
           "with this model's tokenizer")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _fails(train_modules, ["--hf-model", str(hf_dir), "--data", str(empty)], "DataError", r"empty")


def test_config_errors(train_modules, hf_dir, corpus):
    """The built-in model's keys, [moe] shape keys, no data, the native checkpoint format."""
    config, _ = train_modules
    hf = ["--hf-model", str(hf_dir), "--data", str(corpus)]
    cases = {("--set", "model.dim=64"): r"--set model.dim=64: model.dim describe the built-in model, but model.hf=",
             ("--set", "moe.num_experts=4"): r"moe.num_experts describe the built-in model's MoE layers.*\[moe\] "
                                             r"takes dispatch, backend, all_gather_row_bound",
             ("--set", "moe.dispatch='sideways'"): r"moe.dispatch='sideways' is not an allowed value",
             ("--set", "checkpoint.format='native'"): r"checkpoint.format='native' saves the built-in model's"}
    for extra, match in cases.items():
        with pytest.raises(ValueError, match=match):
            config.parse_args([*hf, *extra])
    with pytest.raises(ValueError, match=r"needs data in the model's tokens: pass --data"):
        config.parse_args(["--hf-model", str(hf_dir)])


def test_checkpoint_of_another_model(train_modules, hf_dir, corpus, tmp_path):
    """Resuming a checkpoint of another HF model names the config.json values that differ."""
    _, trainer_module = train_modules
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--export-hf", ""]
    trainer = _in_process(train_modules, ["--hf-model", str(hf_dir), "--data", str(corpus), *COMMON, "--steps", "1",
                                           *ckpt])
    try:
        trainer.train()
    finally:
        _close(trainer_module, trainer)
    other = tmp_path / "wider"
    tiny_model("qwen3_moe", vocab=VOCAB, hidden=48).save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((hf_dir / name).read_bytes())
    step1 = str(tmp_path / "ckpt" / "step_00000001")
    _fails(train_modules, ["--hf-model", str(other), "--data", str(corpus), *COMMON, *ckpt, "--resume", step1],
           "CheckpointError", r"model.hf_config.hidden_size=32 in the checkpoint, 48 in this run")


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral", "deepseek_v3"])
def test_other_families_train_and_export(train_modules, family, corpus, tmp_path):
    """GPT-OSS (transposed, interleaved experts with biases and the clamped gate), Mixtral
    and DeepSeek-V3 (sigmoid group routing, a shared expert, a dense first layer) fine-tune
    in the trainer, and their exports load in plain transformers with the trained logits."""
    folder = tmp_path / family
    tiny_model(family, vocab=VOCAB, std=0.05, dense_layers=1 if family == "deepseek_v3" else 0).save_pretrained(folder)
    train_tokenizer(folder, sample_documents(60, seed=1))
    metrics = tmp_path / "metrics.jsonl"
    inputs, _, trained_logits = _train_two_steps(train_modules, folder, corpus, tmp_path)
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf")
    torch.testing.assert_close(reloaded(input_ids=inputs).logits, trained_logits, rtol=1e-5, atol=1e-5)
