"""Resolve the grouped GEMM kernel configs once with ``ep_moe.autotune.warmup``, then train.

    python examples/warmup_and_train.py

``warmup(model)`` finds every MoE layer's two grouped GEMMs and takes their configs from the
cache (``~/.cache/ep_moe/autotune``, or ``$EP_MOE_CACHE_DIR``), else from the configs
shipped for this GPU, else by tuning them now and writing the cache; run it twice and the
second run reads the cache. Call it before the first step, under the autocast of training
(configs depend on the dtype), with the tokens per rank of a step. Under torch.distributed
call it on every rank: rank 0 resolves and sends its choice, so all ranks run the same
kernels. ``ep-moe autotune --model NAME`` fills the cache ahead of a job.

On a CPU the kernels run in the Triton interpreter and the tuner times only its first
round of candidates, to keep this quick; on a GPU it runs in full.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing ep_moe (and Triton)

from ep_moe import MoEConfig, MoELayer  # noqa: E402
from ep_moe.autotune import Tuner, warmup  # noqa: E402
from ep_moe.layer import moe_aux_loss  # noqa: E402

HIDDEN, TOKENS = 32, 64


class Model(nn.Module):
    """Linear, then a residual MoE layer, then Linear."""

    def __init__(self, moe: MoELayer) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(HIDDEN, HIDDEN), moe, nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(h))


def main() -> None:
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    # backend="triton": the Triton kernels also on a CPU (interpreted), where "auto" picks PyTorch
    moe = MoELayer(MoEConfig(hidden_size=HIDDEN, intermediate_size=64, num_experts=4, top_k=2, backend="triton"))
    model = Model(moe).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Training in bf16 on a GPU: warm up under the same autocast.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu)

    tuner = None if on_gpu else Tuner(refine_top=0, confirm_rounds=0, progress=False)
    with autocast:
        resolved = warmup(model, num_tokens=TOKENS, tuner=tuner)
    for problem, configs in resolved.items():
        print(f"{problem.projection}: {problem.num_local_experts} experts, [rows, {problem.k}] x "
              f"[{problem.k}, {problem.n}], configs from {configs.source}")

    target_map = torch.randn(HIDDEN, HIDDEN, device=device) / HIDDEN**0.5
    losses = []
    for _ in range(10):
        x = torch.randn(TOKENS, HIDDEN, device=device)
        with autocast:
            y = model(x)
        task_loss = F.mse_loss(y.float(), x @ target_map)
        (task_loss + moe_aux_loss(model)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(task_loss.item())
    sources = ", ".join(sorted({c.source for c in resolved.values()}))
    print(f"warmup_and_train: configs from {sources}, task loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
