"""Small random Hugging Face MoE models for the transformers integration's tests (CPU and GPU)."""

from __future__ import annotations

import torch

VOCAB = 64
"""The models' vocabulary."""


def tiny_model(family: str, seed: int = 0, num_experts: int = 8, hidden: int = 32, inter: int = 16,
               top_k: int = 2, std: float = 0.1) -> torch.nn.Module:
    """A small random float32 causal LM of ``family`` (``"qwen3_moe"``, ``"gpt_oss"``,
    ``"deepseek_v3"``, ``"mixtral"``), every weight and bias drawn N(0, ``std``) (transformers
    zero-initialises biases; random ones test their gradients), the same for a seed."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=hidden // 4, num_experts_per_tok=top_k)
    if family == "gpt_oss":
        config = transformers.GptOssConfig(intermediate_size=inter, num_local_experts=num_experts,
                                           layer_types=["full_attention"] * 2, **common)
        model_class = transformers.GptOssForCausalLM
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            intermediate_size=4 * inter, moe_intermediate_size=inter, n_routed_experts=num_experts,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            **{**common, "num_key_value_heads": 4, "head_dim": 8})  # MLA: heads of 8 + 8, the rotary's 8
        model_class = transformers.DeepseekV3ForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=inter, num_local_experts=num_experts, **common)
        model_class = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=4 * inter, moe_intermediate_size=inter,
                                             num_experts=num_experts, **common)
        model_class = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = model_class(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return model
