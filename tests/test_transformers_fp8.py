"""FP8 experts for Hugging Face models: ``expert_parallel(..., expert_precision="fp8")``
(ep_moe/integrations/transformers.py) and the trainer's ``moe.expert_precision`` with
``model.hf``, on the CPU in the Triton interpreter, float16.

- The sparse MoE blocks of Qwen3-MoE, Mixtral, GPT-OSS (transposed weights, biases, the
  clamped SwiGLU) and DeepSeek-V3 (sigmoid group routing, a shared expert) with FP8 experts
  against the same blocks with ``"ep_moe"`` bf16 experts (float16 here): the output and every
  gradient (hidden states, router, each expert tensor and bias) within the recipe's bound,
  and the output off by more than a float16 rounding (quantized, not silently float16).
- The weights' e4m3 copies: made once per optimizer step, not per call, GPT-OSS's transposed
  layout (a view made per call) included.
- EP=2 on gloo (all-to-all, all-gather) against EP=1 over every rank's tokens in one call.
- The errors: an unknown precision, ``backend="torch"``, a device without FP8 at
  ``expert_parallel``, ``from_pretrained`` and the first call; the trainer's config.
- The trainer fine-tuning a tiny Qwen3-MoE folder with ``--set moe.expert_precision='fp8'``.

The layer's own FP8 tests (the float64 reference of the same quantization): tests/test_fp8_layer.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5")

import ep_moe.integrations.transformers as ep_hf  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from ep_moe.kernels.fp8 import fp8_supported  # noqa: E402
import hf_models  # noqa: E402
from hf_models import H, Routed, forward_backward, routing, tiny_model  # noqa: E402

default_kernel_configs = hf_models.default_kernel_configs
"""Triton on the kernels' default configs (the fixture pytestmark names)."""

CPU = torch.device("cpu")
pytestmark = [pytest.mark.usefixtures("default_kernel_configs"),
              pytest.mark.skipif(not fp8_supported(CPU)[0], reason="the FP8 kernels run in the Triton interpreter "
                                 "here (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)")]

LAYER_BOUND = 1e-1
"""Relative Frobenius error of FP8 experts (output and every gradient) against unquantized
ones: tests/test_fp8_layer.py's bound for the layer (two GEMMs of the recipe's 3.5-4.5e-2
each, in a row). Measured here (32 tokens): the outputs 3.7-5.9e-2, the gradients up to
6.2e-2 but GPT-OSS's (7.4e-2 the hidden states', 7.7e-2 gate_up's, where the quantization
moves values across the clamped SwiGLU's limits)."""
QUANTIZED_ABOVE = 1e-2
"""The FP8 output differs from the unquantized one by more than this (tests/test_fp8_layer.py;
a float16 one is within 1e-3 of float64)."""
SAME_QUANT_TOL = 2e-3
"""Relative Frobenius error of FP8 experts at EP=2 against EP=1 over the same rows: the same
quantization, maybe summed in another order (tests/test_fp8_layer.py's bound of the same
quantization; equal bit for bit here)."""


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    diff = (a - b).norm()
    return 0.0 if diff == 0 else (diff / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------
# FP8 against bf16 experts on the same blocks.

FAMILIES = {"qwen3_moe": {}, "mixtral": {}, "gpt_oss": {}, "deepseek_v3": dict(dense_layers=1)}
"""tiny_model's arguments per family (DeepSeek-V3: a dense first layer, the MoE block last)."""


def _moe_block(family: str) -> nn.Module:
    """The last layer's sparse MoE block (router, experts, shared experts) of the family's tiny
    model, float16."""
    return tiny_model(family, **FAMILIES[family]).model.layers[-1].mlp.half()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_block_is_quantized_and_within_the_bound_of_bf16(family):
    """The block's output and every gradient with FP8 experts against ``"ep_moe"``'s own
    (the Triton backend, float16): within LAYER_BOUND, the output off by more than
    QUANTIZED_ABOVE; every expert tensor gets a gradient."""
    block = _moe_block(family)
    x = torch.randn(1, 32, H, generator=torch.Generator().manual_seed(2)).half()
    ep_hf.expert_parallel(block, None, backend="triton")
    plain = forward_backward(block, ep_hf.IMPLEMENTATION, x)
    ep_hf.expert_parallel(block, None, expert_precision="fp8")
    fp8 = forward_backward(block, ep_hf.IMPLEMENTATION, x)
    runners = [r for _, m in ep_hf.experts_modules(block) for r in ep_hf._state(m).runners.values()]
    assert [r.config.expert_precision for r in runners] == ["fp8"]
    assert fp8.keys() == plain.keys()
    assert QUANTIZED_ABOVE < _rel_err(fp8["output"], plain["output"]) < LAYER_BOUND, (
        f"output {_rel_err(fp8['output'], plain['output']):.2e}")
    bad = {name: f"{_rel_err(grad, plain[name]):.2e}" for name, grad in fp8.items()
           if _rel_err(grad, plain[name]) >= LAYER_BOUND}
    assert not bad, bad
    expert_grads = [name for name in fp8 if name.startswith("experts.")]
    assert "input.0" in fp8 and any(name.endswith("gate.weight") or "router" in name for name in fp8)
    assert len(expert_grads) == (4 if family == "gpt_oss" else 2)
    assert all(fp8[name].abs().max() > 0 for name in expert_grads)


# ---------------------------------------------------------------------------------------
# The weights' e4m3 copies.


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_weights_are_quantized_once_per_optimizer_step(quantizations, family):
    """Two forward+backward calls (micro-batches of one step): one copy of each weight; an
    optimizer step, then a call: one more each. GPT-OSS stores its weights transposed: the
    copies come from the view of the parameter, keyed on it."""
    experts = tiny_model(family).model.layers[0].mlp.experts.half()
    ep_hf.expert_parallel(nn.ModuleList([experts]), None, expert_precision="fp8")
    ids, weights = routing(12)
    module = Routed(experts, ids)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(4)).half()
    params = {"gate_up": experts.gate_up_proj, "down": experts.down_proj}

    def made() -> list[str]:
        owners = [w if w._base is None else w._base for w in quantizations]
        return [name for owner in owners for name, p in params.items() if owner is p]

    optimizer = torch.optim.SGD(experts.parameters(), lr=0.1)
    for _ in range(2):
        module(x, weights.half()).float().square().sum().backward()
    assert made() == ["gate_up", "down"] and len(quantizations) == 2
    assert all((w._base is not None) == (family == "gpt_oss") for w in quantizations)  # transposed: views
    with torch.no_grad():
        before = module(x, weights.half())
    optimizer.step()
    with torch.no_grad():
        after = module(x, weights.half())
    assert made() == ["gate_up", "down"] * 2 and len(quantizations) == 4
    assert not torch.equal(after, before)


