"""``"ep_moe"`` as the experts of Hugging Face models on one GPU, in bfloat16: the fused Triton
kernels and the small-call path against transformers' ``"eager"`` experts in float32 on the
same bf16 weights, whole models (logits, every gradient), for each layout: qwen3_moe and
mixtral (``[E, 2I, H]``, SwiGLU fused), gpt_oss (``[E, H, 2I]`` read through its strides,
interleaved clamped SwiGLU in torch, biases) and deepseek_v3 (sigmoid grouped routing,
shared experts). transformers' own ``"grouped_mm"`` in bf16 is held to the same bound, the
measure of what bf16 itself costs."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import ep_moe.integrations.transformers as ep_hf  # noqa: E402
from ep_moe import grouped_mm_experts  # noqa: E402
from hf_models import VOCAB, tiny_model  # noqa: E402
from tolerance import rel_err, within  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_REL_ERR = 2e-2
"""bf16 against the float32 reference: transformers' own grouped_mm is at about 5e-3 here."""


def _run(model: torch.nn.Module, ids: torch.Tensor, implementation: str):
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.float(), [p.grad.float() for p in model.parameters()]


@pytest.mark.parametrize("tokens", [300, 5], ids=["fused", "small-call"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_bf16_model_matches_float32_eager(family, tokens, monkeypatch):
    if tokens > 16:  # the fused kernels, not torch._grouped_mm's small-call path
        monkeypatch.setattr(grouped_mm_experts, "GROUPED_MM_MAX_ROWS", 0)
    model = tiny_model(family, num_experts=16, hidden=256, inter=384, top_k=4, std=0.05).cuda()
    reference = copy.deepcopy(model)  # float32
    model = model.bfloat16()
    with torch.no_grad():
        for param, ref in zip(model.parameters(), reference.parameters()):
            ref.copy_(param.float())  # the same (bf16-rounded) weights
    ids = torch.randint(0, VOCAB, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = _run(reference, ids, "eager")
    for implementation in ("ep_moe", "grouped_mm"):
        logits, grads = _run(model, ids, implementation)
        source = __name__ if implementation == "ep_moe" else f"{__name__} (grouped_mm)"
        assert within(rel_err(logits, want[0]), MAX_REL_ERR, f"{family} logits", source)
        for (name, _), grad, ref in zip(model.named_parameters(), grads, want[1]):
            assert within(rel_err(grad, ref), MAX_REL_ERR, f"{family} {name}", source), (implementation, name)
