"""``"ep_moe"`` experts under ``torch.compile`` (what the trainer's ``training.compile`` does to
an HF model's decoder layers), Triton in the interpreter on the CPU: a decoder layer traces
as one graph (the kernel configs enter as constants, the gated activation as torch ops
Inductor fuses, the GEMMs as custom ops), and the compiled layers give eager's logits and
every parameter's gradient."""

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter; on "
                                "GPUs: tests/gpu/test_transformers_cuda.py's compiled decoder layers")

import ep_moe.integrations.transformers as ep_hf  # noqa: E402
from hf_models import VOCAB, grad_of, mismatches, tiny_model  # noqa: E402


FAMILIES = {"qwen3_moe": {}, "gpt_oss": {}, "deepseek_v3": dict(dense_layers=1), "mixtral": {}}
"""tests/hf_models.py's tiny_model arguments per family (DeepSeek-V3: its first layer dense)."""


def _model(family: str):
    """A tiny model of ``family`` whose experts run ep_moe's Triton kernels (configs looked up
    as in a run: no fixture replaces the lookup)."""
    model = tiny_model(family, **FAMILIES[family])
    return ep_hf.expert_parallel(model, None, backend="triton")


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_decoder_layer_traces_as_one_graph(family, grad):
    """No first call before the trace: what expert_parallel builds is all a trace needs."""
    model = _model(family)
    layer = model.model.layers[-1]
    x = torch.randn(2, 7, model.config.hidden_size, requires_grad=grad)
    cos_sin = model.model.rotary_emb(x, torch.arange(7)[None])
    with torch.set_grad_enabled(grad):
        explained = torch._dynamo.explain(lambda h: layer(h, position_embeddings=cos_sin, attention_mask=None))(x)
    assert explained.graph_break_count == 0, [str(b.reason)[:300] for b in explained.break_reasons]
    assert explained.graph_count == 1


def _loss_and_grads(model, tokens: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    return {"logits": out.logits.detach(), **{name: grad_of(p) for name, p in model.named_parameters()}}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_compiled_decoder_layers_match_eager(family):
    model = _model(family)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = _loss_and_grads(model, tokens)
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)  # fullgraph: a graph break would raise
    try:
        actual = _loss_and_grads(model, tokens)
    finally:
        torch._dynamo.reset()
    assert all(expected[name].abs().max() > 0 for name in expected if name.endswith("experts.gate_up_proj"))
    assert not mismatches(actual, expected, 1e-5, 1e-4), mismatches(actual, expected, 1e-5, 1e-4)
