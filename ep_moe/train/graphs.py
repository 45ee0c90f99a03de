"""CUDA graphs of the transformer blocks, forward and backward (``training.cuda_graphs``).

A small MoE model spends most of an eager step launching kernels: thousands of them, a few
microseconds of GPU work each. With expert parallelism every rank's GPU also waits for the
slowest rank's host at each exchange. Replaying each block's forward and backward as one
CUDA graph (``torch.cuda.make_graphed_callables``) takes the host out of the step; what is
left eager is the embedding, the output head, the loss, the gradient sync and the optimizer.

What graph capture needs, and how the trainer provides it:

- no host sync inside a block: EP=1, or a dispatch that never syncs (``all_gather``,
  ``all_gather_copy_engine``, and ``auto`` where it picks the all-gather);
  :func:`graphs_unsupported` names what blocks it otherwise;
- the same shapes every step: the trainer's fixed ``batch_size x seq_len``;
- autocast without its weight-cast cache (``cache_enabled=False``), which the trainer
  sets whenever graphs are on;
- the MoE auxiliary losses as graph outputs: the wrapper :class:`_BlockWithLosses` returns
  them beside the block's output, so they keep their gradient and still train the router;
  :meth:`GraphedBlocks.__call__` hands them to the layer's ``last_stats``, where
  :func:`ep_moe.layer.moe_aux_loss` reads them.

Evaluation, sampling and any call without autograd run the eager blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn



def graphs_unsupported(dispatch: str, device: torch.device, *, compile: bool,
                       activation_checkpointing: bool, fsdp: bool = False) -> Optional[str]:
    """Why the blocks cannot be captured in CUDA graphs, or None: ``dispatch`` is what the
    MoE layers run (``MoELayer.dispatch``: ``"local"`` at EP=1); ``fsdp``: the model is
    sharded with FSDP (``parallel.fsdp``)."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if fsdp:
        return ("parallel.fsdp=true: FSDP gathers each block's weights before it runs and frees them after, "
                "outside what a CUDA graph can capture")
    if dispatch == "all_to_all":
        return ("the MoE layers run dispatch='all_to_all', which syncs with the host in every layer (its "
                "split sizes); set moe.dispatch='all_gather' (or 'auto' where it picks the all-gather)")
    if compile:
        return "training.compile and CUDA graphs do not combine here; pick one"
    if activation_checkpointing:
        return "activation checkpointing recomputes blocks outside the captured graphs; pick one"
    return None


class _BlockWithLosses(nn.Module):
    """A block whose forward also returns its MoE layer's aux and z losses, so that a
    captured graph keeps them differentiable."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x_BLD: torch.Tensor, cos_Lh: torch.Tensor, sin_Lh: torch.Tensor):
        y_BLD = self.block(x_BLD, cos_Lh, sin_Lh)
        stats = self.block.moe.last_stats
        return y_BLD, stats.aux_loss, stats.z_loss


class GraphedBlocks:
    """The model's blocks captured forward and backward for inputs like ``sample_BLD``
    (one memory pool for all); call ``graphed(i, x, cos, sin)`` in place of
    ``model.layers[i](x, cos, sin)`` while training with autograd on.

    ``autocast`` is the context the trainer's forward runs under (without weight-cast cache);
    capture runs a few warm-up forwards and backwards first, which touch no ``.grad``."""

    def __init__(self, blocks: nn.ModuleList, sample_BLD: torch.Tensor, cos_Lh: torch.Tensor,
                 sin_Lh: torch.Tensor, autocast, warmup_iters: int = 3) -> None:
        self._blocks = list(blocks)
        wrappers = tuple(_BlockWithLosses(b) for b in self._blocks)
        samples = tuple((sample_BLD.detach().clone().requires_grad_(), cos_Lh, sin_Lh) for _ in wrappers)
        with autocast:
            self._graphed = torch.cuda.make_graphed_callables(wrappers, samples, num_warmup_iters=warmup_iters,
                                                              allow_unused_input=True)
        self.shape = tuple(sample_BLD.shape)

    def __call__(self, index: int, x_BLD: torch.Tensor, cos_Lh: torch.Tensor, sin_Lh: torch.Tensor) -> torch.Tensor:
        """Block ``index`` replayed; its MoE layer's ``last_stats`` then carry this replay's
        differentiable aux and z losses."""
        if tuple(x_BLD.shape) != self.shape:
            raise ValueError(f"the blocks were captured for inputs of shape {self.shape}, got {tuple(x_BLD.shape)}; "
                             "CUDA graphs need the same batch_size and seq_len every step")
        y_BLD, aux, z = self._graphed[index](x_BLD, cos_Lh, sin_Lh)
        moe = self._blocks[index].moe
        moe.last_stats = dataclasses.replace(moe.last_stats, aux_loss=aux, z_loss=z, with_autograd=True)
        return y_BLD
