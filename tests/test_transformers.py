"""ep_moe as transformers' experts implementation (ep_moe/integrations/transformers.py),
against transformers' own ``"eager"`` loop in float32 on the CPU: the sparse MoE blocks
(router, experts, shared experts) of seven families on both backends, whole tiny models
(logits, every parameter's loss gradient, a save/load round trip with
``experts_implementation="ep_moe"``), routing edge cases, transformers' own EP sentinel ids,
and the refusal of a module ep_moe cannot compute. Every class of the installed
transformers, one by one: tests/test_transformers_families.py."""

import importlib
from typing import Optional

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5")

import ep_moe.integrations.transformers as ep_hf  # noqa: E402
from hf_models import (ATOL, RTOL, VOCAB, E, H, K, Routed, default_kernel_configs,  # noqa: E402,F401
                       ep_moe_calls, forward_backward, grad_of, mismatches, routing, run_with,
                       set_implementation, tiny_model)

pytestmark = pytest.mark.usefixtures("default_kernel_configs")
"""Triton on the kernels' default configs (fast in the interpreter)."""


def modeling(model_type: str):
    """transformers' ``modeling_<model_type>`` module."""
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


@torch.no_grad()
def randomize(module: nn.Module, std: float = 0.1, seed: int = 0) -> nn.Module:
    """Every parameter (expert tensors, biases, routers: many start as ``torch.empty`` or
    zeros) and every float buffer (DeepSeek's score-correction bias) N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)
    return module


def assert_ep_moe_matches(module: nn.Module, *inputs, backend: Optional[str] = "torch", reference: str = "eager",
                          atol: float = ATOL, rtol: float = RTOL) -> dict:
    """``"ep_moe"`` (on ``backend``; None: as the module is, without :func:`expert_parallel`)
    against ``reference``: the output and every gradient. Returns ep_moe's results."""
    if backend is not None:
        ep_hf.expert_parallel(module, None, backend=backend)
    expected = forward_backward(module, reference, *inputs)
    actual = forward_backward(module, ep_hf.IMPLEMENTATION, *inputs)
    assert expected["output"].abs().max() > 0
    assert not mismatches(actual, expected, atol, rtol), mismatches(actual, expected, atol, rtol)
    return actual


# ---------------------------------------------------------------------------------------
# (a) Sparse MoE blocks: router + experts (+ shared experts).

BLOCKS = {
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", dict(num_experts=E, moe_intermediate_size=16, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", dict(num_experts=E, moe_intermediate_size=16,
                                                 shared_expert_intermediate_size=24)),
    "mixtral": ("MixtralSparseMoeBlock", dict(num_local_experts=E)),
    "olmoe": ("OlmoeSparseMoeBlock", dict(num_experts=E)),
    # sigmoid scores, 4 groups of 2 with the best 2 kept, the score-correction bias, scaling
    "deepseek_v3": ("DeepseekV3MoE", dict(n_routed_experts=E, moe_intermediate_size=16, n_group=4, topk_group=2,
                                          n_shared_experts=1, routed_scaling_factor=2.5)),
    # transposed, interleaved gate/up, biases; the limit low enough that the clamps bite
    "gpt_oss": ("GptOssMLP", dict(num_local_experts=E, swiglu_limit=0.5)),
    "glm4_moe": ("Glm4MoeMoE", dict(n_routed_experts=E, moe_intermediate_size=16, n_group=2, topk_group=1,
                                    n_shared_experts=2, routed_scaling_factor=1.5)),
}


def tiny_block(model_type: str) -> nn.Module:
    """The family's sparse MoE block at hidden size 32, 8 experts, top-2, randomized."""
    name, overrides = BLOCKS[model_type]
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**{**dict(hidden_size=H, intermediate_size=16, num_experts_per_tok=K), **overrides})
    torch.manual_seed(0)
    return randomize(getattr(modeling(model_type), name)(config))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("model_type", list(BLOCKS))
def test_moe_block_matches_eager(model_type, backend):
    """The block's output and the gradients of its input, router (weight and bias), every
    expert tensor and bias and the shared experts, with ep_moe as with eager (13 tokens)."""
    block = tiny_block(model_type)
    x = torch.randn(1, 13, H, generator=torch.Generator().manual_seed(2))
    grads = assert_ep_moe_matches(block, x, backend=backend)
    assert grads["input.0"].abs().max() > 0
    assert all(grads[name].abs().max() > 0 for name, _ in block.named_parameters())


# ---------------------------------------------------------------------------------------
# (b) Whole tiny models.

MODELS = {"qwen3_moe": {}, "gpt_oss": {}, "deepseek_v3": dict(dense_layers=1)}
"""The families of the whole-model tests (tests/hf_models.py: GPT-OSS with a sliding-window
and a full-attention layer; DeepSeek-V3 with its first layer dense, the second MoE): the
tiny_model arguments of each."""


