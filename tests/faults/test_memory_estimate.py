"""Issue 46, part 2: a config whose memory cannot fit the device or the host is refused
before anything is allocated, naming the fields.

The trainer checks what one rank needs (``ep_moe/train/config.py:memory_needs``: the
parameters, gradients, AdamW state and logits of each phase of the run, a floor of its peak)
against the host's physical memory and the total memory of the GPU it resolved, once it
knows the device and, for an HF model, its parameters (counted on the meta device), before
the process group starts and before the model is built. The device and the host are
monkeypatched small here (``config.device_memory_bytes``, ``config.host_memory_bytes``, and
``trainer.resolve_device`` for a GPU on this CPU). Then the floor itself: on the CPU, after
one step of the tiny built-in model and of a tiny HF model, the parameters, gradients and
AdamW state really held are at least what the estimate counts, the parameters exactly.

Everything runs on the CPU in seconds.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "moe.num_experts=4", "--set", "moe.intermediate_size=32", "--set", "moe.top_k=2",
        "--set", "training.batch_size=2", "--set", "training.seq_len=16", "--set", "training.steps=2",
        "--set", "logging.eval_interval=0", "--set", "logging.progress_bar=false",
        "--set", "logging.sample_prompt=''", "--set", "data.synthetic_bytes=8192", "--set", "checkpoint.interval=-1"]
"""The tiny built-in model (the device left to ``training.device='auto'``: the CPU here)."""
LARGE_EXPERTS = ["--set", "model.dim=256", "--set", "moe.num_experts=16", "--set", "moe.intermediate_size=512",
                 "--set", "model.n_heads=4"]
"""Experts of 16 x 2 x 256 x 512 x ... parameters: most of the model."""
HF_VOCAB = 64


def _gpu(train, monkeypatch, device_bytes: int) -> None:
    """The trainer resolves ``cuda:0``, whose total memory is ``device_bytes``."""
    monkeypatch.setattr(train.trainer, "resolve_device", lambda job: torch.device("cuda", 0))
    monkeypatch.setattr(train.config, "device_memory_bytes", lambda device: device_bytes)


def _refused(train, job, match: str) -> str:
    """The trainer refuses ``job`` with a ConfigError matching ``match``, before any
    process group (so before the model is built); returns the message."""
    with pytest.raises(train.errors.ConfigError, match=match) as err:
        train.trainer.Trainer(job)
    assert not dist.is_initialized(), "refused after the process group started"
    return str(err.value)


def _device_need(train, job, world_size: int = 1, model=None) -> int:
    return train.config.estimate_memory_bytes(job, world_size, model, on_host=False)


# --- the built-in model -------------------------------------------------------------------

def test_builtin_past_the_device_is_refused_before_the_process_group(train, monkeypatch):
    """Logits of 64 x 256 x 256 entries (fp32 log-probabilities and their gradient: 32 MiB)
    on a 16 MiB GPU: refused, naming the batch (set on the command line: first), the
    sequence and the vocabulary, and the fix."""
    job = train.config.parse_args([*TINY, "--set", "training.batch_size=64", "--set", "training.seq_len=256"])
    _gpu(train, monkeypatch, 16 * 2**20)
    message = _refused(train, job, r"memory on cuda:0")
    assert message.startswith("--set training.batch_size=64: the training state of one rank at the loss ("), message
    assert re.search(r"logits 32.0 MiB, rotary tables [\d.]+ MiB\) needs about [\d.]+ MiB of memory on cuda:0, more than cuda:0's 16.0 MiB "
                     r"of total memory; the logits \(training.batch_size=64, training.seq_len=256, "
                     r"model.vocab_size=256\) take 9\d% of it: lower training.batch_size or training.seq_len$",
                     message), message


def test_builtin_experts_past_the_device_name_ep_and_fsdp(train, monkeypatch):
    job = train.config.parse_args([*TINY, *LARGE_EXPERTS])
    need = _device_need(train, job)
    _gpu(train, monkeypatch, need // 2)
    message = _refused(train, job, r"memory on cuda:0")
    assert message.startswith("--set moe.num_experts=16: the training state of one rank at the optimizer step"), message
    assert ("the experts (moe.num_experts=16, moe.intermediate_size=512, model.dim=256, model.n_layers=1, "
            "parallel.ep_size=0 (the world size, 1), parallel.fsdp=false)") in message, message
    for fix in ("split the experts over more ranks (parallel.ep_size, the world size)",
                "shard them over the ranks with parallel.fsdp=true", "training.param_dtype='bfloat16'"):
        assert fix in message, message


def test_builtin_fits_with_enough_memory_more_ep_ranks_or_fsdp(train):
    """The device's total memory at the floor passes and a byte less is refused; a device
    of half the single rank's need takes the run over 4 EP ranks, or FSDP over 4 ranks at
    EP=1, not 4 replicated ranks at EP=1."""
    config = train.config
    job = config.parse_args([*TINY, *LARGE_EXPERTS])
    need = _device_need(train, job)
    gpu = dict(on_host=False, device="cuda:0", host_bytes=2**50)
    config.check_memory(job, device_bytes=need, **gpu)
    with pytest.raises(config.ConfigError, match=r"cuda:0's"):
        config.check_memory(job, device_bytes=need - 1, **gpu)
    half = need // 2
    config.check_memory(job, world_size=4, device_bytes=half, **gpu)  # ep_size 0: EP=4
    ep1 = config.parse_args([*TINY, *LARGE_EXPERTS, "--set", "parallel.ep_size=1"])
    with pytest.raises(config.ConfigError, match=r"parallel.ep_size=1, parallel.fsdp=false\)"):
        config.check_memory(ep1, world_size=4, device_bytes=half, **gpu)
    fsdp = config.parse_args([*TINY, *LARGE_EXPERTS, "--set", "parallel.ep_size=1", "--set", "parallel.fsdp=true"])
    config.check_memory(fsdp, world_size=4, device_bytes=half, **gpu)
    # FSDP shards what trains, not what is built: the unsharded parameters reach the device first
    build = config.memory_needs(fsdp, 4, on_host=False)[0]
    assert build.phase == config.BUILD and build.parts["parameters"] == config.memory_estimate(ep1, 4)["parameters"]
    with pytest.raises(config.ConfigError, match=r"building the model, the parameters of one rank \(unsharded, "
                                                 r"before FSDP shards them\) need"):
        config.check_memory(fsdp, world_size=4, device_bytes=build.total - 1, **gpu)
    # no device known, or the CPU: the device is not checked
    config.check_memory(job, on_host=False, host_bytes=2**50)
    config.check_memory(job, on_host=True, host_bytes=2**50, device="cpu", device_bytes=1)


def test_fsdp_leaves_each_rank_a_world_share_of_the_experts(train):
    """Under FSDP a rank's E / ep_size experts are sharded over their world / ep_size
    replicas (``apply_fsdp``'s ``edp``), so each rank holds 1 / world of every expert,
    whatever the EP size; the dense weights are sharded over the world."""
    config = train.config
    base = [*TINY, *LARGE_EXPERTS, "--set", "parallel.fsdp=true"]
    shares = {ep: config.memory_estimate(config.parse_args([*base, "--set", f"parallel.ep_size={ep}"]), 4)
              for ep in (1, 2, 4)}
    assert shares[1] == shares[2] == shares[4]
    whole = config.memory_estimate(config.parse_args([*TINY, *LARGE_EXPERTS]), 1)["parameters"]
    assert shares[1]["parameters"] == pytest.approx(whole / 4, rel=1e-3)


def test_device_memory_is_the_total_of_a_cuda_device(train, monkeypatch):
    config = train.config
    assert config.device_memory_bytes(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert config.device_memory_bytes("cuda:0") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = type("Props", (), {"total_memory": 141 * 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert config.device_memory_bytes("cuda:1") == 141 * 2**30


def _one_step(trainer) -> int:
    """One training step's forward, backward and optimizer step (the gradients kept);
    the bytes of the parameters, gradients and optimizer state then held."""
    inputs_BL, targets_BL = next(trainer.batches)
    ce, aux = trainer._loss(inputs_BL, targets_BL)
    (ce + aux).backward()
    trainer.optimizer.step()
    params = list(trainer.model.parameters())
    assert all(p.grad is not None for p in params)
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(p.nbytes + p.grad.nbytes for p in params) + sum(t.nbytes for t in state)


def _saved_logits(trainer, vocab: int) -> list[torch.dtype]:
    """The dtypes of the [batch x seq_len, vocab] tensors the loss saves for the backward."""
    inputs_BL, targets_BL = trainer.batches.batch(0)
    found = []

    def pack(t):
        if t.dim() == 2 and t.shape == (inputs_BL.numel(), vocab):
            found.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer._loss(inputs_BL, targets_BL)
    return found


def _check_floor(train, monkeypatch, args: list[str], model_size=None) -> None:
    """The run of ``args`` on a host of exactly its floor starts (the floor is what it is
    checked against), and after one step holds at least the floor's parameters, gradients
    and AdamW state, the parameters exactly; the loss keeps fp32 log-probabilities."""
    config = train.config
    job = config.parse_args(args)
    need = config.estimate_memory_bytes(job, 1, model_size)
    monkeypatch.setattr(config, "host_memory_bytes", lambda: need)
    trainer = train.trainer.Trainer(job)
    try:
        size = trainer.hf_spec.size if trainer.hf_spec else None
        assert size == model_size or model_size is None
        parts = config.memory_estimate(job, 1, size)
        held = _one_step(trainer)
        params = sum(p.nbytes for p in trainer.model.parameters())
        assert parts["parameters"] == params
        assert parts["parameters"] + parts["gradients"] + parts["optimizer"] <= held
        # AdamW's step counts are all it holds beyond the floor
        assert held - (parts["parameters"] + parts["gradients"] + parts["optimizer"]) <= 8 * len(list(
            trainer.model.parameters()))
        if size is None:
            rope = sum(b.nbytes for name, b in trainer.model.named_buffers() if name.startswith("rope_"))
            assert parts["rotary tables"] == rope
        vocab = size.vocab_size if size else job.model.vocab_size
        assert torch.float32 in _saved_logits(trainer, vocab)
        assert parts["logits"] == 2 * 4 * job.training.batch_size * job.training.seq_len * vocab
    finally:
        trainer.close()
        train.trainer.destroy_distributed()
    monkeypatch.setattr(config, "host_memory_bytes", lambda: need - 1)
    with pytest.raises(config.ConfigError, match=r"host memory"):
        train.trainer.Trainer(job)


@pytest.mark.parametrize("dtype", [[], ["--set", "training.dtype='bfloat16'", "--set",
                                        "training.param_dtype='bfloat16'"]], ids=["fp32", "pure_bf16"])
def test_builtin_estimate_is_a_floor(train, monkeypatch, dtype):
    _check_floor(train, monkeypatch, [*TINY, *dtype])


# --- an HF model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Qwen3-MoE folder with weights, the same without (config.json only), and a
    token file of its ids."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from hf_models import tiny_model
    finally:
        sys.path.remove(str(REPO / "tests"))
    root = tmp_path_factory.mktemp("hf_memory")
    model = tiny_model("qwen3_moe", vocab=HF_VOCAB)
    model.save_pretrained(root / "weights")
    model.config.save_pretrained(root / "config_only")
    tokens = root / "tokens.bin"
    ids = torch.randint(0, HF_VOCAB, (8192,), generator=torch.Generator().manual_seed(0))
    ids.numpy().astype("uint16").tofile(tokens)  # .bin: uint16 ids
    return root


def _hf_args(hf, tmp_path, folder: str = "weights") -> list[str]:
    return ["--hf-model", str(hf / folder), "--data", str(hf / "tokens.bin"), "--steps", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--set", "checkpoint.interval=-1",
            "--set", "checkpoint.export_hf=''", "--set", "logging.eval_interval=0",
            "--set", "logging.progress_bar=false", "--set", "training.batch_size=2", "--set", "training.seq_len=16"]


def test_hf_model_is_counted_on_the_meta_device(train, hf):
    from ep_moe.train.hf_model import inspect_hf_model
    from transformers import AutoModelForCausalLM

    import ep_moe.integrations.transformers as ep_hf

    real = AutoModelForCausalLM.from_pretrained(hf / "weights")
    experts = sum(p.numel() for _, m in ep_hf.experts_modules(real) for p in m.parameters())
    size = inspect_hf_model(str(hf / "weights")).size
    assert (size.experts, size.dense, size.vocab_size) == (experts, real.num_parameters() - experts, HF_VOCAB)
    assert not size.built_whole and inspect_hf_model(str(hf / "config_only")).size.built_whole


def test_hf_past_the_host_is_refused_before_the_process_group(train, hf, tmp_path, monkeypatch):
    """On the CPU the host holds the whole training state: the experts are most of it."""
    job = train.config.parse_args(_hf_args(hf, tmp_path))
    monkeypatch.setattr(train.config, "host_memory_bytes", lambda: 2**18)
    message = _refused(train, job, r"host memory")
    assert message.startswith(f"--hf-model {hf / 'weights'}: the training state of one rank at the optimizer step"), \
        message
    assert (f"more than this host's 0.25 MiB of physical memory; the experts (model.hf={hf / 'weights'}, "
            "parallel.ep_size=0 (the world size, 1), parallel.fsdp=false) take") in message, message
    assert "split the experts over more ranks (parallel.ep_size" in message and "parallel.fsdp=true" in message


def test_hf_past_the_device_is_refused_before_the_process_group(train, hf, tmp_path, monkeypatch):
    """On a GPU the HF model goes to the device as it is read: the host is not the limit,
    the device is; the logits of 64 x 64 x 64 entries are most of it."""
    job = train.config.parse_args([*_hf_args(hf, tmp_path), "--set", "training.batch_size=64",
                                   "--set", "training.seq_len=64"])
    monkeypatch.setattr(train.config, "host_memory_bytes", lambda: 1)
    _gpu(train, monkeypatch, 2**20)
    message = _refused(train, job, r"memory on cuda:0")
    assert message.startswith("--set training.batch_size=64: the training state of one rank at the loss"), message
    assert (f"the logits (training.batch_size=64, training.seq_len=64, model.hf={hf / 'weights'}) take"
            in message), message
    assert message.endswith("lower training.batch_size or training.seq_len"), message


def test_hf_fits_with_enough_memory_more_ep_ranks_or_fsdp(train, hf, tmp_path):
    from ep_moe.train.hf_model import inspect_hf_model

    config = train.config
    size = inspect_hf_model(str(hf / "weights")).size
    job = config.parse_args(_hf_args(hf, tmp_path))
    need = _device_need(train, job, 1, size)
    gpu = dict(on_host=False, device="cuda:0", host_bytes=1, model=size)  # nothing of it on the host
    config.check_memory(job, device_bytes=need, **gpu)
    with pytest.raises(config.ConfigError, match=r"the experts \(model.hf="):
        config.check_memory(job, device_bytes=need - 1, **gpu)
    ep8 = _device_need(train, job, 8, size)
    assert ep8 < need
    config.check_memory(job, world_size=8, device_bytes=ep8, **gpu)
    fsdp = config.parse_args([*_hf_args(hf, tmp_path), "--set", "parallel.fsdp=true", "--set", "parallel.ep_size=1"])
    replicated = config.parse_args([*_hf_args(hf, tmp_path), "--set", "parallel.ep_size=1"])
    sharded = _device_need(train, fsdp, 8, size)
    assert sharded < _device_need(train, replicated, 8, size)
    config.check_memory(fsdp, world_size=8, device_bytes=sharded, **gpu)
    with pytest.raises(config.ConfigError, match=r"parallel.fsdp=false\)"):
        config.check_memory(replicated, world_size=8, device_bytes=sharded, **gpu)


def test_hf_without_weights_builds_every_expert(train, hf, tmp_path):
    """A folder without weights is built whole on each rank before the split: at EP=8 that
    build is the peak of a model of large experts, and the fix is to save its weights."""
    from ep_moe.train.hf_model import inspect_hf_model

    config = train.config
    whole, read = inspect_hf_model(str(hf / "config_only")).size, inspect_hf_model(str(hf / "weights")).size
    job = config.parse_args(_hf_args(hf, tmp_path, "config_only"))
    builds = [config.memory_needs(job, 8, on_host=False, model=s)[0] for s in (whole, read)]
    assert builds[0].parts["parameters"] == 4 * (whole.experts + whole.dense)
    assert builds[1].parts["parameters"] == 4 * (read.experts // 8 + read.dense)
    large = config.ModelSize(experts=2**30, dense=2**20, vocab_size=HF_VOCAB, built_whole=True)
    need = _device_need(train, job, 8, large)
    assert need == config.memory_needs(job, 8, on_host=False, model=large)[0].total
    with pytest.raises(config.ConfigError) as err:
        config.check_memory(job, world_size=8, on_host=False, device="cuda:0", device_bytes=need - 1, host_bytes=1,
                            model=large)
    message = str(err.value)
    assert "building the model, the parameters of one rank (every expert, before it keeps its own" in message, message
    assert message.endswith("save the model's weights in the model.hf folder (save_pretrained): each rank then "
                            "reads only its own experts"), message
    read = dataclasses.replace(large, built_whole=False)  # with weights: each rank reads its eighth
    assert _device_need(train, job, 8, read) < need * 2 // 3
    config.check_memory(job, world_size=8, on_host=False, device="cuda:0", device_bytes=_device_need(train, job, 8, read),
                        host_bytes=1, model=read)


@pytest.mark.parametrize("dtype", [[], ["--set", "training.dtype='bfloat16'", "--set",
                                        "training.param_dtype='bfloat16'"]], ids=["fp32", "pure_bf16"])
def test_hf_estimate_is_a_floor(train, hf, tmp_path, monkeypatch, dtype):
    from ep_moe.train.hf_model import inspect_hf_model

    _check_floor(train, monkeypatch, [*_hf_args(hf, tmp_path), *dtype], inspect_hf_model(str(hf / "weights")).size)
