"""A small decoder-only language model whose feed-forward blocks are ep_moe ``MoELayer``s.

The layout follows Qwen3-MoE at toy scale: pre-norm blocks with RMSNorm, grouped-query
causal attention with rotary position embeddings and RMSNorm on queries and keys, and a
routed MoE in place of every MLP. Nothing here imports ``torch.distributed``: the expert
parallel group is handed to each ``MoELayer`` by whoever builds the model.

Legend: B batch, L sequence length, D model dim, Hq / Hkv query / key-value heads,
Dh head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ep_moe import MoEConfig, MoELayer
from ep_moe.layer import expert_load, moe_aux_loss


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the transformer around the MoE layers (those are set by ``[moe]``)."""

    hf: str = ""
    """A Hugging Face MoE model folder (``config.json``, optionally safetensors weights and a
    tokenizer): train that model, its experts run by ep_moe (``launch/hf_model.py``), instead
    of this built-in one. Its config.json then sets the shape: no other ``[model]`` key, and
    ``[moe]`` takes only ``dispatch``, ``backend`` and ``all_gather_row_bound``."""
    vocab_size: int = 256
    """Token ids are in [0, vocab_size); 256 covers byte-level text."""
    dim: int = 128
    """Model (hidden) dimension; also the MoE layer's ``hidden_size``."""
    n_layers: int = 4
    """Transformer blocks, each with one attention and one MoE layer."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means ``n_heads`` (plain MHA)."""
    head_dim: int = 0
    """Per-head dimension; 0 means ``dim // n_heads``. Qwen3 sets it apart from dim."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qk_norm: bool = True
    """RMSNorm on each head's queries and keys before RoPE, as in Qwen3."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    init_std: float = 0.02
    """Std of the normal init of embeddings and dense projections."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if self.n_kv_heads < 0 or self.head_dim < 0:
            raise ValueError("model.n_kv_heads and model.head_dim must be >= 0 (0 picks the default)")
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                             f"change one or set model.head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"the head dim ({self.head_size}) must be even for rotary embeddings")

    @property
    def kv_heads(self) -> int:
        """Key/value heads after applying the default."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Per-head dimension after applying the default."""
        return self.head_dim or self.dim // self.n_heads


def _rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, [max_seq_len, Dh/2] each."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_size, 2, dtype=torch.float64) / cfg.head_size)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x_BHLd: torch.Tensor, cos_Lh: torch.Tensor, sin_Lh: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + Dh/2) by position-dependent angles (the NeoX/Llama layout)."""
    x1, x2 = x_BHLd.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos_Lh - x2 * sin_Lh, x2 * cos_Lh + x1 * sin_Lh), dim=-1)
    return rotated.type_as(x_BHLd)


class Attention(nn.Module):
    """Causal grouped-query self-attention with optional QK-norm and RoPE."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x_BLD: torch.Tensor, cos_Lh: torch.Tensor, sin_Lh: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        q = self.q_norm(self.wq(x_BLD).view(B, L, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x_BLD).view(B, L, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x_BLD).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos_Lh, sin_Lh), _apply_rope(k, cos_Lh, sin_Lh)
        out_BHLd = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out_BHLd.transpose(1, 2).reshape(B, L, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + moe(norm(h))."""

    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, ep_group) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoELayer(moe_cfg, ep_group=ep_group)

    def forward(self, x_BLD: torch.Tensor, cos_Lh: torch.Tensor, sin_Lh: torch.Tensor) -> torch.Tensor:
        h_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), cos_Lh, sin_Lh)
        # The MoE layer takes input in its parameter dtype (that of the residual stream);
        # under autocast the norm may come back in bf16.
        return h_BLD + self.moe(self.moe_norm(h_BLD).to(h_BLD.dtype))


class MoETransformer(nn.Module):
    """Token ids [B, L] -> next-token logits [B, L, V]. The MoE auxiliary losses of the last
    forward are read with :meth:`aux_loss`."""

    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, ep_group=None) -> None:
        super().__init__()
        if moe_cfg.hidden_size != cfg.dim:
            raise ValueError(f"moe hidden_size={moe_cfg.hidden_size} must equal model.dim={cfg.dim}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe_cfg, ep_group) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_dense_weights()
        self.checkpoint_blocks = False
        """Recompute each block in the backward (non-reentrant activation checkpointing)."""
        self.graphed_blocks = None
        """The blocks captured in CUDA graphs (``launch/graphs.py``), replayed in training forwards."""

    def _init_dense_weights(self) -> None:
        """Normal(0, init_std) for embeddings and projections, with the residual-stream
        outputs (``wo``) scaled by 1/sqrt(2 * n_layers) as in GPT-2. MoE layers keep their
        own initialisation."""
        std = self.cfg.init_std
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)
        for block in self.layers:
            for proj in (block.attn.wq, block.attn.wk, block.attn.wv):
                nn.init.normal_(proj.weight, std=std)
            nn.init.normal_(block.attn.wo.weight, std=std / (2 * self.cfg.n_layers) ** 0.5)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        L = tokens_BL.shape[1]
        if L > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos_Lh, sin_Lh = self.rope_cos[:L], self.rope_sin[:L]
        x_BLD = self.tok_embeddings(tokens_BL)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        graphed = self.graphed_blocks if self.training and torch.is_grad_enabled() else None
        for i, block in enumerate(self.layers):
            if graphed is not None:
                x_BLD = graphed(i, x_BLD, cos_Lh, sin_Lh)
            elif recompute:
                x_BLD = checkpoint(block, x_BLD, cos_Lh, sin_Lh, use_reentrant=False)
            else:
                x_BLD = block(x_BLD, cos_Lh, sin_Lh)
        return self.output(self.norm(x_BLD))

    def aux_loss(self) -> torch.Tensor:
        """The MoE layers' auxiliary losses of the last forward (``ep_moe.layer.moe_aux_loss``)."""
        return moe_aux_loss(self)

    def expert_load(self) -> torch.Tensor:
        """[n_layers, E] tokens per global expert of the last forward, this rank's tokens."""
        return expert_load(self)

    @torch.no_grad()
    def generate(self, prompt_L: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of one prompt, [L] -> [L + max_new_tokens]. Under expert
        parallelism every rank of the EP group must call this with the same prompt, since
        each forward runs the group's all-to-alls."""
        tokens_1L = prompt_L.unsqueeze(0)
        for _ in range(max_new_tokens):
            logits_V = self(tokens_1L[:, -self.cfg.max_seq_len:])[0, -1]
            tokens_1L = torch.cat((tokens_1L, logits_V.argmax().view(1, 1)), dim=1)
        return tokens_1L[0]
