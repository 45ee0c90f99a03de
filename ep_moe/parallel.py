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

FSDP2. :func:`init_parallel_mesh` builds the mesh once: the 2-D ("edp", "ep") mesh above
plus its flattening "dp_shard" (every rank), all three bookkept in a :class:`ParallelMesh`.
:func:`apply_fsdp` then shards, torchtitan's way, the dense parameters over "dp_shard" and
each layer's local experts over "edp"; the reduce-scatters divide both kinds of gradients
by the number of data-parallel ranks, as :func:`sync_gradients` does (no call to it then).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ep_moe.distributed import is_expert_param, mark_expert_param, resolve_ep_group
from ep_moe.layer import MoELayer


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
    """Create the EP and EDP groups of this rank (call on every rank, same arguments): the
    axes of :func:`init_ep_mesh`'s DeviceMesh, on the default group's device type (CUDA
    under NCCL, else CPU).

    ``world_size`` defaults to the default group's size and must equal it (the groups
    cover every rank). ``num_experts``: the model's expert count, checked to be divisible
    by ``ep_size`` before any group is created. Code that also shards with FSDP builds
    :func:`init_parallel_mesh` instead and takes :meth:`ParallelMesh.groups` from it. As any
    CUDA DeviceMesh, it selects the GPU of ``LOCAL_RANK`` when the process has not chosen one
    yet: call ``torch.cuda.set_device`` first to pick another.
    """
    _check_num_experts(num_experts, ep_size)
    if not dist.is_initialized():
        raise ValueError("build_ep_groups needs torch.distributed; call "
                         "torch.distributed.init_process_group first")
    if world_size is not None and world_size != dist.get_world_size():
        raise ValueError(f"build_ep_groups(world_size={world_size}) but the default group has "
                         f"{dist.get_world_size()} ranks; the EP and EDP groups cover every rank: drop world_size=")
    device_type = "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"
    return groups_from_mesh(init_ep_mesh(ep_size, device_type=device_type))


def init_ep_mesh(ep_size: int, *, device_type: str = "cuda", num_experts: Optional[int] = None) -> DeviceMesh:
    """A 2-D DeviceMesh ("edp", "ep") over all ranks in the expert-then-data layout
    (``num_experts``: as in :func:`build_ep_groups`). :func:`init_parallel_mesh` builds the
    same mesh and adds the flattened "dp_shard" axis that FSDP needs."""
    _check_num_experts(num_experts, ep_size)
    world_size = dist.get_world_size()
    ep_layout(world_size, ep_size)  # validates
    return init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


def _check_num_experts(num_experts: Optional[int], ep_size: int) -> None:
    """Raise, before any collective, unless ``ep_size`` ranks share ``num_experts`` evenly."""
    if num_experts is not None and (ep_size < 1 or num_experts % ep_size != 0):
        raise ValueError(f"ep_size={ep_size} does not divide num_experts={num_experts}: each EP rank holds "
                         f"num_experts / ep_size experts; pick an ep_size that divides {num_experts}")


