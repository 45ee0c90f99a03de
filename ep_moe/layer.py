"""The expert-parallel MoE layer: the router, then a dispatcher (:mod:`ep_moe.ep`) that brings
the tokens to the experts (:mod:`ep_moe.experts`) and back.

Shape suffixes follow the legend in :mod:`ep_moe.routing`.

Using it in a trainer::

    layer = MoELayer(MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k),
                     ep_group=groups.ep_group)          # None at EP=1
    loss = task_loss + moe_aux_loss(model)               # aux + z of every MoE layer
    loss.backward()
    sync_gradients(model, groups.ep_group, groups.edp_group)   # ep_moe.parallel
    optimizer.step()
    update_expert_biases(model)                          # only with expert_bias=True
    log(expert_load(model))                              # [num_layers, E] token counts

Checkpoints. The state dict stores expert weights per *global* expert id,
``experts.gate_up.{g}`` ([2I, H] or [I, H]) and ``experts.down.{g}`` ([H, I]), with
``mlp_bias`` also ``experts.gate_up_bias.{g}`` and ``experts.down_bias.{g}``; each rank's
``state_dict()`` holds only its own experts plus the replicated parameters. To merge the
per-rank shards into one checkpoint, ``merged = {}; for sd in shards: merged.update(sd)``
(expert keys are disjoint; replicated keys are equal on every rank). ``load_state_dict``
at any EP size accepts the merged dict or any dict that holds at least this rank's
experts: each rank picks its experts' keys and ignores the others (resharding on load).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ep_moe.config import MoEConfig, check_experts_divide
from ep_moe.distributed import all_gather_single, check_same_config, group_size, resolve_ep_group
from ep_moe.ep import build_dispatcher, resolve_dispatch
from ep_moe.experts import GroupedExperts, ModuleExperts, SharedExperts, check_fp8_device, compute_dtype
from ep_moe.forward_graphs import ForwardGraphs, graphable, only_own_modules
from ep_moe.kernels.grouped_gemm import interpreter_active
from ep_moe.kernels.ops import debug_enabled
from ep_moe.routing import (RouterOutput, capacity_keep_mask, check_routing, expert_capacity, mask_out_of_range,
                            out_of_range_message, route)

if TYPE_CHECKING:
    from ep_moe.autotune.space import GemmProblem

_EXPERT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes the experts compute in (the grouped GEMM's)."""
_TRITON_ON_CPU = interpreter_active()
"""Whether Triton's kernels run on CPU tensors (its interpreter): fixed when they were decorated,
at import."""

RouteFn = Callable[[torch.Tensor], tuple[RouterOutput, Optional[torch.Tensor]]]
"""A routing computed outside the layer (:meth:`MoELayer.forward`'s ``route_fn``): the
[T, H] tokens in the compute dtype -> the :class:`~ep_moe.routing.RouterOutput` and the
keep mask ([T, K] bool, None: every slot kept)."""


def _check_finite_tokens(x_TH: torch.Tensor, group: Optional[ProcessGroup]) -> None:
    """Raise if some tokens hold NaN or inf, naming how many (a host sync). With an EP
    group the counts are summed over it first (a collective), so every rank raises, not
    only the one with the bad tokens while its peers wait in the next exchange."""
    bad_here = (~torch.isfinite(x_TH)).any(dim=1).sum().reshape(1)
    bad_group, where = bad_here.clone(), ""
    if group_size(group) > 1:
        dist.all_reduce(bad_group, group=group)
        where = f" on this rank, {int(bad_group)} over the EP group"
    if int(bad_group):
        raise ValueError(f"x has {int(bad_here)} of {x_TH.shape[0]} tokens with NaN or inf values{where} "
                         "(EP_MOE_DEBUG is set); find where they turn non-finite upstream, e.g. with "
                         "torch.autograd.detect_anomaly()")


