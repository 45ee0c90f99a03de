"""What the trainer's fault probes build: the tiny built-in model's config, its layout of
one, a model with AdamW state, and a tiny Hugging Face model folder with a tokenizer and text."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "moe.num_experts=4", "--set", "moe.intermediate_size=32", "--set", "moe.top_k=2",
        "--set", "training.batch_size=2", "--set", "training.seq_len=16", "--set", "training.device='cpu'",
        "--set", "logging.eval_interval=0", "--set", "logging.progress_bar=false",
        "--set", "logging.sample_prompt=''", "--set", "data.synthetic_bytes=8192"]
"""The tiny built-in model on the CPU, quiet (no eval, no progress bar, no sample), on a small
synthetic corpus."""


def layout(train):
    """The checkpoint layout of one process (rank 0 of 1, EP 1)."""
    return train.checkpoint.Layout(rank=0, world_size=1, ep_rank=0, ep_size=1)


def build(train, *extra: str):
    """The job of ``TINY`` plus ``extra``, its model (seed 0) and AdamW with state (one step of
    small gradients)."""
    job = train.config.parse_args([*TINY, *extra])
    torch.manual_seed(0)
    net = train.model.MoETransformer(job.model, job.moe_config(), None)
    optimizer = train.trainer.build_optimizer(net, job.training, torch.device("cpu"))
    for p in net.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return job, net, optimizer


def tiny_hf_model(tmp_path: Path, documents: int = 100) -> SimpleNamespace:
    """A tiny random Qwen3-MoE saved in ``tmp_path/qwen3_moe`` with a tokenizer trained on sample
    text, and a jsonl corpus of ``documents`` documents: ``(folder, corpus)``. Needs transformers."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from hf_models import tiny_model
        from text_data import sample_documents, train_tokenizer, write_jsonl
    finally:
        sys.path.remove(str(REPO / "tests"))
    folder = tmp_path / "qwen3_moe"
    tiny_model("qwen3_moe", vocab=320, std=0.05).save_pretrained(folder)
    train_tokenizer(folder, sample_documents(60, seed=1))
    corpus = write_jsonl(tmp_path / "docs.jsonl", sample_documents(documents, seed=2))
    return SimpleNamespace(folder=folder, corpus=corpus)
