"""Process groups for expert parallelism, and gradient synchronisation.

Layout ("expert-then-data"): ``world_size = ep_size * edp_size`` ranks form ``edp_size``
expert-parallel (EP) groups of ``ep_size`` consecutive ranks (consecutive ranks share a
node, so the all-to-all stays on NVLink when ``ep_size`` <= GPUs per node). Ranks at
the same position of every EP group hold the same experts and form an expert-data-parallel
(EDP) group. For world 4, ep 2::

    EP groups:  [0, 1] [2, 3]        each splits the E experts in two
    EDP groups: [0, 2] [1, 3]        replicas of the same experts

As a DeviceMesh this is ``init_device_mesh(dev, (edp_size, ep_size),
mesh_dim_names=("edp", "ep"))``: the "ep" axis is the inner (fastest-varying) one.

Gradients. Non-expert parameters (router, shared experts, the rest of the model) are
replicated on all ranks and see only local tokens: average them over all ranks. Expert
parameters already hold the sum over every token of their EP group (the all-to-all
backward brings it home); all-reduce them over the EDP group and divide by the *world*
size as well, so both kinds of gradients are gradients of the same objective, the mean
of the per-rank losses. :func:`sync_gradients` does exactly this. With DDP, wrap the model
with the expert parameters ignored (:func:`expert_param_names`) and call
``sync_gradients(model, ep_group, edp_group, sync_dense=False)`` after backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

EXPERT_PARAM_ATTR = "_ep_moe_expert"


@dataclass(frozen=True)
class ExpertParallelGroups:
    """The two groups a rank belongs to, and their sizes."""

    ep_group: ProcessGroup
    """This rank's expert-parallel group (the layer's all-to-all group)."""
    edp_group: ProcessGroup
    """This rank's expert-data-parallel group (replicas of its experts)."""
    ep_size: int
    """Ranks per EP group."""
    edp_size: int
    """Ranks per EDP group (world_size / ep_size)."""


def ep_layout(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Ranks of every EP group and every EDP group, expert-then-data layout (pure)."""
    if ep_size < 1 or world_size % ep_size != 0:
        raise ValueError(f"ep_size={ep_size} must divide world_size={world_size}; "
                         "pick an ep_size that is a divisor of the number of ranks")
    edp_size = world_size // ep_size
    ep_groups = [list(range(d * ep_size, (d + 1) * ep_size)) for d in range(edp_size)]
    edp_groups = [list(range(p, world_size, ep_size)) for p in range(ep_size)]
    return ep_groups, edp_groups


def build_ep_groups(ep_size: int, *, world_size: Optional[int] = None,
                    num_experts: Optional[int] = None) -> ExpertParallelGroups:
    """Create the EP and EDP groups of this rank (call on every rank, same arguments).

    ``world_size`` defaults to the default group's size and must equal it (the groups
    cover every rank). ``num_experts``: the model's expert count, checked to be divisible
    by ``ep_size`` before any group is created. Every rank takes part in the creation of
    every group, as ``torch.distributed.new_group`` requires.
    """
    _check_num_experts(num_experts, ep_size)
    if not dist.is_initialized():
        raise ValueError("build_ep_groups needs torch.distributed; call "
                         "torch.distributed.init_process_group first")
    if world_size is not None and world_size != dist.get_world_size():
        raise ValueError(f"build_ep_groups(world_size={world_size}) but the default group has "
                         f"{dist.get_world_size()} ranks; the EP and EDP groups cover every rank: drop world_size=")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    ep_ranks, edp_ranks = ep_layout(world_size, ep_size)
    ep_group = edp_group = None
    for ranks in ep_ranks:
        group = dist.new_group(ranks)
        if rank in ranks:
            ep_group = group
    for ranks in edp_ranks:
        group = dist.new_group(ranks)
        if rank in ranks:
            edp_group = group
    return ExpertParallelGroups(ep_group=ep_group, edp_group=edp_group,
                                ep_size=ep_size, edp_size=world_size // ep_size)


def init_ep_mesh(ep_size: int, *, device_type: str = "cuda", num_experts: Optional[int] = None) -> DeviceMesh:
    """A 2-D DeviceMesh ("edp", "ep") over all ranks in the expert-then-data layout
    (``num_experts``: as in :func:`build_ep_groups`)."""
    _check_num_experts(num_experts, ep_size)
    world_size = dist.get_world_size()
    ep_layout(world_size, ep_size)  # validates
    return init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


def _check_num_experts(num_experts: Optional[int], ep_size: int) -> None:
    """Raise, before any collective, unless ``ep_size`` ranks share ``num_experts`` evenly."""
    if num_experts is not None and (ep_size < 1 or num_experts % ep_size != 0):
        raise ValueError(f"ep_size={ep_size} does not divide num_experts={num_experts}: each EP rank holds "
                         f"num_experts / ep_size experts; pick an ep_size that divides {num_experts}")


def groups_from_mesh(mesh: DeviceMesh, *, ep_axis: str = "ep", edp_axis: str = "edp") -> ExpertParallelGroups:
    """EP and EDP groups from the named axes of a 2-D mesh (see :func:`init_ep_mesh`)."""
    names = mesh.mesh_dim_names or ()
    for axis in (ep_axis, edp_axis):
        if axis not in names:
            raise ValueError(f"mesh has axes {names} but no {axis!r} axis; build it with "
                             f"ep_moe.parallel.init_ep_mesh or pass ep_axis=/edp_axis=")
    ep_mesh, edp_mesh = mesh[ep_axis], mesh[edp_axis]
    return ExpertParallelGroups(ep_group=ep_mesh.get_group(), edp_group=edp_mesh.get_group(),
                                ep_size=ep_mesh.size(), edp_size=edp_mesh.size())


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


def expert_param_names(model: nn.Module) -> list[str]:
    """Names of the expert parameters of ``model``, e.g. for DDP's ignore list:
    ``DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))``."""
    return [name for name, p in model.named_parameters() if is_expert_param(p)]


def _grads(model: nn.Module, expert: bool) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None and is_expert_param(p) == expert]


def _all_reduce_mean(grads: list[torch.Tensor], group: Optional[ProcessGroup], reduce: bool,
                     divisor: int) -> None:
    """Sum ``grads`` over ``group`` (one flat buffer per dtype and device), then divide
    (divisor 1: nothing to divide)."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        buckets.setdefault((grad.dtype, grad.device), []).append(grad)
    for bucket in buckets.values():
        if reduce:
            flat = torch.cat([g.flatten() for g in bucket])
            dist.all_reduce(flat, group=group)
            for grad, synced in zip(bucket, flat.split([g.numel() for g in bucket])):
                grad.copy_(synced.view_as(grad))
        if divisor != 1:
            torch._foreach_div_(bucket, divisor)