def parallel_dims(world_size: int, ep_size: int, *, dp_shard: Optional[int] = None,
                  num_experts: Optional[int] = None) -> dict[str, int]:
    """The sizes of the mesh axes, ``{"dp_shard": world_size, "edp": world_size // ep_size,
    "ep": ep_size}`` (pure: no process group needed).

    Every rank is a data-parallel rank (``dp_shard``, the axis FSDP shards dense parameters
    over); expert parallelism borrows its ranks from it, ``dp_shard = edp * ep``. Raises
    ``ValueError`` naming both numbers when ``dp_shard`` (if given) is not ``world_size``,
    ``ep_size`` does not divide ``world_size``, or (with ``num_experts``) ``ep_size`` does not
    divide ``num_experts``.
    """
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size={ep_size!r} must be a positive integer")
    _check_num_experts(num_experts, ep_size)
    if dp_shard is not None and dp_shard != world_size:
        raise ValueError(f"mesh dims dp_shard={dp_shard} (= edp * ep) do not multiply to the world size "
                         f"{world_size}: every rank is a data-parallel rank; pass dp_shard={world_size} or leave "
                         "it out")
    if world_size % ep_size != 0:
        raise ValueError(f"ep_size={ep_size} does not divide the world size {world_size} (dp_shard = edp * ep): "
                         f"pick an ep_size that is a divisor of {world_size}")
    return {"dp_shard": world_size, "edp": world_size // ep_size, "ep": ep_size}


@dataclass(frozen=True)
class ParallelMesh:
    """Every mesh axis the layer, FSDP and the trainer need, from one DeviceMesh.

    ``mesh`` is the 2-D ("edp", "ep") DeviceMesh of the expert-then-data layout (see the
    module docstring); ``ep`` and ``edp`` are its axes, and ``dp_shard`` its flattening (all
    ranks: the axis :func:`apply_fsdp` shards dense parameters over). The flattened mesh is
    kept here rather than sliced from ``mesh`` by name, which torch deprecates.
    ``pm["ep"]`` is ``pm.ep`` (likewise "edp", "dp_shard"); :meth:`groups` gives the process
    groups of :func:`sync_gradients` and ``MoELayer(ep_group=pm.ep)``.
    """

    mesh: DeviceMesh
    """The 2-D ("edp", "ep") mesh."""
    ep: DeviceMesh
    """Expert-parallel axis (1-D): the ranks that split one layer's experts."""
    edp: DeviceMesh
    """Expert-data-parallel axis (1-D): the replicas of this rank's experts."""
    dp_shard: DeviceMesh
    """Data-parallel axis (1-D), ``edp * ep`` ranks: every rank of ``mesh``."""

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh, *, ep_axis: str = "ep", edp_axis: str = "edp",
                         dp_axis: str = "dp_shard") -> "ParallelMesh":
        """Wrap a 2-D DeviceMesh with ``ep_axis`` and ``edp_axis`` (e.g. :func:`init_ep_mesh`'s),
        flattening both into ``dp_axis``. Creates a process group on first use: call on
        every rank."""
        names = mesh.mesh_dim_names or ()
        if mesh.ndim != 2 or set(names) != {ep_axis, edp_axis}:
            raise ValueError(f"a ParallelMesh comes from a 2-D mesh with axes ({edp_axis!r}, {ep_axis!r}); got a "
                             f"{mesh.ndim}-D mesh with axes {names}: build it with "
                             "ep_moe.parallel.init_parallel_mesh, or slice those two axes from yours")
        return cls(mesh=mesh, ep=mesh[ep_axis], edp=mesh[edp_axis], dp_shard=mesh._flatten(dp_axis))

    def __getitem__(self, axis: str) -> DeviceMesh:
        if axis not in ("ep", "edp", "dp_shard"):
            raise KeyError(f"ParallelMesh has the axes 'dp_shard', 'edp' and 'ep', not {axis!r}")
        return getattr(self, axis)

    @property
    def ep_size(self) -> int:
        """Ranks per EP group."""
        return self.ep.size()

    @property
    def edp_size(self) -> int:
        """Ranks per EDP group."""
        return self.edp.size()

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (``ep_size * edp_size``): what both kinds of gradients are divided by."""
        return self.dp_shard.size()

    def groups(self) -> ExpertParallelGroups:
        """The EP and EDP process groups of this rank (no collective: the mesh made them)."""
        return ExpertParallelGroups(ep_group=self.ep.get_group(), edp_group=self.edp.get_group(),
                                    ep_size=self.ep_size, edp_size=self.edp_size)


def init_parallel_mesh(ep_size: int, *, dp_shard: Optional[int] = None, world_size: Optional[int] = None,
                       num_experts: Optional[int] = None, device_type: str = "cuda") -> ParallelMesh:
    """Build the mesh once (call on every rank, same arguments): ("edp", "ep") over all
    ranks in the expert-then-data layout, and its flattening "dp_shard" (:class:`ParallelMesh`).

    ``dp_shard`` and ``world_size`` default to the default group's size and must equal it;
    ``num_experts`` (the model's expert count) must be divisible by ``ep_size``. These are
    checked (:func:`parallel_dims`) before any collective, so bad input raises alike on every
    rank, naming both numbers. ``device_type``: "cuda" for NCCL, "cpu" for gloo.

    Example (4 ranks, EP=2)::

        pm = init_parallel_mesh(2, num_experts=8)
        model = build_model(ep_group=pm.ep)       # MoELayer(config, ep_group=pm.ep)
        apply_fsdp(model, pm)                     # or: groups = pm.groups(); sync_gradients(...)
    """
    if world_size is not None:  # pure checks first: no process group needed to fail
        parallel_dims(world_size, ep_size, dp_shard=dp_shard, num_experts=num_experts)
    if not dist.is_initialized():
        raise ValueError("init_parallel_mesh needs torch.distributed; call torch.distributed.init_process_group "
                         "first")
    if world_size is not None and world_size != dist.get_world_size():
        raise ValueError(f"init_parallel_mesh(world_size={world_size}) but the default group has "
                         f"{dist.get_world_size()} ranks; the mesh covers every rank: drop world_size=")
    dims = parallel_dims(dist.get_world_size(), ep_size, dp_shard=dp_shard, num_experts=num_experts)
    mesh = init_device_mesh(device_type, (dims["edp"], dims["ep"]), mesh_dim_names=("edp", "ep"))
    return ParallelMesh.from_device_mesh(mesh)


def groups_from_mesh(mesh: Union[DeviceMesh, ParallelMesh], *, ep_axis: str = "ep",
                     edp_axis: str = "edp") -> ExpertParallelGroups:
    """EP and EDP groups from the named axes of a 2-D mesh (see :func:`init_ep_mesh`), or
    of a :class:`ParallelMesh` (:meth:`ParallelMesh.groups`)."""
    if isinstance(mesh, ParallelMesh):
        return mesh.groups()
    names = mesh.mesh_dim_names or ()
    for axis in (ep_axis, edp_axis):
        if axis not in names:
            raise ValueError(f"mesh has axes {names} but no {axis!r} axis; build it with "
                             f"ep_moe.parallel.init_ep_mesh or pass ep_axis=/edp_axis=")
    ep_mesh, edp_mesh = mesh[ep_axis], mesh[edp_axis]
    return ExpertParallelGroups(ep_group=ep_mesh.get_group(), edp_group=edp_mesh.get_group(),
                                ep_size=ep_mesh.size(), edp_size=edp_mesh.size())


def expert_param_names(model: nn.Module) -> list[str]:
    """Names of the expert parameters of ``model``, e.g. for DDP's ignore list:
    ``DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))``."""
    return [name for name, p in model.named_parameters() if is_expert_param(p)]


def broadcast_replicated(model: nn.Module, group: Union[None, ProcessGroup, DeviceMesh], src: int = 0) -> None:
    """Copy every replicated parameter and buffer of ``model`` (all but the experts': the
    parameters :func:`mark_expert_param` tagged, and every tensor of an ep_moe experts
    module) from rank ``src`` of ``group`` (its rank in the group) to the group's other
    ranks, in place: what DDP does at construction, for a model not wrapped in DDP whose
    ranks built or loaded their dense weights differently (the error of
    :class:`ep_moe.MoELayer`'s first call names it). ``group``: the EP group (a
    ProcessGroup or a 1-D DeviceMesh), or None for the default group. Collective: call
    on every rank of ``group``, before the first forward."""
    group = resolve_ep_group(group, "group")
    if group is None:
        group = dist.group.WORLD
    global_src = dist.get_global_rank(group, src)
    # the experts of ep_moe's layers (GroupedExperts, ModuleExperts: stacked buffers too) by their global_ids
    expert_modules = [m for m in model.modules() if callable(getattr(m, "global_ids", None))]
    skip = {id(t) for m in expert_modules for t in (*m.parameters(), *m.buffers())}
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if id(tensor) in skip or is_expert_param(tensor) or isinstance(tensor, DTensor):
                continue
            dist.broadcast(tensor.data, src=global_src, group=group)


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
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("sync_gradients: the model's parameters are DTensors (FSDP, e.g. apply_fsdp): its "
                         "reduce-scatters already averaged the gradients in the backward; do not call "
                         "sync_gradients on it")
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


# ---------------------------------------------------------------------------------------
# FSDP2


def _fsdp_api():
    """``(fully_shard, MixedPrecisionPolicy, register_fsdp_forward_method)``: public in
    ``torch.distributed.fsdp`` since torch 2.6, under ``torch.distributed._composable.fsdp`` before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )
    return fully_shard, MixedPrecisionPolicy, register_fsdp_forward_method


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_FSDP_CALL = "_ep_moe_fsdp_call"
"""The method of a sharded experts module through which its layer's forward runs."""