def _tokens(batch: int = 2, seq: int = 7):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("model_type", list(MODELS))
def test_tiny_model_logits_and_gradients_match_eager(model_type, backend):
    """Logits and the loss gradient of every parameter (embeddings, attention, routers,
    experts, shared experts) with ep_moe as with eager."""
    model = tiny_model(model_type, **MODELS[model_type]).eval()
    tokens = _tokens()
    ep_hf.expert_parallel(model, None, backend=backend)
    expected = _model_run(model, "eager", tokens)
    actual = _model_run(model, ep_hf.IMPLEMENTATION, tokens)
    assert not mismatches(actual, expected, 1e-5, 1e-4), mismatches(actual, expected, 1e-5, 1e-4)


def _model_run(model: nn.Module, impl: str, tokens: torch.Tensor) -> dict:
    """Logits and every parameter's gradient of the causal-LM loss with ``impl``."""
    model.zero_grad(set_to_none=True)
    out = run_with(model, impl, input_ids=tokens, labels=tokens)
    out.loss.backward()
    return {"logits": out.logits.detach(), **{name: grad_of(p) for name, p in model.named_parameters()}}


def test_from_pretrained_with_ep_moe_gives_the_same_logits(tmp_path):
    """save_pretrained of a tiny model, then from_pretrained(experts_implementation="ep_moe"):
    the experts run ep_moe (every experts module's config says so) and give eager's logits."""
    model = tiny_model("qwen3_moe").eval()
    tokens = _tokens()
    with torch.no_grad():
        expected = run_with(model, "eager", input_ids=tokens).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="ep_moe",
                                                               dtype=torch.float32)
    experts = ep_hf.experts_modules(loaded)
    assert len(experts) == 2 and all(m.config._experts_implementation == "ep_moe" for _, m in experts)
    with ep_moe_calls() as calls, torch.no_grad():
        actual = loaded(input_ids=tokens).logits
    assert len(calls) == 2
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------
# (c) Routing edge cases on bare experts modules.

EXPERTS = {"qwen3_moe": "Qwen3MoeExperts", "gpt_oss": "GptOssExperts"}
"""A default-layout module and the transposed, interleaved, biased one."""


def tiny_experts(model_type: str) -> nn.Module:
    """The family's experts module of its block in :data:`BLOCKS`, randomized."""
    return tiny_block(model_type).experts


def _all_on_expert_3(num_tokens):
    ids, weights = routing(num_tokens, empty=(3,))
    ids[:, 0] = 3  # every token's first slot on expert 3, the second on another
    return ids, weights


ROUTINGS = {
    "zero_token_experts": lambda: routing(13, empty=(0, 5, 7)),
    "all_tokens_on_one_expert": lambda: _all_on_expert_3(9),
    "top1_all_on_one_expert": lambda: (torch.full((6, 1), 6), routing(6, top_k=1)[1]),
    "one_token": lambda: routing(1),
    "one_token_top4": lambda: routing(1, top_k=4, empty=()),
    "seven_tokens_top3": lambda: routing(7, top_k=3, empty=()),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(ROUTINGS))
@pytest.mark.parametrize("model_type", list(EXPERTS))
def test_routing_edge_cases_match_eager(model_type, case, backend):
    """Output and gradients (hidden states, top-k weights, each expert tensor) with ep_moe
    as with eager for experts with no token, every token on one expert, one token, odd T."""
    experts = tiny_experts(model_type)
    ids, weights = ROUTINGS[case]()
    x = torch.randn(ids.shape[0], H, generator=torch.Generator().manual_seed(4))
    grads = assert_ep_moe_matches(Routed(experts, ids), x, weights, backend=backend)
    unused = sorted(set(range(E)) - set(ids.flatten().tolist()))
    assert all((grads[f"experts.{name}"][unused] == 0).all() for name, _ in experts.named_parameters())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_module_called_with_several_top_k(backend):
    """One module called with K = 1, 4, 2, then 1 again (a runner per K, kept): each call as
    eager."""
    experts = tiny_experts("qwen3_moe")
    ep_hf.expert_parallel(nn.ModuleList([experts]), None, backend=backend)
    for seed, top_k in enumerate((1, 4, 2, 1)):
        ids, weights = routing(5, top_k=top_k, empty=(), seed=seed)
        x = torch.randn(5, H, generator=torch.Generator().manual_seed(seed))
        assert_ep_moe_matches(Routed(experts, ids), x, weights, backend=None)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_tokens(backend):
    """Zero tokens: an empty output, and a backward that gives empty input gradients and
    zero expert gradients."""
    experts = tiny_experts("gpt_oss")
    ep_hf.expert_parallel(nn.ModuleList([experts]), None, backend=backend)
    grads = forward_backward(Routed(experts, torch.zeros(0, K, dtype=torch.long)), ep_hf.IMPLEMENTATION,
                             torch.randn(0, H), torch.rand(0, K))
    assert grads["output"].shape == (0, H) and grads["input.0"].shape == (0, H) and grads["input.1"].shape == (0, K)
    assert all((grads[f"experts.{name}"] == 0).all() for name, _ in experts.named_parameters())