def sync_gradients(
    model: nn.Module,
    ep_group: Union[None, ProcessGroup, DeviceMesh],
    edp_group: Union[None, ProcessGroup, DeviceMesh],
    *,
    sync_dense: bool = True,
    average: bool = True,
) -> int:
    """Average gradients over data parallelism, in place, after ``backward``.

    Expert parameters: all-reduce (sum) over ``edp_group``; non-expert parameters (when
    ``sync_dense``): all-reduce over all ranks of the default group, which must be the
    ``ep_size * edp_size`` data-parallel ranks. Both are then divided by that number (see
    the module docstring for why expert gradients are divided by it and not by
    ``edp_size``). ``None`` stands for a group of one rank; a 1-D DeviceMesh (``mesh["ep"]``,
    ``mesh["edp"]``) for its group. Call on every rank.

    Returns that number. ``average=False`` sums without dividing, leaving the division to
    the caller, who can fold it into a pass it makes over the gradients anyway (the trainer
    folds it into gradient clipping's multiply): one pass over every gradient less.
    """
    ep_group, edp_group = resolve_ep_group(ep_group), resolve_ep_group(edp_group, "edp_group", "edp")
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    edp_size = 1 if edp_group is None else dist.get_world_size(edp_group)
    num_replicas = ep_size * edp_size
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if sync_dense and world != num_replicas:
        raise ValueError(f"sync_gradients: the default group has {world} ranks, but ep_size * edp_size = "
                         f"{ep_size} * {edp_size} = {num_replicas}; dense gradients are averaged over the "
                         "default group, so it must hold exactly this model's data-parallel ranks. Pass "
                         "sync_dense=False and average them over your data-parallel group yourself (e.g. DDP)")
    divisor = num_replicas if average else 1
    _all_reduce_mean(_grads(model, expert=True), edp_group, edp_size > 1, divisor)
    if sync_dense:
        _all_reduce_mean(_grads(model, expert=False), None, num_replicas > 1, divisor)
    return num_replicas