def _call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a view it returns copied: FSDP hooks the experts' unshard for
    the backward on this output, and an in-place op on a view (``y = moe(h); y += h``) would
    drop that hook, failing the backward on freed weights."""
    out = fn(*args, **kwargs)
    return out.clone() if isinstance(out, torch.Tensor) and out._base is not None else out


def _default_blocks(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The transformer blocks of ``model``: every child of each container (ModuleList,
    ModuleDict, Sequential) that holds an MoE layer in one of its children; an MoE layer in
    no container is a block of its own."""
    parents: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    blocks, seen = [], set()
    for layer in layers:
        found, module = None, layer
        while id(module) in parents:
            parent = parents[id(module)]
            if isinstance(parent, _CONTAINERS):
                found = parent
                break
            module = parent
        for block in (found.children() if found is not None else (layer,)):
            if id(block) not in seen:
                seen.add(id(block))
                blocks.append(block)
    return blocks


def called_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model`` that its own code calls, not an MoE layer
    (transformers' under :func:`ep_moe.integrations.transformers.expert_parallel`): modules
    that tell both their rows' global experts (``global_ids()``, as an MoE layer's experts
    do) and their EP group (``ep_group``, ``ep_size``, as an MoE layer does)."""
    return [m for m in model.modules() if callable(getattr(m, "global_ids", None)) and hasattr(m, "ep_group")]


def _add_to_block(block_experts: dict[int, list[nn.Module]], blocks: list[nn.Module], experts: nn.Module) -> None:
    """Note ``experts`` (sharded on its own) under the block that holds it, for the prefetch."""
    for block in blocks:
        if any(m is experts for m in block.modules()):
            block_experts[id(block)].append(experts)
            return


def _check_layers(layers: list[nn.Module], pm: ParallelMesh) -> None:
    """Raise unless every MoE layer (or experts module the model calls) splits its experts over
    the mesh's "ep" axis (local: no collective)."""
    mesh_ranks = pm.ep.mesh.flatten().tolist()
    for layer in layers:
        if layer.ep_size != pm.ep_size:
            raise ValueError(f"an MoE layer has ep_size={layer.ep_size} but the mesh's 'ep' axis has {pm.ep_size} "
                             "ranks; build the layers with MoELayer(config, ep_group=mesh.ep)")
        if layer.ep_group is not None:
            ranks = dist.get_process_group_ranks(layer.ep_group)
            if ranks != mesh_ranks:
                raise ValueError(f"an MoE layer's EP group holds the ranks {ranks} but the mesh's 'ep' axis here is "
                                 f"{mesh_ranks}; build the layers with MoELayer(config, ep_group=mesh.ep)")


