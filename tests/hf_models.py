"""Shared helpers of the transformers integration's tests (tests/test_transformers.py,
tests/test_transformers_families.py, tests/test_transformers_ep.py,
tests/gpu/test_transformers_cuda.py): small random Hugging Face MoE causal LMs
(:func:`tiny_model`), random routings, and the runner that calls a module with one experts
implementation and collects its output and every gradient, to compare ``"ep_moe"`` against
transformers' own. Import it after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
import transformers.integrations.moe as hf_moe
from torch import nn

import ep_moe.experts as experts_mod
import ep_moe.integrations.transformers as ep_hf

H, E, K = 32, 8, 2
"""The tiny modules' hidden size, expert count and top-k."""
VOCAB = 64
"""The tiny models' vocabulary."""
ATOL = RTOL = 1e-5
"""float32 ep_moe against float32 eager."""


@pytest.fixture
def default_kernel_configs(monkeypatch):
    """Triton runs on the kernels' default configs (fast in the interpreter); no autotune
    cache is read. A test module imports it and names it in
    ``pytestmark = pytest.mark.usefixtures("default_kernel_configs")``."""
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, num_rows, device: None)


# ---------------------------------------------------------------------------------------
# Tiny models.


def _family_config(family: str, num_experts: int, inter: int, dense_layers: int) -> tuple[str, dict]:
    """(causal-LM class name, config overrides) of ``family``: ``inter`` the experts' width."""
    if family == "qwen3_moe":
        return "Qwen3MoeForCausalLM", dict(num_experts=num_experts, moe_intermediate_size=inter, norm_topk_prob=True)
    if family == "mixtral":
        return "MixtralForCausalLM", dict(num_local_experts=num_experts, intermediate_size=inter)
    if family == "gpt_oss":
        # a sliding-window layer and a full one; the SwiGLU limit low enough that the clamps bite
        return "GptOssForCausalLM", dict(num_local_experts=num_experts, intermediate_size=inter, sliding_window=4,
                                         swiglu_limit=1.0, layer_types=["sliding_attention", "full_attention"])
    if family == "deepseek_v3":
        # sigmoid scores, 4 groups with the best 2 kept, a shared expert; MLA at small ranks
        return "DeepseekV3ForCausalLM", dict(
            n_routed_experts=num_experts, moe_intermediate_size=inter, n_shared_experts=1, n_group=4, topk_group=2,
            first_k_dense_replace=dense_layers, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4,
            rope_parameters=dict(rope_type="default", rope_theta=1e4))
    raise ValueError(f"no tiny model of {family!r}")