# ---------------------------------------------------------------------------------------
# EP=2 on gloo against EP=1.

EP_DISPATCHES = ("all_to_all", "all_gather")
EP_TOKENS = 6


def _gpt_oss_experts() -> nn.Module:
    """GPT-OSS's experts (transposed, biases, the clamped SwiGLU), float16, the same on every rank."""
    return tiny_model("gpt_oss").model.layers[0].mlp.experts.half()


def _ep_inputs(world: int):
    """Per rank: (tokens [T, H], expert ids [T, K], routing weights [T, K], output gradient [T, H])."""
    gen = torch.Generator().manual_seed(9)
    out = []
    for rank in range(world):
        ids, weights = routing(EP_TOKENS, empty=(), seed=10 + rank)
        out.append((torch.randn(EP_TOKENS, H, generator=gen).half(), ids, weights.half(),
                    torch.randn(EP_TOKENS, H, generator=gen).half()))
    return out


def _expert_grads(experts: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in experts.named_parameters()}


def _fp8_ep_worker(rank: int, world: int) -> dict:
    out = {}
    x, ids, weights, grad = _ep_inputs(world)[rank]
    for dispatch in EP_DISPATCHES:
        experts = _gpt_oss_experts()
        ep_hf.expert_parallel(nn.ModuleList([experts]), dist.group.WORLD, dispatch=dispatch, expert_precision="fp8")
        x_, w_ = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = experts(x_, ids, w_)
        (y * grad).sum().backward()
        runner = ep_hf._state(experts).runners[ids.shape[1]]
        out[dispatch] = dict(y=y.detach(), dx=x_.grad, dw=w_.grad, grads=_expert_grads(experts),
                             precision=runner.config.expert_precision, dispatch=runner.config.dispatch)
    return out