def _experts_placement(edp_size: int):
    """FSDP's shard placement of a stacked expert tensor [e, ...] over ``edp_size`` ranks:
    dim 0 (whole experts per rank), unless there are fewer local experts than ranks and
    dim 1 divides evenly (torchtitan's rule: dim-0 shards would then be mostly padding)."""
    from torch.distributed.tensor import Shard

    def placement(param: nn.Parameter):
        if param.shape[0] < edp_size and param.dim() > 1 and param.shape[1] % edp_size == 0:
            return Shard(1)
        return Shard(0)
    return placement


def _divide_gradients_by(module: nn.Module, factor: int, mesh: DeviceMesh) -> None:
    """Make ``module``'s (an FSDPModule's) reduce-scatter over ``mesh`` divide by ``factor``.

    On NCCL FSDP pre-multiplies by 1/factor in the reduce-scatter (``PREMUL_SUM``). Gloo has
    no such op: over more than one rank it sums, then divides the shard. Over one rank FSDP
    copies and divides by itself; forcing the sum there would divide twice (torch 2.13)."""
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(float(factor))
    else:  # torch < 2.8
        module.set_reduce_scatter_divide_factor(float(factor))
    if (mesh.size() > 1 and dist.get_backend(mesh.get_group()) != "nccl"
            and hasattr(module, "set_force_sum_reduction_for_comms")):
        module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(
    model: nn.Module,
    mesh: Union[ParallelMesh, DeviceMesh],
    *,
    blocks: Optional[Iterable[nn.Module]] = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    offload_policy=None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``), in place, as torchtitan's ``apply_fsdp``
    does for MoE models; returns ``model``. Call on every rank, after building the model
    with ``MoELayer(config, ep_group=mesh.ep)`` and before building the optimizer.

    - Dense parameters (every parameter not tagged by :func:`mark_expert_param`: router,
      shared experts, the rest of the model) are sharded over ``mesh.dp_shard`` (all ranks),
      one FSDP group per block, plus one for what no block holds (the root, ``model``).
    - At EP > 1 each MoE layer's local experts (its stacked expert tensors), and each experts
      module the model calls itself (:func:`called_experts`: transformers' under
      :func:`ep_moe.integrations.transformers.expert_parallel`), are one FSDP group sharded
      over ``mesh.edp``, the replicas of those experts. Their all-gather and
      reduce-scatter run around the layer's forward and backward (the layer reads the
      stacked tensors directly, so FSDP's hooks are moved from the experts' ``forward`` to
      the layer's; the layer's output, a view, is then copied once, so that an in-place op
      on it keeps FSDP's backward hook). At EP = 1 they are sharded with their block over
      ``dp_shard``.
    - Gradients are reduce-scattered in the backward and come out as :func:`sync_gradients`
      leaves them (with the per-rank mean loss): dense ones averaged over all ranks; expert
      ones summed over ``edp`` and divided by all ranks too (each rank's expert gradient
      already sums its EP group's tokens). Do not call :func:`sync_gradients` then.
    - ``blocks``: the modules to shard one by one (transformer blocks), in forward order;
      default: the children of each ModuleList/ModuleDict/Sequential holding an MoE layer
      (an MoE layer in none is its own block). At EP > 1 each block prefetches the next
      block and its experts in the forward (the previous in the backward), since the
      all-to-all's host sync keeps FSDP's implicit prefetch from running ahead.
    - ``param_dtype`` / ``reduce_dtype`` (e.g. bf16 / fp32) make a
      ``MixedPrecisionPolicy``; or pass ``mp_policy`` (not both). ``reshard_after_forward``
      applies to blocks and experts (the root keeps FSDP's default, not resharded).
      ``offload_policy``: FSDP's, e.g. ``CPUOffloadPolicy()``.

    Parameters become DTensors (``.full_tensor()`` gathers one); expert parameters keep
    their tag. ``mesh``: a :class:`ParallelMesh` (:func:`init_parallel_mesh`) or a 2-D
    ("edp", "ep") DeviceMesh (:func:`init_ep_mesh`). Raises ``ValueError`` when an MoE layer
    was built on another EP group than ``mesh.ep``.
    """
    fully_shard, MixedPrecisionPolicy, register_fsdp_forward_method = _fsdp_api()
    pm = mesh if isinstance(mesh, ParallelMesh) else ParallelMesh.from_device_mesh(mesh)
    if mp_policy is not None and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError("apply_fsdp: pass either mp_policy or param_dtype/reduce_dtype, not both")
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    common = {"mp_policy": mp_policy}
    if offload_policy is not None:
        common["offload_policy"] = offload_policy
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    called = called_experts(model)
    _check_layers(layers + called, pm)
    expert_names = set(expert_param_names(model))
    blocks = _default_blocks(model, layers + called) if blocks is None else list(blocks)
    blocks = [b for b in blocks if b is not model]
    block_experts: dict[int, list[nn.Module]] = {id(b): [] for b in blocks}

    if pm.ep_size > 1:
        for experts in called:  # called by the model: FSDP's forward hooks run as they are
            fully_shard(experts, mesh=pm.edp, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=_experts_placement(pm.edp_size), **common)
            _divide_gradients_by(experts, pm.dp_size, pm.edp)
            _add_to_block(block_experts, blocks, experts)
        for layer in layers:
            experts = layer.experts
            fully_shard(experts, mesh=pm.edp, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=_experts_placement(pm.edp_size), **common)
            _divide_gradients_by(experts, pm.dp_size, pm.edp)
            # the layer reads the stacked tensors, never calls experts.forward: run FSDP's
            # pre/post-forward hooks (all-gather, reshard, backward hooks) around the layer's
            setattr(experts, _FSDP_CALL, _call)
            register_fsdp_forward_method(experts, _FSDP_CALL)
            layer.forward = functools.partial(getattr(experts, _FSDP_CALL), layer.forward)
            _add_to_block(block_experts, blocks, experts)
    for block in blocks:
        fully_shard(block, mesh=pm.dp_shard, reshard_after_forward=reshard_after_forward, **common)
    fully_shard(model, mesh=pm.dp_shard, **common)
    for name, param in model.named_parameters():  # FSDP made new Parameters (DTensors)
        if name in expert_names:
            mark_expert_param(param)

    if pm.ep_size > 1 and len(blocks) > 1:  # explicit prefetch, as torchtitan's at EP > 1
        for block, after in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([after, *block_experts[id(after)]])
            after.set_modules_to_backward_prefetch([block, *block_experts[id(block)]])
    return model
