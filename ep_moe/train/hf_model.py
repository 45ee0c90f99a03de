"""A Hugging Face MoE causal LM as the trainer's model (``model.hf``), its experts run by ep_moe.

``--hf-model DIR`` (``[model] hf = "DIR"``) names a local folder written by transformers'
``save_pretrained``: its ``config.json``, and optionally safetensors weights (fine-tuning;
without them the model starts from the config's random initialisation, seeded alike on
every rank) and a tokenizer (needed for text data). Any causal-LM family whose experts
transformers routes through its experts interface works (Qwen3-MoE, GPT-OSS, Mixtral,
DeepSeek-V3, OLMoE, GLM-4.5, ...): :func:`inspect_hf_model` checks that before any process
group starts, :func:`build_hf_model` builds it split over the EP group
(``ep_moe.integrations.transformers``: each rank reads only its own experts from the
checkpoint), and :class:`HFCausalLM` gives the trainer what it asks of a model (token ids
-> logits, the router's auxiliary loss, the tokens per expert) and writes the trained
model back as an HF folder (:meth:`HFCausalLM.export`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ep_moe.train.config import ModelSize
from ep_moe.train.errors import ConfigError
from ep_moe.train.tokens import tokenizer_files

_NOT_ARCHITECTURE = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
                               "use_cache", "output_router_logits", "_experts_implementation",
                               "experts_implementation", "_attn_implementation_autoset"})
"""``config.json`` keys that do not change the model's tensors (left out of the checkpoint's record)."""


@dataclass(frozen=True)
class HFModelSpec:
    """What the trainer knows of an HF model folder before building it."""

    path: str
    config: Any
    """The folder's ``transformers.PretrainedConfig``."""
    model_class: type
    """The family's causal-LM class (``Qwen3MoeForCausalLM``, ...)."""
    num_experts: int
    """Experts of every MoE layer (the EP size must divide it)."""
    has_weights: bool
    """The folder holds safetensors weights (fine-tune), else the model starts from its init."""
    size: ModelSize
    """Its parameters, counted on the meta device, for the trainer's memory check."""

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: token ids must stay below."""
        return int(self.config.get_text_config().vocab_size)

    @property
    def max_positions(self) -> Optional[int]:
        """The longest sequence the config declares, if it declares one."""
        return getattr(self.config.get_text_config(), "max_position_embeddings", None)

    def architecture(self) -> dict[str, Any]:
        """The config's values that shape the tensors, for checkpoints to tell models apart."""
        return {k: v for k, v in sorted(self.config.to_dict().items()) if k not in _NOT_ARCHITECTURE}


def _transformers():
    """``(transformers, ep_moe.integrations.transformers)``, or a ConfigError naming the install."""
    try:
        import transformers

        import ep_moe.integrations.transformers as ep_hf
    except ImportError as exc:
        raise ConfigError(f"model.hf needs the transformers extra ({exc}): "
                          "pip install 'ep-moe[transformers]'") from None
    return transformers, ep_hf


def _safetensors_weights(folder: Path) -> bool:
    """Whether ``folder`` holds safetensors weights; a ConfigError when it holds weights in
    another format only (ep_moe reads each rank's experts from safetensors)."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return True
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    if others:
        raise ConfigError(f"model.hf={str(folder)!r} holds weights as {', '.join(others[:3])}, not safetensors: "
                          "save the model with transformers' save_pretrained (safetensors, its default) and pass "
                          "that folder")
    return False


def inspect_hf_model(path: str) -> HFModelSpec:
    """Read and check the HF folder ``path`` without building the model (its parameters on
    the meta device): a ConfigError, naming ``model.hf`` and the fix, for a folder without
    ``config.json``, a family with no causal-LM class or no MoE layers, experts ep_moe
    refuses (``ep_moe.integrations.transformers.unsupported_reason``), or weights that are
    not safetensors. Its parameters are counted there (``HFModelSpec.size``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"model.hf={path!r} is not a folder: pass a Hugging Face model folder (config.json, "
                          "and safetensors weights to fine-tune)")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.hf={path!r} has no config.json: pass the folder transformers' save_pretrained "
                          "wrote (config.json, and safetensors weights to fine-tune)")
    transformers, ep_hf = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.hf={path!r}: transformers {transformers.__version__} cannot read its config.json "
                          f"({first}); check the file, or upgrade transformers for a newer family") from None
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None:
        raise ConfigError(f"model.hf={path!r} is a {config.model_type!r} model, which has no causal-LM class in "
                          "transformers: the trainer trains causal language models")
    with torch.device("meta"):
        model = model_class(config)
    modules = ep_hf.experts_modules(model)
    if not modules:
        raise ConfigError(f"model.hf={path!r} is a {config.model_type!r} model without MoE layers (no experts "
                          "module transformers routes through its experts interface); the trainer trains "
                          "mixture-of-experts models: pass one such as Qwen3-MoE, GPT-OSS, Mixtral or DeepSeek-V3")
    for name, module in modules:
        reason = ep_hf.unsupported_reason(module)
        if reason is not None:
            raise ConfigError(f"model.hf={path!r}: ep_moe cannot run the experts of this {config.model_type!r} "
                              f"model ({name}: {reason})")
    counts = sorted({int(module.down_proj.shape[0]) for _, module in modules})
    if len(counts) != 1:
        raise ConfigError(f"model.hf={path!r} has MoE layers of {counts} experts; the trainer splits models "
                          "whose MoE layers have one expert count")
    has_weights = _safetensors_weights(folder)
    experts = sum(p.numel() for _, module in modules for p in module.parameters())
    head = model.get_output_embeddings()
    vocab = int(head.weight.shape[0]) if head is not None else int(config.get_text_config().vocab_size)
    size = ModelSize(experts=experts, dense=sum(p.numel() for p in model.parameters()) - experts, vocab_size=vocab,
                     built_whole=not has_weights)
    return HFModelSpec(path=path, config=config, model_class=model_class, num_experts=counts[0],
                       has_weights=has_weights, size=size)


