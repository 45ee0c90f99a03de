"""A small decoder-only language model whose feed-forward blocks are ep_moe ``MoELayer``s.

The layout follows Qwen3-MoE at toy scale: pre-norm blocks with RMSNorm, grouped-query
causal attention with rotary position embeddings and RMSNorm on queries and keys, and a
routed MoE in place of every MLP. Nothing here imports ``torch.distributed``: the expert
parallel group is handed to each ``MoELayer`` by whoever builds the model.

Legend: B batch, L sequence length, D model dim, Hq / Hkv query / key-value heads,
Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ep_moe import MoEConfig, MoELayer
from ep_moe.layer import expert_load, moe_aux_loss


def _number_text(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class Range:
    """The values one numeric field of the trainer's config takes: a finite number (an
    int where ``integer``) from ``lo`` to ``hi``. The trainer's config dataclasses check
    every numeric field against one table of these (:data:`MODEL_RANGES` here,
    ``config.RANGES``), and the error names the key, the value, the range and the fix:
    ``model.rope_theta=-1.0 must be > 1; allowed: 1 < model.rope_theta <= 1e+12; ...``."""

    lo: float
    hi: Optional[float] = None
    """None: no upper bound (the value must still be finite)."""
    lo_open: bool = False
    """``lo`` itself is outside the range."""
    integer: bool = False
    below: str = ""
    """What the error says of a value below the range; default ``must be >= lo`` (``> lo``)."""
    natural: bool = False
    """``[lo, hi]`` is what the field means (a ratio, a beta): either side says ``must be in [lo, hi]``."""
    fix: str = ""
    """What to do, appended to the error."""

    def allowed(self, key: str) -> str:
        """The range as the error writes it: ``0 < training.lr <= 10``."""
        high = f" <= {_number_text(self.hi)}" if self.hi is not None else " (finite)"
        return f"{_number_text(self.lo)} {'<' if self.lo_open else '<='} {key}{high}"

    def problem(self, key: str, value: Any) -> Optional[str]:
        """What is wrong with ``value`` (a pair is checked element by element), None if nothing."""
        tail = f"; allowed: {self.allowed(key)}" + (f"; {self.fix}" if self.fix else "")
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
                return f"must be {'an integer' if self.integer else 'a number'}{tail}"
            if not math.isfinite(v):
                return f"must be finite (not NaN or infinite){tail}"
            within = f"must be in [{_number_text(self.lo)}, {_number_text(self.hi)}]" if self.natural else ""
            if v < self.lo or (self.lo_open and v == self.lo):
                return (within or self.below or f"must be {'>' if self.lo_open else '>='} "
                        f"{_number_text(self.lo)}") + tail
            if self.hi is not None and v > self.hi:
                return (within or f"must be <= {_number_text(self.hi)}") + tail
        return None

    def check(self, key: str, value: Any) -> None:
        """Raise ``ValueError("{key}={value} {problem}")`` for a value outside the range."""
        problem = self.problem(key, value)
        if problem is not None:
            raise ValueError(f"{key}={value} {problem}")


def check_ranges(config: Any, section: str, ranges: dict[str, Range]) -> None:
    """Check every field of ``config`` (the dataclass of ``[section]``) that ``ranges``
    (keys ``section.field``) has a rule for, in the table's order."""
    for key, rule in ranges.items():
        name = key.partition(".")[2]
        if key.startswith(f"{section}.") and hasattr(config, name):
            rule.check(key, getattr(config, name))


_POSITIVE = "must be positive"
MODEL_RANGES: dict[str, Range] = {
    "model.vocab_size": Range(1, 2**24, integer=True, below=_POSITIVE,
                              fix="the largest tokenizers have a few hundred thousand ids; set the tokenizer's "
                                  "(every id of the data must be below it)"),
    "model.dim": Range(1, 2**16, integer=True, below=_POSITIVE),
    "model.n_layers": Range(1, 1024, integer=True, below=_POSITIVE),
    "model.n_heads": Range(1, 1024, integer=True, below=_POSITIVE),
    "model.n_kv_heads": Range(0, 1024, integer=True, below="must be >= 0 (0: model.n_heads)"),
    "model.head_dim": Range(0, 4096, integer=True, below="must be >= 0 (0: model.dim // model.n_heads)"),
    "model.max_seq_len": Range(1, 2**24, integer=True, below=_POSITIVE,
                               fix="the rotary tables hold max_seq_len x head_dim angles: set the longest sequence "
                                   "the model trains on or samples"),
    "model.rope_theta": Range(1, 1e12, lo_open=True,
                              fix="the usual bases are 1e4 to 1e6; at 1 or below the rotary frequencies do not decay "
                                  "and the positions blur (a negative one makes NaN angles)"),
    "model.norm_eps": Range(0, 1, lo_open=True, fix="the usual epsilon is 1e-6 to 1e-5"),
    "model.init_std": Range(0, 1, lo_open=True, fix="the usual std is 0.02"),
}
"""One range per numeric field of :class:`ModelConfig`, checked on construction: a value
that would fail far from its cause (a NaN ``init_std`` in ``nn.init.normal_``, a negative
``rope_theta`` or NaN ``norm_eps`` as a non-finite loss at step 1 blamed on
``training.lr``, a vocabulary of 2**40 ids as a raw allocator error) is named here."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the transformer around the MoE layers (those are set by ``[moe]``)."""

    hf: str = ""
    """A Hugging Face MoE model folder (``config.json``, optionally safetensors weights and a
    tokenizer): train that model, its experts run by ep_moe (``ep_moe/train/hf_model.py``), instead
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
        check_ranges(self, "model", MODEL_RANGES)
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                             f"change one or set model.head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.kv_heads}")
        if self.head_size % 2:
            source = f"model.head_dim={self.head_dim}" if self.head_dim else (
                f"model.dim // model.n_heads = {self.dim} // {self.n_heads} = {self.head_size}")
            raise ValueError(f"the head dim ({source}) must be even for rotary embeddings: set model.head_dim to an "
                             "even number")

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
        """The blocks captured in CUDA graphs (``ep_moe/train/graphs.py``), replayed in training forwards."""

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