@pytest.mark.distributed
def test_fp8_ep2_on_gloo_matches_ep1():
    """GPT-OSS's experts split over two gloo ranks with FP8, all-to-all and all-gather: each
    rank's output and the gradients of its tokens and routing weights, and each rank's
    expert rows' gradients, as one EP=1 call over every rank's tokens."""
    results = run_distributed(_fp8_ep_worker, 2)
    inputs = _ep_inputs(2)
    experts = _gpt_oss_experts()
    ep_hf.expert_parallel(nn.ModuleList([experts]), None, expert_precision="fp8")
    x = torch.cat([i[0] for i in inputs]).requires_grad_()
    weights = torch.cat([i[2] for i in inputs]).requires_grad_()
    y = experts(x, torch.cat([i[1] for i in inputs]), weights)
    (y * torch.cat([i[3] for i in inputs])).sum().backward()
    want = _expert_grads(experts)
    for dispatch in EP_DISPATCHES:
        for rank, got in enumerate(r[dispatch] for r in results):
            assert got["precision"] == "fp8" and got["dispatch"] == dispatch
            rows = slice(rank * EP_TOKENS, (rank + 1) * EP_TOKENS)
            for what, ref in (("y", y[rows]), ("dx", x.grad[rows]), ("dw", weights.grad[rows])):
                assert _rel_err(got[what], ref) < SAME_QUANT_TOL, f"{dispatch} rank {rank} {what}"
            for name, grad in want.items():
                local = got["grads"][name]
                ref = grad[rank * local.shape[0]:(rank + 1) * local.shape[0]]
                assert ref.abs().max() > 0, name
                assert _rel_err(local, ref) < SAME_QUANT_TOL, f"{dispatch} rank {rank} {name}"


# ---------------------------------------------------------------------------------------
# Errors.


