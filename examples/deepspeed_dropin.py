"""ep_moe's layer in a DeepSpeed model (needs pip install 'ep-moe[deepspeed]').

``ep_moe.integrations.deepspeed.MoE`` where the model used ``deepspeed.moe.layer.MoE``,
trained by the DeepSpeed engine.

    torchrun --nproc-per-node 2 examples/deepspeed_dropin.py     # CPU (gloo) or 2 GPUs (NCCL)
    deepspeed --num_gpus 2 examples/deepspeed_dropin.py

The drop-in takes DeepSpeed's constructor arguments, routes with DeepSpeed's gate
(capacity and token dropping included) and returns its ``(output, l_aux, exp_counts)``; the
experts, the token exchange and the kernels are ep_moe's. The engine treats it as one of its
own MoE layers (expert gradients averaged over the expert-data-parallel group, DeepSpeed's
checkpoint keys). For a model already built with DeepSpeed's layers,
``replace_deepspeed_moe(model)`` swaps them and copies the weights.
"""

import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import deepspeed  # before the model is built, so the engine recognises the layers
except ImportError:
    raise SystemExit("examples/deepspeed_dropin.py needs DeepSpeed: pip install 'ep-moe[deepspeed]'") from None
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from ep_moe.integrations.deepspeed import MoE  # instead of: from deepspeed.moe.layer import MoE

HIDDEN, EXPERTS = 64, 8


class Expert(nn.Module):
    """A SwiGLU expert with Hugging Face names; the drop-in reads its shape and activation."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, 128, bias=False)
        self.up_proj = nn.Linear(HIDDEN, 128, bias=False)
        self.down_proj = nn.Linear(128, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Model(nn.Module):
    """Linear, a residual MoE layer with experts split over ``ep_size`` ranks, Linear."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        # DeepSpeed's arguments; drop_tokens=False makes it dropless (DeepSpeed drops tokens
        # past each expert's capacity by default)
        self.moe = MoE(HIDDEN, Expert(), num_experts=EXPERTS, ep_size=ep_size, k=2, drop_tokens=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        y, l_aux, _exp_counts = self.moe(h)
        return self.out(h + y), l_aux


def main() -> None:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op when it starts
        # (about a minute); gloo's all-reduce does the job for this small model.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same on every rank: replicated weights start equal
    model = Model(ep_size=world)
    # DeepSpeed's MoE parameter groups: expert weights apart from the rest, as for its own layer.
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "params"})
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=3e-3),
                                      config={"train_micro_batch_size_per_gpu": 64})
    device = next(engine.module.parameters()).device

    target_map = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
    tokens = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    losses = []
    for _ in range(20):
        x = torch.randn(64, HIDDEN, generator=tokens).to(device)
        y, l_aux = engine(x)
        task_loss = F.mse_loss(y, x @ target_map / HIDDEN**0.5)
        engine.backward(task_loss + 0.01 * l_aux)
        engine.step()
        losses.append(task_loss.item())
    if rank == 0:
        print(f"deepspeed_dropin: world {world}, ep_size {world}, engine has MoE layers: "
              f"{engine.has_moe_layers}, rank 0 task loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