def _split_like_transformers_ep(experts: nn.Module, rank: int, size: int) -> nn.Module:
    """What transformers' EP plan does to a module on ``rank``: its own experts' slices of
    every expert tensor, ``num_experts`` the local count, ``_is_expert_parallel`` set."""
    local = experts.num_experts // size
    with torch.no_grad():
        for name, param in list(experts.named_parameters()):
            experts._parameters[name] = nn.Parameter(param[rank * local:(rank + 1) * local].clone())
    experts.num_experts = local
    experts._is_expert_parallel = True
    return experts


SENTINEL_CASES = [(model_type, reference) for model_type in EXPERTS
                  for reference in ("eager", "grouped_mm", "batched_mm") if (model_type, reference) != ("gpt_oss", "eager")]
"""GptOssExperts' own loop cannot take the sentinel (its one_hot has num_experts classes)."""


needs_sentinels = pytest.mark.skipif(
    not hasattr(tiny_experts("qwen3_moe"), "_is_expert_parallel"),
    reason=f"transformers {transformers.__version__} has no EP sentinel ids (its experts lack _is_expert_parallel)")


@needs_sentinels
@pytest.mark.parametrize("model_type, reference", SENTINEL_CASES)
def test_transformers_ep_sentinel_slots_contribute_nothing(model_type, reference):
    """transformers' own EP calls the experts with local ids and the sentinel
    ``num_experts`` for other ranks' slots (their weights nonzero here): those slots add
    nothing and get no top-k weight gradient, as with eager / grouped_mm / batched_mm in
    the same mode."""
    experts = _split_like_transformers_ep(tiny_experts(model_type), rank=1, size=2)
    global_ids, weights = routing(11)
    local = torch.where(global_ids // 4 == 1, global_ids % 4, 4)  # the sentinel: num_experts
    assert (local == 4).any() and (local < 4).any()
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(5))
    # no expert_parallel: it refuses a module transformers split; on the CPU "auto" is the torch backend
    grads = assert_ep_moe_matches(Routed(experts, local), x, weights, backend=None, reference=reference)
    assert (grads["input.1"][local == 4] == 0).all() and (grads["input.1"][local < 4] != 0).all()
    only_sentinel = (local == 4).all(dim=1)
    if only_sentinel.any():
        assert (grads["output"][only_sentinel] == 0).all()


@needs_sentinels
def test_transformers_ep_sentinel_on_every_slot_gives_zeros():
    """A rank none of whose experts any token chose: zeros, zero gradients."""
    experts = _split_like_transformers_ep(tiny_experts("qwen3_moe"), rank=0, size=2)
    ids = torch.full((5, K), 4)
    grads = forward_backward(Routed(experts, ids), ep_hf.IMPLEMENTATION, torch.randn(5, H), torch.rand(5, K))
    assert all((g == 0).all() for g in grads.values())


# ---------------------------------------------------------------------------------------
# (d) Refusal.


def test_post_expert_norm_is_refused_naming_the_reason_and_the_alternative():
    """A module normalising each expert's output before the routing weight
    (has_post_expert_norm) raises, naming that and grouped_mm; expert_parallel refuses it."""
    experts = tiny_experts("qwen3_moe")
    experts.has_post_expert_norm = True
    experts.post_expert_norm = nn.RMSNorm(H)
    assert "has_post_expert_norm" in ep_hf.unsupported_reason(experts)
    ids, weights = routing(4)
    set_implementation(experts, ep_hf.IMPLEMENTATION)
    with pytest.raises(NotImplementedError, match=r"has_post_expert_norm.*'grouped_mm'"):
        experts(torch.randn(4, H), ids, weights)
    with pytest.raises(NotImplementedError, match="has_post_expert_norm"):
        ep_hf.expert_parallel(nn.ModuleList([experts]), None)


def test_unsupported_reason_of_a_module_that_is_no_experts_module():
    assert "not an experts module" in ep_hf.unsupported_reason(nn.Linear(2, 2))
    assert ep_hf.unsupported_reason(tiny_experts("gpt_oss")) is None
    with pytest.raises(ValueError, match="no transformers experts module"):
        ep_hf.expert_parallel(nn.Linear(2, 2), None)