def _no_fp8_device(monkeypatch):
    """No Triton interpreter and no GPU: nowhere to run the FP8 kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_errors_name_the_argument_and_the_fix(monkeypatch, tmp_path):
    experts = nn.ModuleList([tiny_model("qwen3_moe").model.layers[0].mlp.experts])
    with pytest.raises(ValueError, match=r"expert_parallel: ExpertsOptions.expert_precision='fp4': use one of "
                                         r"\('bf16', 'fp8'\)"):
        ep_hf.expert_parallel(experts, None, expert_precision="fp4")
    with pytest.raises(ValueError, match=r"expert_parallel: .*expert_precision='fp8' runs the experts' GEMMs on "
                                         r"ep_moe's FP8 Triton kernels, but backend='torch' is the plain-PyTorch "
                                         r"path; pass backend='auto' \(or 'triton'\), or expert_precision='bf16'"):
        ep_hf.expert_parallel(experts, None, backend="torch", expert_precision="fp8")
    with pytest.raises(ValueError, match=r"dispatch='all_gather_copy_engine'.*pass dispatch='all_gather'"):
        ep_hf.expert_parallel(experts, None, dispatch="all_gather_copy_engine", expert_precision="fp8")
    # checked before the folder is read (there is none)
    with pytest.raises(ValueError, match=r"from_pretrained: .*backend='torch' is the plain-PyTorch path"):
        ep_hf.from_pretrained(transformers.AutoModelForCausalLM, str(tmp_path / "nowhere"), None, backend="torch",
                              expert_precision="fp8")
    ep_hf.expert_parallel(experts, None, expert_precision="fp8")  # the interpreter is on: accepted
    ids, weights = routing(3)
    with monkeypatch.context() as patched:
        _no_fp8_device(patched)
        no_fp8 = (r"expert_precision='fp8': FP8 experts run on CUDA GPUs with FP8 tensor cores, "
                  r"not on cpu .*TRITON_INTERPRET=1.*or use expert_precision='bf16'")
        with pytest.raises(ValueError, match=r"expert_parallel: 0: " + no_fp8):
            ep_hf.expert_parallel(experts, None, expert_precision="fp8")
        with pytest.raises(ValueError, match=r"from_pretrained\(device='cpu'\): " + no_fp8):
            ep_hf.from_pretrained(transformers.AutoModelForCausalLM, str(tmp_path), None, expert_precision="fp8")
        # set while the interpreter was on; at the first call it is off: no bf16 result instead
        with pytest.raises(ValueError, match=r"Qwen3MoeExperts under experts_implementation='ep_moe': " + no_fp8):
            experts[0](torch.randn(3, H), ids, weights)
    bf16 = nn.ModuleList([tiny_model("qwen3_moe").model.layers[0].mlp.experts])
    with monkeypatch.context() as patched:
        _no_fp8_device(patched)
        ep_hf.expert_parallel(bf16, None)  # bf16 runs anywhere
        assert bf16[0](torch.randn(3, H), ids, weights).shape == (3, H)


# ---------------------------------------------------------------------------------------
# The trainer.

VOCAB = 320
TRAIN_ARGS = ["--steps", "2", "--set", "logging.log_interval=1", "--set", "logging.eval_interval=100",
              "--set", "logging.progress_bar=false", "--set", "training.batch_size=2", "--set", "training.seq_len=16",
              "--set", "training.lr=1e-2", "--set", "training.warmup_steps=1", "--set", "checkpoint.interval=-1",
              "--export-hf", ""]


@pytest.fixture(scope="module")
def hf_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE folder (save_pretrained, no tokenizer) and a token file of its vocabulary."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    tiny_model("qwen3_moe", vocab=VOCAB, std=0.05).save_pretrained(folder)
    tokens = folder.parent / "tokens.u32"
    torch.randint(0, VOCAB, (8192,), generator=torch.Generator().manual_seed(0), dtype=torch.int32).numpy().tofile(
        tokens)
    return folder, tokens


@pytest.fixture
def train_modules():
    from ep_moe.train import config, errors, trainer

    return config, errors, trainer


def test_trainer_config_takes_expert_precision_with_an_hf_model(train_modules, hf_run_inputs, monkeypatch):
    """``moe.expert_precision`` is one of an HF model's ``[moe]`` keys: accepted, checked
    (a value outside the choices, with backend='torch' blaming the option that set it), and
    refused before the process group where the device has no FP8."""
    config, errors, trainer_module = train_modules
    folder, tokens = hf_run_inputs
    hf = ["--hf-model", str(folder), "--data", str(tokens)]
    assert "expert_precision" in config.HF_MOE_KEYS
    assert config.parse_args([*hf, "--set", "moe.expert_precision='fp8'"]).moe["expert_precision"] == "fp8"
    assert config.parse_args(hf).moe.get("expert_precision", "bf16") == "bf16"  # the default (the hf preset names it)
    with pytest.raises(errors.ConfigError, match=r"^--set moe.expert_precision='fp4': moe.expert_precision='fp4' "
                                                 r"is not an allowed value: use one of 'bf16', 'fp8'"):
        config.parse_args([*hf, "--set", "moe.expert_precision='fp4'"])
    with pytest.raises(errors.ConfigError, match=r"^--set moe.expert_precision='fp8': .*backend='torch' is the "
                                                 r"plain-PyTorch path; pass backend='auto'"):
        config.parse_args([*hf, "--set", "moe.backend='torch'", "--set", "moe.expert_precision='fp8'"])
    job = config.parse_args([*hf, "--set", "moe.expert_precision='fp8'"])
    _no_fp8_device(monkeypatch)
    try:
        with pytest.raises(errors.ConfigError, match=r"^moe.expert_precision='fp8': FP8 experts run on CUDA GPUs "
                                                     r"with FP8 tensor cores, not on cpu"):
            trainer_module.Trainer(job)
        assert not dist.is_initialized()
    finally:
        trainer_module.destroy_distributed()


def _train(train_modules, folder: Path, tokens: Path, out: Path, precision: str) -> tuple[list[dict], list]:
    """Two steps of the trainer in this process (a group of one) with ``moe.expert_precision``
    (checked on every experts module it ran): its loss records, and its expert weights."""
    config, _, trainer_module = train_modules
    metrics = out / f"{precision}.jsonl"
    trainer = trainer_module.Trainer(config.parse_args([
        "--hf-model", str(folder), "--data", str(tokens), *TRAIN_ARGS, "--checkpoint-dir", str(out / precision),
        "--metrics-file", str(metrics), "--set", f"moe.expert_precision='{precision}'"]))
    try:
        trainer.train()
        modules = [m for _, m in ep_hf.experts_modules(trainer.model.hf)]
        precisions = {r.config.expert_precision for m in modules for r in ep_hf._state(m).runners.values()}
    finally:
        trainer.close()
        trainer_module.destroy_distributed()
    assert precisions == {precision}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    return records, [w for m in modules for w in (m.gate_up_proj, m.down_proj)]


@pytest.mark.distributed
def test_trainer_fine_tunes_an_hf_model_with_fp8_experts(train_modules, hf_run_inputs, quantizations, tmp_path):
    """``--set moe.expert_precision='fp8'``: two steps on the CPU whose losses are finite and
    whose step-1 loss (the same weights, the same batch) is the bf16 run's to FP8's rounding,
    not equal to it; the experts' weights were quantized (the FP8 kernels ran), each once per
    step and layer."""
    folder, tokens = hf_run_inputs
    bf16, _ = _train(train_modules, folder, tokens, tmp_path, "bf16")
    assert not quantizations
    fp8, weights = _train(train_modules, folder, tokens, tmp_path, "fp8")
    assert [r["step"] for r in fp8] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in fp8)
    assert fp8[0]["loss"] != bf16[0]["loss"]
    assert fp8[0]["loss"] == pytest.approx(bf16[0]["loss"], rel=1e-3)
    # each expert weight (gate_up, down of 2 layers) at steps 1 and 2 and at the validation
    # after step 2's update, whatever the calls in between
    assert len(weights) == 4
    assert [sum(w is q for q in quantizations) for w in weights] == [3] * 4 and len(quantizations) == 12