class HFCausalLM(nn.Module):
    """An HF causal LM as the trainer's model: token ids [B, L] -> logits [B, L, V].

    The router's load-balancing loss is the family's own (``output_router_logits`` and
    ``router_aux_loss_coef`` in ``config.json``), weighted by that coefficient; families
    without one (DeepSeek-V3 balances with a bias) add none."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        config = hf_model.config
        self.aux_loss_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        self.router_loss = bool(getattr(config, "output_router_logits", False)) and self.aux_loss_coef > 0
        self._aux_loss: Optional[torch.Tensor] = None

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        extra = {"output_router_logits": True} if self.router_loss else {}
        out = self.hf(input_ids=tokens_BL, use_cache=False, **extra)
        aux = getattr(out, "aux_loss", None)
        self._aux_loss = None if aux is None else self.aux_loss_coef * aux
        return out.logits

    def aux_loss(self) -> torch.Tensor:
        """The weighted router loss of the last forward (0 when the family has none)."""
        if self._aux_loss is not None:
            return self._aux_loss
        return torch.zeros((), device=self.hf.get_input_embeddings().weight.device)

    def expert_load(self) -> torch.Tensor:
        """[num_MoE_layers, E] tokens per global expert of the last forward, this rank's tokens."""
        from ep_moe.integrations.transformers import expert_load

        return expert_load(self.hf)

    def gemm_problems(self) -> list:
        """The experts' grouped GEMMs in the compute dtype (autocast's where it is on), for
        ``ep_moe.autotune.warmup``."""
        from ep_moe.experts import compute_dtype
        from ep_moe.integrations.transformers import experts_modules, gemm_problems

        weight = experts_modules(self.hf)[0][1].down_proj
        top_k = int(self.hf.config.get_text_config().num_experts_per_tok)
        return gemm_problems(self.hf, top_k, compute_dtype(weight))

    def decoder_layers(self) -> nn.ModuleList:
        """The transformer blocks (compiled one by one under ``training.compile``)."""
        layers = getattr(getattr(self.hf, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ConfigError(f"{type(self.hf).__name__} keeps its decoder layers elsewhere than .model.layers; "
                              "set training.compile=false")
        return layers

    def enable_activation_checkpointing(self) -> None:
        """Recompute each decoder layer in the backward (transformers' own, non-reentrant)."""
        self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def export(self, path: str, tokenizer_dir: Optional[str] = None) -> None:
        """Write the model as an HF folder plain transformers loads (experts gathered over
        their EP group, FSDP shards over theirs; a collective: call on every rank), with the
        tokenizer files of ``tokenizer_dir`` (:func:`tokenizer_files`) copied beside it.
        Rank 0 writes."""
        import ep_moe.integrations.transformers as ep_hf

        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if any(isinstance(p, DTensor) for p in self.hf.parameters()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # every rank gets the full tensors (its experts' rows), which gather_experts completes
            state = get_model_state_dict(self.hf, options=StateDictOptions(full_state_dict=True))
            state = ep_hf.gather_experts(self.hf, state)
        else:
            state = ep_hf.full_state_dict(self.hf)
        if rank0:
            os.makedirs(path, exist_ok=True)
            self.hf.save_pretrained(path, state_dict=state)
            for name in tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else ():
                shutil.copyfile(Path(tokenizer_dir) / name, Path(path) / name)
        if dist.is_initialized():
            dist.barrier()


def build_hf_model(spec: HFModelSpec, ep_group, *, device: torch.device, dtype: torch.dtype, seed: int,
                   dispatch: str = "auto", backend: str = "auto",
                   all_gather_row_bound: Optional[float] = None, expert_precision: str = "bf16") -> HFCausalLM:
    """The model of ``spec`` split over ``ep_group`` (None: EP=1), on ``device`` with
    parameters in ``dtype``: each rank reads its own experts from the folder's weights, or,
    without weights, builds the whole model on ``device`` from ``seed`` (alike on every rank
    of a device type) and keeps its experts. ``dispatch``, ``backend``,
    ``all_gather_row_bound`` and ``expert_precision`` (``"fp8"``: e4m3 expert GEMMs) are the
    ``[moe]`` keys of an HF model (``config.HF_MOE_KEYS``), as
    ``ep_moe.integrations.transformers.expert_parallel`` takes them. Call on every rank of
    the EP group."""
    import ep_moe.integrations.transformers as ep_hf

    options = dict(dispatch=dispatch, backend=backend, all_gather_row_bound=all_gather_row_bound,
                   expert_precision=expert_precision)
    if spec.has_weights:
        hf = ep_hf.from_pretrained(spec.model_class, spec.path, ep_group, dtype=dtype, device=device, **options)
    else:  # built on the device (its initialisation is the slow part), alike on every rank
        torch.manual_seed(seed)
        with device:
            hf = spec.model_class._from_config(spec.config, dtype=dtype)
        ep_hf.expert_parallel(hf, ep_group, **options)
    hf.config.use_cache = False
    return HFCausalLM(hf)