def _check_ids_in_range(ids_TK: torch.Tensor, bad_TK: torch.Tensor, num_experts: int,
                        group: Optional[ProcessGroup]) -> None:
    """Raise if a ``route_fn`` returned expert ids out of ``[0, num_experts)``, naming how
    many and one of them (a host sync; EP_MOE_DEBUG). With an EP group the counts are summed
    over it first (a collective), so every rank raises, as :func:`_check_finite_tokens` does."""
    bad_here = bad_TK.sum().reshape(1)
    bad_group, where = bad_here.clone(), ""
    if group_size(group) > 1:
        dist.all_reduce(bad_group, group=group)
        where = f" on this rank, {int(bad_group)} over the EP group"
    if int(bad_group):
        example = int(ids_TK[bad_TK][0]) if int(bad_here) else None
        raise ValueError(out_of_range_message("route_fn", int(bad_here), bad_TK.numel(), num_experts, example, where))


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """[2] float64 sums of ``t``'s values, plain and weighted by position (a permutation
    changes it): equal tensors give equal sums on every rank of one device type."""
    flat = t.detach().reshape(-1).to(torch.float64)
    ramp = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
    return torch.stack([flat.sum(), (flat * ramp).sum()])


@dataclass(frozen=True)
class MoEStats:
    """What one forward of a :class:`MoELayer` reports (``layer.last_stats``)."""

    aux_loss: torch.Tensor
    """Load-balancing loss, already times ``aux_loss_coef`` (0-dim, differentiable)."""
    z_loss: torch.Tensor
    """Router z-loss, already times ``z_loss_coef`` (0-dim, differentiable)."""
    tokens_per_expert: torch.Tensor
    """[E] int64: slots of this rank's tokens the router assigned to each global expert
    (before capacity drops), detached."""
    num_dropped: torch.Tensor
    """0-dim int64: slots of this rank's tokens dropped by the capacity, plus, at
    ``dispatch="all_gather"`` with a row bound, slots of this rank's experts past it,
    plus slots a ``route_fn`` gave an expert id out of range (always 0 when dropless and
    routed in range)."""
    with_autograd: bool = True
    """Whether the forward ran with autograd on, so that the losses carry gradients (False
    under ``torch.no_grad``, and in the first forward of a reentrant activation checkpoint)."""


