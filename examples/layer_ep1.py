"""The MoE layer at EP=1: build it, run forwards, add its auxiliary loss, backward, step.

    python examples/layer_ep1.py

Every expert lives in this process, so no process group is needed (``ep_group=None``).
On a CPU the experts run PyTorch's reference grouped GEMM; on a GPU, ep_moe's Triton
kernels (``examples/warmup_and_train.py`` tunes them first).
"""

import torch
import torch.nn.functional as F
from torch import nn

from ep_moe import MoEConfig, MoELayer
from ep_moe.layer import expert_load, moe_aux_loss

HIDDEN = 64


class Block(nn.Module):
    """A pre-norm residual block whose feed-forward is the MoE layer."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        self.moe = MoELayer(config)  # ep_group=None: EP=1, all experts here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # 8 SwiGLU experts of width 128, each token routed to its top 2 (softmax router,
    # load-balancing aux loss): the defaults of everything else, see MoEConfig.
    config = MoEConfig(hidden_size=HIDDEN, intermediate_size=128, num_experts=8, top_k=2)
    model = nn.Sequential(Block(config), Block(config), nn.Linear(HIDDEN, HIDDEN)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # A toy task: learn a fixed random linear map of the tokens.
    target_map = torch.randn(HIDDEN, HIDDEN, device=device) / HIDDEN**0.5
    losses = []
    for _ in range(30):
        x = torch.randn(4, 16, HIDDEN, device=device)  # [batch, seq, H]: any leading shape
        y = model(x)  # same shape and dtype as x
        task_loss = F.mse_loss(y, x @ target_map)
        loss = task_loss + moe_aux_loss(model)  # aux (and z) losses of every MoE layer's last forward
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(task_loss.item())

    load = expert_load(model)  # [MoE layers, experts]: tokens routed to each expert, last forward
    print(f"tokens per expert in the last step, first layer: {load[0].tolist()}")
    print(f"layer_ep1: {device.type}, task loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
