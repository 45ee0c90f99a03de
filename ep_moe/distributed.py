"""What the floors of ep_moe above the kernels share about process groups: the size of a
group, the all-gather and reduce-scatter under their current torch names, the cross-rank
check that every rank built a layer alike, the group behind an ``ep_group`` argument, the
tag of expert parameters, and an FSDP-sharded expert tensor gathered whole.

It sits just above the kernels and the routing math and imports nothing else of ep_moe, so
the config, the experts, the dispatchers, the layer and the wrappers above it all import
from here (ARCHITECTURE.md, "Modules", has the floors).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

EXPERT_PARAM_ATTR = "_ep_moe_expert"


def group_size(group: Optional[ProcessGroup]) -> int:
    """Ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


# all_gather_into_tensor / reduce_scatter_tensor became all_gather_single /
# reduce_scatter_single in newer PyTorch (the old names warn there); same arguments
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@torch.compiler.disable  # a collective and a host read, once per layer
def check_same_config(config: Any, group: ProcessGroup, device: torch.device,
                      others: Optional[dict[str, Any]] = None) -> None:
    """Raise unless every rank of ``group`` passes the same ``config`` (a dataclass: the
    layer's :class:`ep_moe.config.MoEConfig`) and the same ``others`` (named values: the
    parameters' dtype, the input's width...): one small all-gather of digests and a host
    read; collective. Ranks whose settings differ (``top_k``, ``dispatch``, the hidden size
    of their input, ...) would exchange messages of different sizes, which aborts gloo and
    can hang NCCL; the error names what differs."""
    others = others or {}
    values = {**{field.name: getattr(config, field.name) for field in dataclasses.fields(config)}, **others}
    mine = torch.tensor([_digest(value) for value in values.values()], dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    every = mine.new_empty(size * len(values))
    all_gather_single(every, mine, group=group)
    differ = [name for name, column in zip(values, every.view(size, -1).T.tolist()) if len(set(column)) > 1]
    config_differ = [name for name in differ if name not in others]
    if differ:
        shown = config_differ or differ
        mine_values = ", ".join(f"{name}={values[name]!r}" for name in shown)
        what = ("the MoEConfig of this layer", "build the layer with the same MoEConfig") if config_differ else (
            "the parameters or input of this layer", "give every rank a layer of the same dtype and inputs of "
            "the same width and dtype")
        raise ValueError(f"{what[0]} differs across the EP group in {shown} (this rank: {mine_values}); "
                         f"{what[1]} on every rank")


def _digest(value) -> int:
    """A 64-bit digest of a config value's repr, the same on every rank."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def resolve_ep_group(ep_group: Union[None, ProcessGroup, DeviceMesh], name: str = "ep_group",
                     axis: str = "ep") -> Optional[ProcessGroup]:
    """The process group behind ``ep_group``: None (one rank), a group, or a 1-D DeviceMesh
    (``name`` and ``axis`` word the errors)."""
    if ep_group is None or isinstance(ep_group, ProcessGroup):
        return ep_group
    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(f"{name} is a {ep_group.ndim}-D DeviceMesh; pass one axis of it, e.g. "
                             f"mesh['{axis}'] (a 1-D mesh)")
        return ep_group.get_group()
    raise ValueError(f"{name} must be None, a ProcessGroup or a 1-D DeviceMesh, got {type(ep_group).__name__}")


def mark_expert_param(param: nn.Parameter) -> nn.Parameter:
    """Tag ``param`` as sharded over the EP group (synced over the EDP group only)."""
    setattr(param, EXPERT_PARAM_ATTR, True)
    return param


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` was tagged by :func:`mark_expert_param`."""
    return getattr(param, EXPERT_PARAM_ATTR, False)


def gathered_expert_rows(stacked: torch.Tensor) -> torch.Tensor:
    """A stacked expert tensor [e, ...] (a parameter or its optimizer state) ready to be split
    row by row into per-expert tensors: gathered in one collective when FSDP shards it by
    whole experts (a DTensor on ``Shard(0)``), else as it is. Indexing a ``Shard(0)`` DTensor
    by row gathers the whole tensor for every row, and each row's view keeps its copy alive:
    e collectives and e copies where one does. Call on every rank of its mesh alike."""
    if isinstance(stacked, DTensor) and any(p.is_shard(0) for p in stacked.placements):
        from torch.distributed.tensor import Replicate

        return stacked.redistribute(stacked.device_mesh, [Replicate()] * stacked.device_mesh.ndim)
    return stacked
