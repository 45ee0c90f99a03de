"""``"ep_moe"`` as the experts of Hugging Face models on one GPU, in bfloat16: the fused Triton
kernels and the small-call path against transformers' ``"eager"`` experts in float32 on the
same bf16 weights, MoE blocks (output, every gradient), for each layout: qwen3_moe and
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

MODEL = dict(num_experts=16, hidden=256, inter=384, top_k=4, std=0.05, unit_norms=False)
"""The tiny models' size here (tests/hf_models.py), the norms' weights small like the rest:
with unit ones, bf16's rounding in one layer flips some token's routing in the next, and a
whole model's logits differ by more than rounding (GPT-OSS: 4e-2)."""
FLOOR = 2e-2
"""Relative error any bf16 result may have against float32 here (random weights, bf16
keeping 8 bits: grouped_mm's own reach 1.1e-2)."""
MIN_NUMEL = 256
"""Tensors checked one by one from this size: a handful of summed gradients cancel, and
their relative error is bf16 noise of either implementation; they are checked in the
gradient of every parameter together."""
OVER_GROUPED_MM = 2.0
"""ep_moe's error against float32 may exceed transformers' grouped_mm's (bf16 too, on the same
weights and input) by at most this factor: both round the activations to bf16 between the
GEMMs, in other places and orders; a wrong result or gradient is off by 1e-1 and more."""


def _run(block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, implementation: str):
    """The block's output, input gradient and every parameter gradient, in float32."""
    ep_hf.experts_modules(block)[0][1].config._experts_implementation = implementation
    block.zero_grad(set_to_none=True)
    x = x.detach().to(next(block.parameters()).dtype).requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out  # GPT-OSS's block returns the router scores too
    out.backward(dy.to(out.dtype))
    return [out.float(), x.grad.float()] + [p.grad.float() for p in block.parameters()]


@pytest.mark.parametrize("tokens", [300, 5], ids=["fused", "small-call"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_bf16_block_matches_float32_eager(family, tokens, monkeypatch):
    """A bf16 MoE block (router, experts, shared experts) with ep_moe's experts against the
    float32 eager block on the same weights and input: its output, input gradient and every
    parameter gradient within what transformers' own grouped_mm loses in bf16. (Whole models
    are compared in float32 on the CPU; in bf16, where one layer's rounding can flip the next
    layer's routing of a token, the two bf16 implementations would differ by those flips.)"""
    if tokens > 16:  # the fused kernels, not torch._grouped_mm's small-call path
        monkeypatch.setattr(grouped_mm_experts, "GROUPED_MM_MAX_ROWS", 0)
    model = tiny_model(family, **MODEL).cuda()
    reference = model.model.layers[-1].mlp  # float32 (deepseek_v3's last layer: an MoE one)
    block = copy.deepcopy(reference).bfloat16()
    with torch.no_grad():
        for param, ref in zip(block.parameters(), reference.parameters()):
            ref.copy_(param.float())  # the same (bf16-rounded) weights
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, tokens, 256, device="cuda", generator=gen).bfloat16().float()
    dy = torch.randn(1, tokens, 256, device="cuda", generator=gen)
    want = _run(reference, x, dy, "eager")
    ours, theirs = _run(block, x, dy, "ep_moe"), _run(block, x, dy, "grouped_mm")
    names = ["output", "input grad"] + [name for name, _ in block.named_parameters()]
    checked = [(name, got, base, ref) for name, got, base, ref in zip(names, ours, theirs, want)
               if ref.numel() >= MIN_NUMEL]
    checked.append(("every gradient", *(torch.cat([g.flatten() for g in grads[2:]]) for grads in (ours, theirs, want))))
    for name, got, base, ref in checked:
        bound = max(FLOOR, OVER_GROUPED_MM * rel_err(base, ref))
        assert within(rel_err(got, ref) / bound, 1.0, f"{family} {name} (error / bound)", __name__), (
            name, rel_err(got, ref), rel_err(base, ref))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_small_forwards_replay_graphs_that_match_eager(family):
    """Without autograd, a recurring small shape is captured on its third call and replayed
    (the module's own gate too, for gpt_oss): each replay's logits equal the eager
    forward's on the fused kernels, to bf16's summation-order differences."""
    model = tiny_model(family, **MODEL).cuda().bfloat16().eval()
    model.set_experts_implementation("ep_moe")
    gen = torch.Generator("cuda").manual_seed(2)
    with torch.no_grad():
        for call in range(5):
            ids = torch.randint(0, VOCAB, (2, 3), device="cuda", generator=gen)
            got = model(input_ids=ids).logits
            runners = [r for _, m in ep_hf.experts_modules(model) for r in ep_hf._state(m).runners.values()]
            for runner in runners:
                runner.forward_graphs.enabled = False
            with grouped_mm_experts.fused_kernels_only():
                want = model(input_ids=ids).logits
            for runner in runners:
                runner.forward_graphs.enabled = True
            assert within(rel_err(got, want), 1e-2, f"{family} replayed logits, call {call}", __name__)
    assert runners and all(len(runner.forward_graphs._graphs) == 1 for runner in runners)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_compiled_decoder_layers_match_eager_in_bf16(family):
    """Each decoder layer under ``torch.compile`` (Inductor, ``fullgraph``: one graph with
    ep_moe's kernels inside, what the trainer's ``training.compile`` does) against the same
    bf16 model eager, both on the fused kernels (9600 routed rows): logits and every
    parameter's gradient within twice bf16's floor (each within the floor of float32: Inductor
    rounds its fused norms, rotary embedding and attention epilogues to bf16 at other places
    than eager; GPT-OSS's gradients were 2.1e-2 apart on an H200)."""
    torch._dynamo.reset()
    model = tiny_model(family, **MODEL).cuda().bfloat16()
    ep_hf.expert_parallel(model, None)
    tokens = torch.randint(0, VOCAB, (8, 300), generator=torch.Generator().manual_seed(1)).cuda()

    def logits_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        return out.logits.float(), torch.cat([p.grad.float().flatten() for p in model.parameters()
                                              if p.grad is not None])

    eager = logits_and_grads()
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    try:
        compiled = logits_and_grads()
    finally:
        torch._dynamo.reset()
    for what, got, want in zip(("logits", "gradients"), compiled, eager):
        assert within(rel_err(got, want), 2 * FLOOR, f"compiled {family} {what}", __name__)