class MoELayer(nn.Module):
    """Expert-parallel Mixture-of-Experts layer, dropless by default.

    Args:
        config: the :class:`MoEConfig`.
        ep_group: ``None`` (EP=1: all experts here, no collectives), a ProcessGroup, or a
            1-D DeviceMesh of the expert-parallel axis (e.g. ``mesh["ep"]``, see
            :mod:`ep_moe.parallel`). Rank p of the group holds global experts
            ``p*e .. p*e+e-1`` with ``e = num_experts / ep_size``.
        device, dtype: of the parameters.
        expert_module: run copies of this module as the experts instead of the grouped
            GEMMs (:class:`ep_moe.experts.ModuleExperts`: any expert, on the slow path;
            the config's expert fields then describe nothing).

    Parameters: ``router.weight`` [E, H], ``experts.gate_up`` [e, 2I or I, H],
    ``experts.down`` [e, H, I] (``num_linears=1``: ``down`` [e, H, H] alone; ``mlp_bias``:
    also ``experts.gate_up_bias`` and ``experts.down_bias``; tagged as expert parameters, see
    :func:`ep_moe.parallel.sync_gradients`), ``shared_experts.*`` when configured, and the
    buffer ``expert_bias`` [E] when ``expert_bias=True``. Init: every weight N(0,
    ``init_std``), biases zero; the router and shared experts from the default RNG (seed all ranks
    alike to get replicas that agree: the first call at EP>1 raises where they do not,
    :meth:`_check_replicas_agree`), the experts so that the global weights do not
    depend on the EP size (:meth:`GroupedExperts.reset_parameters`).

    Protocols: ``copy.deepcopy`` (``AveragedModel``) copies the tensors, shares the EP group
    and leaves out ``last_stats``, as pickling does (``torch.save(layer)``, EP=1 only);
    ``torch.func.functional_call`` runs on the tensors given. A forward on the meta device
    returns a meta output (shape inference, :meth:`_meta_forward`). Double backward
    (``create_graph=True``) is exact on the torch backend at EP=1 and raises one error on
    the Triton backend and at EP>1, whose backward is not differentiable again.

    ``forward_graphs``: at EP=1, the CUDA graphs that small forwards without autograd replay
    (:class:`ep_moe.forward_graphs.ForwardGraphs`; None at EP>1); ``layer.forward_graphs.enabled
    = False`` runs every forward eagerly.
    """

    def __init__(self, config: MoEConfig, ep_group: Union[None, ProcessGroup, DeviceMesh] = None,
                 *, device=None, dtype=None, expert_module: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.config = config
        group = resolve_ep_group(ep_group)
        self.ep_size = group_size(group)
        if config.ep_size is not None and config.ep_size != self.ep_size:
            raise ValueError(f"ep_group has {self.ep_size} ranks but MoEConfig.ep_size={config.ep_size}; "
                             f"pass a group of {config.ep_size} ranks (ep_moe.parallel.build_ep_groups) "
                             "or change ep_size")
        check_experts_divide(config.num_experts, self.ep_size, f"the ep_group size {self.ep_size}")
        self.ep_rank = 0 if group is None else dist.get_rank(group)
        self.num_local_experts = config.num_experts // self.ep_size
        self.ep_group = group  # builds the dispatcher
        worst = self.ep_size * min(config.top_k, self.num_local_experts) / config.top_k
        explicit_gather = config.dispatch not in ("auto", "all_to_all")  # auto keeps its worst case small
        if explicit_gather and self.ep_size > 1 and config.all_gather_row_bound is None and worst >= 4:
            warnings.warn(f"MoEConfig.dispatch={config.dispatch!r} at EP={self.ep_size} sizes the expert activations for "
                          f"the worst case, {worst:g}x the average routed rows; set all_gather_row_bound (e.g. 2.0: "
                          "slots past it are dropped and counted in last_stats.num_dropped) to cap the memory",
                          stacklevel=2)
        factory = dict(device=device, dtype=dtype)
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False, **factory)
        first_expert = self.ep_rank * self.num_local_experts
        if config.expert_precision == "fp8" and expert_module is not None:
            raise ValueError(f"MoEConfig.expert_precision='fp8' runs ep_moe's grouped experts in FP8, but the expert "
                             f"module {type(expert_module).__name__} runs as is (ModuleExperts) in its own dtype; "
                             "build the experts from MoEConfig's fields (no expert_module), or use "
                             "expert_precision='bf16'")
        if expert_module is None:
            self.experts = GroupedExperts(config, self.num_local_experts, first_expert, **factory)
        else:
            self.experts = ModuleExperts(expert_module, config, self.num_local_experts, first_expert, **factory)
        if config.expert_precision == "fp8":
            check_fp8_device(self.experts.first_weight.device)
        self.shared_experts = SharedExperts(config, **factory) if config.num_shared_experts else None
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, device=device,
                                                            dtype=config.router_dtype))
        else:
            self.expert_bias = None
        # tokens per expert of this rank's training forwards since the last bias update:
        # rank-local, so not a buffer (DDP's broadcast_buffers would copy rank 0's over it)
        self._load_since_update = (torch.zeros(config.num_experts, device=device, dtype=torch.int64)
                                   if config.expert_bias else None)
        self.last_stats: Optional[MoEStats] = None
        self._config_agreed = self.ep_size == 1  # checked equal over the EP group on the first forward
        self.forward_graphs = ForwardGraphs() if self.ep_size == 1 else None
        self.reset_parameters()

    @property
    def dispatch(self) -> str:
        """The dispatch this layer runs: ``"local"`` at EP=1, else what ``config.dispatch``
        names or ``"auto"`` picked (:func:`ep_moe.ep.resolve_dispatch`)."""
        return resolve_dispatch(self.config, self._ep_group, self.ep_size)

    @property
    def ep_group(self) -> Optional[ProcessGroup]:
        """The EP group (None at EP=1). Assigning another group of the same ranks (as the
        DeepSpeed drop-in does with DeepSpeed's own) rebuilds the dispatcher on it."""
        return self._ep_group

    @ep_group.setter
    def ep_group(self, group: Optional[ProcessGroup]) -> None:
        self._ep_group = group
        self.dispatcher = build_dispatcher(self.config, group, self.ep_rank, self.ep_size, self.num_local_experts)

    def _apply(self, fn, recurse=True):
        # ``expert_bias`` accumulates steps of ``bias_update_rate`` (1e-3): it keeps
        # ``router_dtype`` when ``.to(dtype)``, ``.half()`` or ``.bfloat16()`` cast the layer,
        # and follows only their device (in bf16, steps round away once |bias| >= 0.5)
        bias = self._buffers.get("expert_bias")
        if bias is not None:
            self._buffers["expert_bias"] = None  # skipped by Module._apply, keeps its place
        try:
            super()._apply(fn, recurse)
        finally:
            if bias is not None:
                moved = fn(bias)
                self._buffers["expert_bias"] = moved if moved.dtype == bias.dtype else bias.to(moved.device)
        if self._load_since_update is not None:  # an int64 tensor: follows the device only
            self._load_since_update = fn(self._load_since_update)
        return self

    def __getstate__(self) -> dict:
        """Pickling (``torch.save(layer)``): the layer without its last forward's stats (tensors
        of that step, no state of the layer: the loaded layer's ``last_stats`` is None). A
        layer with an EP group cannot be pickled: its process group exists in this job only."""
        if self._ep_group is not None:
            raise TypeError(f"an MoELayer with an EP group (EP={self.ep_size}) cannot be pickled: its process group "
                            "lives in this job only; save layer.state_dict() instead (ep_moe.checkpoint for a "
                            "model's)")
        state = self.__dict__.copy()
        state["last_stats"] = None
        return state

    def __deepcopy__(self, memo: dict) -> "MoELayer":
        """``copy.deepcopy`` (``torch.optim.swa_utils.AveragedModel``, EMA copies): tensors of
        its own, the same EP group (a communicator, shared, not copied) with a dispatcher of its
        own, and no ``last_stats`` until it runs (the last forward's losses belong to that
        step's graph, which deepcopy refuses to copy)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        shared = {"last_stats", "_ep_group", "dispatcher"}
        copied.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()
                                if key not in shared})
        copied.__dict__["last_stats"] = None
        copied.ep_group = self._ep_group  # builds its dispatcher
        return copied

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Documented init (see the class docstring); draws from the default RNG."""
        std = self.config.init_std
        self.router.weight.normal_(0.0, std)
        expert_seed = int(torch.randint(0, 2**62, (), device="cpu").item())  # also under a meta default device
        self.experts.reset_parameters(std, expert_seed)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self._load_since_update.zero_()

    def compute_dtype(self) -> torch.dtype:
        """The dtype the experts compute in: autocast's when it is on for the parameters'
        device (as ``nn.Linear`` does), else the parameters' own."""
        return compute_dtype(self.experts.first_weight)

    def gemm_problems(self) -> list["GemmProblem"]:
        """The two grouped GEMMs of this layer, as :mod:`ep_moe.autotune` keys them (in
        :meth:`compute_dtype`: call ``warmup`` under the training autocast)."""
        return self.experts.problems(self.compute_dtype())

    def _check_input(self, x: torch.Tensor) -> torch.dtype:
        """Raise naming what is wrong with ``x`` and the fix (local checks: no collective);
        returns the :meth:`compute_dtype`."""
        hidden, param = self.config.hidden_size, self.experts.first_weight
        if (type(x) is torch.Tensor and x.dtype == param.dtype and x.dtype in _EXPERT_DTYPES and x.dim()
                and x.shape[-1] == hidden and x.device == param.device and not x.is_meta
                and not torch.is_autocast_enabled(param.device.type)):
            return param.dtype  # the common call, in one pass of cheap checks
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [..., {hidden}], got {type(x).__name__}; "
                            "convert it with torch.as_tensor")
        if x.dim() < 1 or x.shape[-1] != hidden:
            raise ValueError(f"x has shape {tuple(x.shape)} but the layer's hidden_size is {hidden}; "
                             f"pass x as [..., {hidden}]")
        if not x.is_floating_point():
            raise ValueError(f"x dtype {x.dtype} is not supported: the layer takes float32, float16 or bfloat16 "
                             f"input (its parameter dtype, {param.dtype}, unless under autocast); "
                             f"cast x with x.to({param.dtype})")
        if x.dtype != param.dtype and (x.is_meta or not torch.is_autocast_enabled(x.device.type)):
            layer_fix = f" or the layer with layer.to({x.dtype})" if x.dtype in _EXPERT_DTYPES else ""
            raise ValueError(f"x dtype {x.dtype} does not match the layer's parameter dtype {param.dtype}; "
                             f"cast x with x.to({param.dtype}){layer_fix}")
        if x.device != param.device:
            raise ValueError(f"x is on {x.device} but the layer is on {param.device}; move one of them")
        compute_dtype = self.compute_dtype()
        if compute_dtype not in _EXPERT_DTYPES:
            raise ValueError(f"the layer computes in {compute_dtype}, but its experts run in float32, "
                             "float16 or bfloat16; cast the layer (layer.float()) and x, or run under autocast")
        return compute_dtype

    def forward(self, x: torch.Tensor, route_fn: Optional[RouteFn] = None) -> torch.Tensor:
        """MoE forward, ``x`` [..., H] -> same shape and dtype (under autocast, the
        autocast dtype, as ``nn.Linear``; the router stays in ``router_dtype``).
        ``route_fn``, when given, routes instead of the layer's router (step 2): another
        framework's gating, as DeepSpeed's in :mod:`ep_moe.integrations.deepspeed_gate`;
        dispatch, experts and stats are the layer's. Steps (ARCHITECTURE.md, "Data flow",
        follows each into its functions):

        1. Check the input, cast it to the compute dtype; on the first call at EP>1, check
           that every rank of the EP group has the same config and the same replicated
           parameters (:meth:`_check_replicas_agree`).
        2. Route: scores, top-k (expert bias for selection only), aux and z losses; the
           capacity's keep mask when configured. A ``route_fn``'s output is checked
           (:meth:`_outside_route`): an expert id out of range leaves its slot out, counted
           as dropped, and raises with ``EP_MOE_DEBUG`` set.
        3. Dispatch: the dispatcher (``MoEConfig.dispatch``, :mod:`ep_moe.ep`) routes the
           tokens to the experts and, at EP>1, starts sending them.
        4. The shared experts, while the tokens travel.
        5. The experts (GEMM1 gathering rows, activation, GEMM2 weighting them), and at EP>1
           the rows back.
        6. Combine: each token's rows summed, plus the shared experts; stats recorded.

        A small forward without autograd at EP=1 replays a CUDA graph of these steps once its
        input shape has recurred (:mod:`ep_moe.forward_graphs`): the same math on the fused
        kernels, at a few launches' host time.
        """
        if self.forward_graphs is not None and route_fn is None and self.takes_graphs(x):
            return self.forward_graphs(self, x, self._eager_forward)
        return self._eager_forward(x, route_fn)

    def takes_graphs(self, x: torch.Tensor) -> bool:
        """Whether this call may run graphed (:mod:`ep_moe.forward_graphs`):
        :func:`~ep_moe.forward_graphs.graphable`, dropless, the grouped experts on the Triton
        backend, and only the layer's own modules with no hooks inside."""
        return (graphable(x) and self.config.capacity_factor is None and self.config.backend != "torch"
                and isinstance(self.experts, GroupedExperts) and only_own_modules(self))

    # what ForwardGraphs asks of the layer it graphs (ep_moe.forward_graphs.GraphedForward)
    def graphed_tensors(self):
        """Every tensor the forward reads, or writes in place (the load count)."""
        extra = () if self._load_since_update is None else (self._load_since_update,)
        return itertools.chain(self.parameters(), self.buffers(), extra)

    @contextlib.contextmanager
    def uncounted(self):
        """The forwards inside count no tokens towards the expert-bias update."""
        saved = None if self._load_since_update is None else self._load_since_update.clone()
        try:
            yield
        finally:
            if saved is not None:
                self._load_since_update.copy_(saved)

    def call_outputs(self) -> Optional[MoEStats]:
        """The last forward's stats."""
        return self.last_stats

    def take_replayed(self, stats: MoEStats) -> None:
        """A graph's stats as the layer's last (copies: the graph overwrites its own)."""
        object.__setattr__(self, "last_stats", dataclasses.replace(
            stats, aux_loss=stats.aux_loss.clone(), z_loss=stats.z_loss.clone(),
            tokens_per_expert=stats.tokens_per_expert.clone(), num_dropped=stats.num_dropped.clone()))

    def _eager_forward(self, x: torch.Tensor, route_fn: Optional[RouteFn] = None) -> torch.Tensor:
        """Steps 1-6 of :meth:`forward`, op by op."""
        x_TH = self._input_tokens(x)
        if x_TH.is_meta:
            return self._meta_forward(x, x_TH)
        self.dispatcher.start(x_TH.shape[0], x_TH.device)
        if route_fn is None:
            router, keep_TK = self._route(x_TH)
            dispatched, bad_slots = router, None
        else:
            router, keep_TK, dispatched, bad_slots = self._outside_route(route_fn, x_TH)
        backend = self.config.backend if self.config.backend != "auto" else (
            "triton" if x.is_cuda or self.config.expert_precision == "fp8" else "torch")  # FP8: Triton's kernels
        if backend == "triton" and not x.is_cuda and not _TRITON_ON_CPU:
            raise ValueError(f"MoELayer: backend='triton' runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, "
                             f"set before ep_moe is imported), but x is on {x.device}; move the layer and x to a GPU, "
                             f"or pass backend='auto' (the plain-PyTorch path on the CPU)")
        routed = self.dispatcher.dispatch(x_TH, dispatched, keep_TK, backend)
        shared_TH = None if self.shared_experts is None else self.shared_experts(x_TH, backend)
        y_TH = self.dispatcher.combine(routed, self.dispatcher.experts(routed, self.experts))
        if shared_TH is not None:
            y_TH = y_TH + shared_TH
        self._record(router, keep_TK, torch.is_grad_enabled(), self.dispatcher.num_dropped(routed), bad_slots)
        return y_TH if x.dim() == 2 else y_TH.view(x.shape)

    def _outside_route(self, route_fn: RouteFn, x_TH: torch.Tensor):
        """``route_fn``'s routing (step 2 from outside the layer), checked: its layout on the
        host (:func:`ep_moe.routing.check_routing`), its expert ids on the device. An id out of
        ``[0, num_experts)`` would move other tokens' rows (the dispatch sorts and counts by
        id); such a slot is left out instead, contributing nothing, and counted as dropped
        (:func:`ep_moe.routing.mask_out_of_range`; no host sync). With ``EP_MOE_DEBUG`` set,
        they raise instead, naming ``route_fn`` and the range (a host sync; at EP>1 the count
        summed over the EP group first, so every rank raises). Returns the routing as
        ``route_fn`` gave it (its stats are the layer's), the keep mask and routing to
        dispatch, and the slots out of range (None where there is a keep mask: it counts them)."""
        out = route_fn(x_TH)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"route_fn returned a {type(out).__name__}; return (RouterOutput, keep_TK or None)")
        router, keep_TK = out
        num_experts = self.config.num_experts
        check_routing(router, keep_TK, x_TH.shape[0], self.config.top_k, num_experts)
        dispatched, keep_TK, bad_TK = mask_out_of_range(router, keep_TK, num_experts)
        if debug_enabled() and not torch.compiler.is_compiling():
            _check_ids_in_range(router.topk_ids_TK, bad_TK, num_experts, self.ep_group)
        return router, keep_TK, dispatched, None if keep_TK is not None else bad_TK

    def _meta_forward(self, x: torch.Tensor, x_TH: torch.Tensor) -> torch.Tensor:
        """A forward on the meta device (shape inference before FSDP materialises the layer),
        of ``x`` checked and flattened to ``x_TH`` as any forward's: a meta output of its shape
        in the compute dtype and meta stats, both connected to the parameters as the real ones
        are (so their gradients have the parameters' shapes). No value is read and, at EP>1, no
        collective runs (the first real call still checks that the ranks agree)."""
        compute_dtype = x_TH.dtype
        params = [p for p in self.parameters() if p.is_floating_point()]
        tie = torch.stack([p.sum().to(self.config.router_dtype) for p in params]).sum() * 0
        y_TH = x_TH * 0 + tie.to(compute_dtype)
        meta = dict(device=x.device, dtype=torch.int64)
        object.__setattr__(self, "last_stats", MoEStats(
            aux_loss=tie, z_loss=tie.clone(), tokens_per_expert=torch.empty(self.config.num_experts, **meta),
            num_dropped=torch.empty((), **meta), with_autograd=torch.is_grad_enabled()))
        return y_TH.view(x.shape)

    def _input_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` checked and flattened to [T, H] in the compute dtype (step 1)."""
        compute_dtype = self._check_input(x) if self._config_agreed else self._agree_first_call(x)
        x_TH = x if x.dim() == 2 else x.reshape(-1, self.config.hidden_size)
        if debug_enabled() and not torch.compiler.is_compiling() and not x_TH.is_meta:
            # after the checks every rank passed: all of them reach its collective
            _check_finite_tokens(x_TH, self.ep_group)
        return x_TH if x_TH.dtype == compute_dtype else x_TH.to(compute_dtype)

    def _agree_first_call(self, x: torch.Tensor) -> torch.dtype:
        """First call at EP>1: every rank of the EP group checks that all have the same
        config, parameter dtype and input width and dtype (:func:`ep_moe.distributed.check_same_config`).
        A rank whose input fails its own check still takes part, then raises its error, so
        its peers raise too instead of waiting in a collective it never joins. Returns the
        :meth:`compute_dtype`. A meta input (shape inference, :meth:`_meta_forward`) is
        checked locally only, and the first real call agrees."""
        param = self.experts.first_weight
        if param.is_meta or (isinstance(x, torch.Tensor) and x.is_meta):
            return self._check_input(x)
        try:
            compute_dtype = self._check_input(x)
            failed = None
        except ValueError as err:
            failed = err
        others = {"parameter dtype": param.dtype, "input hidden size": x.shape[-1] if x.dim() else None,
                  "input dtype": x.dtype, "input passes the layer's checks": failed is None}
        try:
            check_same_config(dataclasses.replace(self.config, ep_size=self.ep_size), self.ep_group, param.device,
                              others)
        except ValueError:
            if failed is not None:
                raise failed from None
            raise
        if failed is not None:
            raise failed
        self._check_replicas_agree(param.device)
        self._config_agreed = True
        return compute_dtype

    def _replicated_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the parameters and buffers every rank of the EP group holds a
        copy of: all but the experts' (the router, the shared experts, the expert bias),
        less those another wrapper shards (DTensors) and meta ones."""
        experts = {id(t) for t in itertools.chain(self.experts.parameters(), self.experts.buffers())}
        return [(name, t) for name, t in itertools.chain(self.named_parameters(), self.named_buffers())
                if id(t) not in experts and not t.is_meta and not isinstance(t, DTensor)]

    def _check_replicas_agree(self, device: torch.device) -> None:
        """First call at EP>1: that the replicated parameters (:meth:`_replicated_tensors`) are
        equal on every rank of the EP group, else raise on every rank naming them and the fix.

        Chosen over broadcasting rank 0's values: ranks whose replicas differ usually point at
        a setup error (seeds, a checkpoint loaded on one rank) that a silent broadcast would
        hide from the rest of the model; :func:`ep_moe.parallel.broadcast_replicated` is the
        fix where the values should come from one rank. DDP broadcasts at construction, so a
        DDP model always passes. One all-gather of two float64 sums per tensor (position-
        weighted: a permutation shows), once per layer."""
        named = self._replicated_tensors()
        if not named:
            return
        mine = torch.stack([_fingerprint(t).to(device) for _, t in named])
        every = mine.new_empty((self.ep_size * mine.shape[0], 2))
        all_gather_single(every, mine, group=self.ep_group)
        every = every.view(self.ep_size, *mine.shape)
        same = (every == mine) | (every.isnan() & mine.isnan())
        differ = [name for (name, _), agree in zip(named, same.all(dim=2).all(dim=0).tolist()) if not agree]
        if differ:
            ranks = dist.get_process_group_ranks(self.ep_group)
            raise ValueError(f"MoELayer: the replicated parameters {differ} differ across the EP group (ranks {ranks} "
                             "of the world) on its first call; give every rank the same values: seed every rank "
                             "alike before building the model (torch.manual_seed), load the same checkpoint, or call "
                             "ep_moe.parallel.broadcast_replicated(model, ep_group) (DDP broadcasts rank 0's at "
                             "construction)")

    def _route(self, x_TH: torch.Tensor) -> tuple[RouterOutput, Optional[torch.Tensor]]:
        """The router's output and, with a capacity, which slots are kept (step 2)."""
        cfg = self.config
        router = route(
            x_TH, self.router.weight, top_k=cfg.top_k, score_func=cfg.score_func,
            norm_topk_prob=cfg.norm_topk_prob, aux_loss_coef=cfg.aux_loss_coef,
            z_loss_coef=cfg.z_loss_coef, expert_bias_E=self.expert_bias, router_dtype=cfg.router_dtype,
        )
        if cfg.capacity_factor is None:
            return router, None
        capacity = expert_capacity(cfg.capacity_factor, x_TH.shape[0], cfg.top_k, cfg.num_experts)
        return router, capacity_keep_mask(router.topk_ids_TK, router.topk_scores_TK, num_experts=cfg.num_experts,
                                          capacity=capacity, drop_policy=cfg.drop_policy)

    def _record(self, router: RouterOutput, keep_TK: Optional[torch.Tensor], with_autograd: bool,
                bound_dropped: Optional[torch.Tensor] = None, bad_slots: Optional[torch.Tensor] = None) -> None:
        # no autograd here (integer counts, the counts detached): no no_grad context, whose
        # entry and exit cost the host ~20 Python calls on every layer call
        if _in_backward():  # an activation checkpoint recomputing this forward: counted already
            return
        counts_E = router.counts_E  # int64: no gradient (a route_fn's may be another dtype)
        if counts_E.requires_grad:
            counts_E = counts_E.detach()
        num_dropped = bound_dropped
        if keep_TK is not None:
            by_capacity = keep_TK.numel() - keep_TK.sum()
            num_dropped = by_capacity if bound_dropped is None else by_capacity + bound_dropped
        elif num_dropped is None:
            num_dropped = torch.zeros((), dtype=torch.int64, device=counts_E.device)
        if bad_slots is not None:  # a route_fn's ids out of range, left out (_outside_route)
            num_dropped = num_dropped + bad_slots.sum()
        # past nn.Module.__setattr__, whose checks for parameters, buffers and submodules cost
        # more host time than the rest of this method and never apply to a plain attribute
        object.__setattr__(self, "last_stats", MoEStats(
            aux_loss=router.aux_loss, z_loss=router.z_loss, tokens_per_expert=counts_E,
            num_dropped=num_dropped, with_autograd=with_autograd,
        ))
        if self.expert_bias is not None and self.training:
            self._load_since_update += counts_E

    @torch.no_grad()
    def update_expert_bias(self, group: Optional[ProcessGroup] = None) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean_load - load)``.

        ``load`` is the tokens per expert counted over the training forwards since the last
        update, all-reduced over ``group``: every rank that trains this layer on its own
        tokens, so that the bias stays equal on all of them. The default, when
        ``torch.distributed`` is initialised, is the default group (every rank: EP, expert-
        and plain data parallelism); with pipeline or tensor parallelism pass the group of
        this layer's data-parallel replicas. Call on every rank of the group, e.g. after
        the optimizer step.
        """
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs MoEConfig(expert_bias=True)")
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        load_E = self._load_since_update.clone()
        if group_size(group) > 1:
            dist.all_reduce(load_E, group=group)
        load_E = load_E.double()  # counts compared exactly, whatever the bias's dtype
        step_E = self.config.bias_update_rate * torch.sign(load_E.mean() - load_E)
        self.expert_bias += step_E.to(self.expert_bias.dtype)
        self._load_since_update.zero_()

    def reset_load_count(self) -> None:
        """Forget the tokens per expert counted since the last :meth:`update_expert_bias`
        (e.g. after forwards that were not training steps, as CUDA graph capture's warm-up)."""
        if self._load_since_update is not None:
            self._load_since_update.zero_()


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (as a checkpoint's recomputed forward does)."""
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of ``aux_loss + z_loss`` of every MoE layer's last forward (a 0-dim tensor,
    zero when there is none); add it to the training loss before ``backward``.

    Warns when a layer in training mode, with a loss coefficient, ran its last forward
    without autograd while autograd is on now: those losses carry no gradient. That is what a reentrant activation checkpoint does (its first forward
    runs under ``no_grad``); use ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``, which keeps the losses differentiable."""
    layers = [m for m in moe_layers(model) if m.last_stats is not None]
    if torch.is_grad_enabled():
        lost = [m for m in layers if m.training and not m.last_stats.with_autograd
                and (m.config.aux_loss_coef > 0 or m.config.z_loss_coef > 0)]
        if lost:
            warnings.warn(f"moe_aux_loss: {len(lost)} MoE layer(s) computed their aux/z losses without "
                          "autograd (under torch.no_grad or a reentrant activation checkpoint), so the "
                          "losses will not train the router; checkpoint with use_reentrant=False",
                          stacklevel=2)
    stats = [m.last_stats for m in layers]
    if not stats:
        param = next(model.parameters(), None)
        return torch.zeros((), device=None if param is None else param.device)
    return sum(s.aux_loss + s.z_loss for s in stats)


def expert_load(model: nn.Module) -> torch.Tensor:
    """[num_layers, E] int64 tokens per global expert of each MoE layer's last forward
    (this rank's tokens; all-reduce over every rank for the whole job). Layers
    must share E; layers not yet run are skipped."""
    counts = [m.last_stats.tokens_per_expert for m in moe_layers(model) if m.last_stats is not None]
    if not counts:
        return torch.zeros((0, 0), dtype=torch.int64)
    return torch.stack(counts)


def update_expert_biases(model: nn.Module, group: Optional[ProcessGroup] = None) -> None:
    """:meth:`MoELayer.update_expert_bias` on every MoE layer with ``expert_bias=True``."""
    for m in moe_layers(model):
        if m.expert_bias is not None:
            m.update_expert_bias(group)


__all__ = ["MoEConfig", "MoELayer", "MoEStats", "expert_load", "moe_aux_loss", "update_expert_biases"]
