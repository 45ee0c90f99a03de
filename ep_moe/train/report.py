"""What rank 0 tells the user about a run: the config in a few lines at the start (the whole
of it is in every checkpoint's ``meta.json``), and at the end a summary (wall time, mean
tokens/s, final losses, the last checkpoint, the metrics file) with the loss curve drawn
beside the metrics file (``<metrics>.png``) where matplotlib is installed."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("ep_moe.train")


def config_lines(job: Any, world_size: int, ep_size: int, hf_model_type: Optional[str] = None,
                 num_experts: Optional[int] = None) -> list[str]:
    """The run's config as a few readable lines: the model, the optimisation, the layout,
    the data and where checkpoints go."""
    t, c, d = job.training, job.checkpoint, job.data
    if job.model.hf:
        model = f"model: {job.model.hf} ({hf_model_type}, {num_experts} experts, ep_moe experts)"
    else:
        m, moe = job.model, job.moe_config()
        model = (f"model: built-in, {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, vocab {m.vocab_size}; "
                 f"{moe.num_experts} experts top-{moe.top_k} of width {moe.intermediate_size}")
    regime = "pure bf16" if t.param_dtype == "bfloat16" else (
        "fp32 master weights under bf16 autocast" if t.dtype == "bfloat16" else "fp32")
    checkpoints = "none" if c.interval < 0 else (f"{c.dir} every {c.interval or t.steps} steps ({c.format}; "
                                                 "each one's meta.json holds the whole config)")
    return [model,
            f"training: {t.steps} steps of {t.batch_size} x {t.seq_len} tokens per rank, lr {t.lr:g} "
            f"(warm-up {t.warmup_steps}), {regime}, clip {t.grad_clip:g}",
            f"layout: world {world_size}, EP {ep_size}{', FSDP' if job.parallel.fsdp else ''}, "
            f"dispatch {job.moe.get('dispatch', 'auto')}",
            f"data: {d.path or 'the embedded corpus'}; checkpoints: {checkpoints}"]


@dataclass
class RunSummary:
    """What the end-of-run summary reports, gathered while training (rank 0)."""

    started: float = field(default_factory=time.perf_counter)
    first_step: int = 0
    steps: int = 0
    train_seconds: float = 0.0
    """Time in training steps (evaluation and saving left out)."""
    loss: Optional[float] = None
    val_loss: Optional[float] = None
    checkpoint: Optional[str] = None

    def report(self, tokens_per_step: int, metrics_file: str) -> None:
        """Log the summary and draw the loss curve beside ``metrics_file`` (if any)."""
        wall = time.perf_counter() - self.started
        rate = self.steps * tokens_per_step / self.train_seconds if self.train_seconds > 0 else 0.0
        parts = [f"run done: steps {self.first_step + 1}-{self.first_step + self.steps} in {wall:.1f} s, "
                 f"{rate:,.0f} tokens/s in the steps"]
        if self.loss is not None:
            parts.append(f"final loss {self.loss:.4f}")
        if self.val_loss is not None:
            parts.append(f"val loss {self.val_loss:.4f}")
        parts.append(f"last checkpoint {self.checkpoint or 'none'}")
        if metrics_file:
            plot = plot_losses(Path(metrics_file))
            parts.append(f"metrics {metrics_file}" + (f", loss curve {plot}" if plot else ""))
        logger.info("; ".join(parts))


def plot_losses(metrics_file: Path) -> Optional[Path]:
    """The training and validation losses of a metrics file (JSON lines) as
    ``<metrics_file>.png``; None when matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("no loss curve: matplotlib is not installed (pip install matplotlib)")
        return None
    records = []
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(*zip(*train), label="training loss")
    if val:
        ax.plot(*zip(*val), marker="o", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(metrics_file.name, fontsize=9)
    ax.legend()
    fig.tight_layout()
    out = metrics_file.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
