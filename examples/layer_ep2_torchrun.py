"""The MoE layer at EP=2 under torchrun: experts split over two ranks.

    torchrun --nproc-per-node 2 examples/layer_ep2_torchrun.py     # CPU: gloo; GPUs: NCCL
    torchrun --nproc-per-node 4 examples/layer_ep2_torchrun.py     # 2 EP groups of 2 ranks

Each rank holds E / 2 of the experts and trains on its own tokens; the layer sends each
token to the rank of its experts and back. Dense weights (the router, the Linears) are
replicated, so every rank seeds alike before building the model. After ``backward``,
``sync_gradients`` averages the dense gradients over all ranks and the expert gradients
over the ranks that hold the same experts (the expert-data-parallel group).
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ep_moe import MoEConfig, MoELayer
from ep_moe.layer import moe_aux_loss
from ep_moe.parallel import build_ep_groups, sync_gradients

HIDDEN, EXPERTS, EP_SIZE = 64, 8, 2


class Model(nn.Module):
    """Linear, then a residual MoE layer, then Linear."""

    def __init__(self, moe: MoELayer) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(HIDDEN, HIDDEN), moe, nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(h))


def main() -> None:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        # EP groups of EP_SIZE consecutive ranks; ranks at the same place in each group form
        # an expert-data-parallel (EDP) group of replicas (world 4: EP [0,1] [2,3], EDP [0,2] [1,3]).
        groups = build_ep_groups(ep_size=EP_SIZE)
        torch.manual_seed(0)  # the same on every rank: replicated weights start equal
        config = MoEConfig(hidden_size=HIDDEN, intermediate_size=128, num_experts=EXPERTS, top_k=2)
        moe = MoELayer(config, ep_group=groups.ep_group, device=device)
        model = Model(moe).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

        # A toy task (learn a fixed linear map): the same map on every rank, its own tokens per rank.
        target_map = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
        tokens = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(20):
            x = torch.randn(64, HIDDEN, generator=tokens).to(device)
            task_loss = F.mse_loss(model(x), x @ target_map / HIDDEN**0.5)
            (task_loss + moe_aux_loss(model)).backward()
            sync_gradients(model, groups.ep_group, groups.edp_group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean_loss = task_loss.detach().reshape(1)
            dist.all_reduce(mean_loss)  # for the log: the mean over ranks
            losses.append(mean_loss.item() / world)

        if rank == 0:
            print(f"rank 0 holds experts 0-{moe.num_local_experts - 1} of {EXPERTS}; dispatch: {moe.dispatch}")
            print(f"layer_ep2: world {world}, EP {groups.ep_size}, {device.type}, "
                  f"task loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