def tiny_model(family: str, *, num_experts: int = E, hidden: int = H, inter: int = 16, top_k: int = K,
               std: float = 0.1, seed: int = 0, dense_layers: int = 0, unit_norms: bool = True,
               vocab: int = VOCAB) -> nn.Module:
    """A random float32 causal LM of ``family`` (``"qwen3_moe"``, ``"mixtral"``, ``"gpt_oss"``,
    ``"deepseek_v3"``) with two layers, ``num_experts`` experts of width ``inter``, top-``top_k``,
    ``vocab`` token ids, the same for a seed and another for another: every parameter N(0,
    ``std``) (transformers zero-initialises biases, GPT-OSS's expert biases among them: random ones take part in the
    output), the norms' weights 1 + N(0, ``std``) where ``unit_norms`` (activations of about
    unit scale), else N(0, ``std``) too (small activations: a nearly linear model, whose bf16
    rounding seldom flips a token's routing in the next layer). ``dense_layers``:
    DeepSeek-V3's first layers that are a dense MLP (width ``3 * inter``) instead of MoE."""
    name, overrides = _family_config(family, num_experts, inter, dense_layers)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * inter, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
                  num_experts_per_tok=top_k, initializer_range=std, tie_word_embeddings=False)
    config = transformers.AutoConfig.for_model(family, **{**common, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, name)(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            mean = 1.0 if unit_norms and "Norm" in type(module).__name__ else 0.0
            for param in module.parameters(recurse=False):
                param.copy_(torch.randn(param.shape, generator=gen) * std + mean)
    return model


def routing(num_tokens: int, top_k: int = K, num_experts: int = E, empty: tuple = (5,), seed: int = 0):
    """Random ``top_k_index`` [T, K] (distinct experts per token, none of ``empty``) and
    positive ``top_k_weights`` [T, K]."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(num_tokens)])
    return ids.reshape(num_tokens, top_k), torch.rand(num_tokens, top_k, generator=gen) + 0.1


class Routed(nn.Module):
    """An experts module called with fixed expert ids: (hidden_states, top_k_weights) -> y,
    so the runner differentiates the weights like any input."""

    def __init__(self, experts: nn.Module, ids: torch.Tensor):
        super().__init__()
        self.experts, self.ids = experts, ids

    def forward(self, hidden_states, top_k_weights):
        return self.experts(hidden_states, self.ids, top_k_weights)


# ---------------------------------------------------------------------------------------
# Running with one experts implementation.


def set_implementation(module: nn.Module, impl: str) -> None:
    """Run every experts module under ``module`` with ``impl`` (a bare module or block has
    no ``set_experts_implementation``; the decorated forward reads its config)."""
    if hasattr(module, "set_experts_implementation"):
        module.set_experts_implementation(impl)
    for _, experts in ep_hf.experts_modules(module):
        experts.config._experts_implementation = impl


@contextlib.contextmanager
def ep_moe_calls():
    """The list of calls the ``"ep_moe"`` experts function gets meanwhile (a counting wrapper
    registered in its place), so a test cannot compare eager with itself unnoticed."""
    calls = []
    mapping = hf_moe.ExpertsInterface._global_mapping
    original = mapping[ep_hf.IMPLEMENTATION]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(mapping, ep_hf.IMPLEMENTATION, lambda *a, **kw: calls.append(1) or original(*a, **kw))
        yield calls


def run_with(module: nn.Module, impl: str, *args, **kwargs):
    """``module(*args, **kwargs)`` with experts implementation ``impl``, checking that the
    experts ran ep_moe exactly when ``impl`` names it."""
    set_implementation(module, impl)
    with ep_moe_calls() as calls:
        out = module(*args, **kwargs)
    assert bool(calls) == (impl == ep_hf.IMPLEMENTATION), f"{impl}: ep_moe called {len(calls)} times"
    return out


def grad_of(tensor: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient; zeros where it took no part (an expert no token chose)."""
    return torch.zeros_like(tensor) if tensor.grad is None else tensor.grad.clone()


def forward_backward(module: nn.Module, impl: str, *inputs: torch.Tensor) -> dict:
    """One forward of ``module(*inputs)`` (the first element of a tuple output) with
    experts implementation ``impl`` and one backward of ``sum(y * c)``, ``c`` fixed random.
    Returns the output, the gradient of every input (``input.i``) and of every parameter
    (by name)."""
    module.zero_grad(set_to_none=True)
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = run_with(module, impl, *inputs)
    y = out[0] if isinstance(out, tuple) else out
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    result = {"output": y.detach()}
    result.update({f"input.{i}": grad_of(x) for i, x in enumerate(inputs)})
    result.update({name: grad_of(p) for name, p in module.named_parameters()})
    return result


def mismatches(actual: dict, expected: dict, atol: float = ATOL, rtol: float = RTOL) -> dict:
    """{name: max abs difference} of the entries that differ beyond the tolerance."""
    assert actual.keys() == expected.keys()
    return {name: (actual[name] - expected[name]).abs().max().item() for name in expected
            if actual[name].shape != expected[name].shape
            or not torch.allclose(actual[name], expected[name], atol=atol, rtol=rtol)}
