"""The expert-parallel MoE layer: wires the router, the dispatch and the grouped GEMMs.

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
``experts.gate_up.{g}`` ([2I, H] or [I, H]) and ``experts.down.{g}`` ([H, I]); each rank's
``state_dict()`` holds only its own experts plus the replicated parameters. To merge the
per-rank shards into one checkpoint, ``merged = {}; for sd in shards: merged.update(sd)``
(expert keys are disjoint; replicated keys are equal on every rank). ``load_state_dict``
at any EP size accepts the merged dict or any dict that holds at least this rank's
experts: each rank picks its experts' keys and ignores the others (resharding on load).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ep_moe.copy_engine import CopyEngineGather, SymmetricWorkspace, copy_engine_supported
from ep_moe.dispatch import (
    NcclExchange,
    all_gather_single,
    group_size,
    pack_rows,
    rank_splits,
    start_dispatch_packed,
    start_gather_counts,
)
from ep_moe.gathered import GatherExchange, TokenCountCheck, gathered_routing, row_bound
from ep_moe.kernels.activation import swiglu
from ep_moe.kernels.config import GemmConfigs
from ep_moe.kernels.ops import grouped_gemm, grouped_gemm_slot_sum
from ep_moe.kernels.permute import gather_tokens, permute_tokens, sum_slot_rows
from ep_moe.parallel import mark_expert_param, resolve_ep_group
from ep_moe.pipeline import expert_pipeline
from ep_moe.routing import (
    DropPolicy,
    RouterOutput,
    RoutingMetadata,
    ScoreFunc,
    build_rank_routing,
    build_routing_metadata,
    capacity_keep_mask,
    combine_slots,
    expert_capacity,
    rank_counts,
    route,
)

if TYPE_CHECKING:
    from ep_moe.autotune.space import GemmProblem

Activation = Literal["swiglu", "gelu", "relu"]
_ACTIVATIONS = ("swiglu", "gelu", "relu")
_BACKENDS = ("auto", "triton", "torch")
Dispatch = Literal["all_to_all", "all_gather", "all_gather_copy_engine"]
_DISPATCHES = ("all_to_all", "all_gather", "all_gather_copy_engine")
_REMOVED_FIELDS = {
    "transport": "the transport is part of the dispatch now: dispatch='all_gather_copy_engine' for the "
                 "all-gather on the copy engines; the all-to-all runs on NCCL",
    "own_rows_first": "it measured slower on every shape and was removed; drop it",
    "overlap_chunks": "chunked overlap measured slower on every shape and was removed; drop it",
}
"""Fields MoEConfig no longer has, and what to do instead."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape and behaviour of one MoE layer. Validated on construction."""

    hidden_size: int
    """H, the model dimension (input and output features)."""
    intermediate_size: int
    """I, the hidden dimension of each expert MLP."""
    num_experts: int
    """E, experts in total over the EP group."""
    top_k: int
    """K, experts each token is sent to (1 <= K <= E)."""
    activation: Activation = "swiglu"
    """Expert MLP: ``"swiglu"`` (gate_up is [2I, H]: rows 0..I-1 gate, I..2I-1 up;
    ``silu(gate) * up``), or ``"gelu"`` (exact erf form) / ``"relu"`` (gate_up is [I, H])."""
    score_func: ScoreFunc = "softmax"
    """Router scores from logits: ``"softmax"`` over experts or per-expert ``"sigmoid"``."""
    norm_topk_prob: bool = True
    """Divide the K chosen scores by their sum so each token's combine weights sum to 1."""
    aux_loss_coef: float = 1e-2
    """Load-balancing loss coefficient (Switch/GShard, ``E * sum_e f_e * P_e``); 0 disables.
    1e-2 is the usual recipe value (Switch Transformer, Mixtral-style training)."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE, ``mean logsumexp(logits)^2``; 1e-3 is typical)."""
    expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for
    top-k selection only, moved by ``bias_update_rate`` towards balance by
    :meth:`MoELayer.update_expert_bias`."""
    bias_update_rate: float = 1e-3
    """Step of the expert-bias update: ``bias += rate * sign(mean_load - load)``."""
    capacity_factor: Optional[float] = None
    """None: dropless. Otherwise each expert keeps at most ``ceil(c * T * K / E)`` slots of
    this rank's T tokens; dropped slots contribute 0 to the output (the token keeps its
    other slots, whose weights are not renormalised). At EP=1 it costs one extra host sync."""
    drop_policy: DropPolicy = "probs"
    """Which slots an expert over capacity keeps: ``"probs"`` highest router score first,
    ``"position"`` earliest tokens first."""
    num_shared_experts: int = 0
    """Shared experts applied to every token (one dense MLP of the same activation, fused
    from all shared experts); their output is added to the routed output."""
    shared_intermediate_size: Optional[int] = None
    """Hidden size of that fused MLP; default ``num_shared_experts * intermediate_size``."""
    router_dtype: torch.dtype = torch.float32
    """Dtype of the router logits, scores, top-k weights and losses."""
    backend: Literal["auto", "triton", "torch"] = "auto"
    """Grouped GEMM: ``"triton"`` kernels, ``"torch"`` reference, or ``"auto"``: Triton
    when the input is on CUDA, the reference otherwise."""
    init_std: float = 0.02
    """Std of the normal init of the router, expert and shared-expert weights."""
    ep_size: Optional[int] = None
    """Expected EP size; when set, the layer checks that its group has this many ranks
    (None: whatever the group has, 1 without a group)."""
    dispatch: Dispatch = "all_to_all"
    """EP>1: how tokens reach the experts and come back.

    - ``"all_to_all"``: each token goes to the ranks of its experts (uneven
      ``all_to_all_single`` on NCCL), one host sync per call for the split sizes. Takes any
      token count per rank; sends each token once per destination rank.
    - ``"all_gather"``: every rank receives every token of the EP group and the partial
      outputs come back summed (:mod:`ep_moe.gathered`, NCCL): no host sync, so the layer
      can be captured in CUDA graphs; more bytes where tokens reach few of the ranks. Needs
      the same token count on every rank.
    - ``"all_gather_copy_engine"``: the all-gather with the tokens (and the backward's output
      gradients) pulled on the GPUs' copy engines through a symmetric-memory workspace, the
      experts' first GEMM starting on the rank's own tokens while the others land, and the
      forward's sums pushed back on them (:class:`ep_moe.copy_engine.CopyEngineGather`). One
      node, an NCCL group, CUDA; raises on the first call otherwise."""
    all_gather_row_bound: Optional[float] = None
    """``dispatch="all_gather"``: the most routed rows a rank computes, as a multiple of
    T*K (its share on average); None: the worst case ``P*T*min(K, E/P)``, never exceeded,
    which sizes the expert activations for it (P times the average at K <= E/P). Slots
    past a set bound are dropped (their expert's last ones first) and counted in
    ``last_stats.num_dropped``."""

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name}={value!r}: must be a positive int")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                             f"lower top_k to at most {self.num_experts} or add experts")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation={self.activation!r}: use one of {_ACTIVATIONS}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig.score_func={self.score_func!r}: use 'softmax' or 'sigmoid'")
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"MoEConfig.drop_policy={self.drop_policy!r}: use 'probs' or 'position'")
        if self.backend not in _BACKENDS:
            raise ValueError(f"MoEConfig.backend={self.backend!r}: use one of {_BACKENDS}")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"MoEConfig.{name}={value!r}: must be >= 0 (0 disables it)")
        if self.dispatch not in _DISPATCHES:
            raise ValueError(f"MoEConfig.dispatch={self.dispatch!r}: use one of {_DISPATCHES}")
        if self.all_gather_row_bound is not None and not self.all_gather_row_bound > 0:
            raise ValueError(f"MoEConfig.all_gather_row_bound={self.all_gather_row_bound!r}: must be > 0, "
                             "or None for the worst case")
        if not self.init_std > 0:
            raise ValueError(f"MoEConfig.init_std={self.init_std!r}: must be > 0")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor={self.capacity_factor!r}: must be > 0, "
                             "or None for dropless routing")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"MoEConfig.num_shared_experts={self.num_shared_experts!r}: must be an int >= 0")
        if self.shared_intermediate_size is not None:
            if self.num_shared_experts == 0:
                raise ValueError(f"MoEConfig.shared_intermediate_size={self.shared_intermediate_size} "
                                 "is set but num_shared_experts=0; set num_shared_experts >= 1 or drop it")
            if self.shared_intermediate_size < 1:
                raise ValueError(f"MoEConfig.shared_intermediate_size={self.shared_intermediate_size}: "
                                 "must be a positive int")
        if not (isinstance(self.router_dtype, torch.dtype) and self.router_dtype.is_floating_point):
            raise ValueError(f"MoEConfig.router_dtype={self.router_dtype!r}: use a float dtype, "
                             "normally torch.float32")
        if self.ep_size is not None:
            if self.ep_size < 1 or self.num_experts % self.ep_size != 0:
                raise ValueError(f"MoEConfig.num_experts={self.num_experts} is not divisible by "
                                 f"ep_size={self.ep_size}; pick an ep_size that divides num_experts")

    def _check_types(self) -> None:
        """Numbers and flags of the right type (a TOML or ``--set`` string, None where a
        number belongs, a bool for an int), before the range checks compare them."""
        optional = {"capacity_factor", "all_gather_row_bound", "shared_intermediate_size", "ep_size"}
        kinds = {**dict.fromkeys(("hidden_size", "intermediate_size", "num_experts", "top_k", "num_shared_experts",
                                  "shared_intermediate_size", "ep_size"), "an int"),
                 **dict.fromkeys(("aux_loss_coef", "z_loss_coef", "bias_update_rate", "init_std", "capacity_factor",
                                  "all_gather_row_bound"), "a finite number"),
                 **dict.fromkeys(("norm_topk_prob", "expert_bias"), "True or False")}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if kind == "True or False":
                ok = isinstance(value, bool)
            elif kind == "an int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok:
                raise ValueError(f"MoEConfig.{name}={value!r}: must be {kind}"
                                 f"{', or None' if name in optional else ''}")

    @property
    def gathers(self) -> bool:
        """Whether the dispatch all-gathers the tokens (needs equal token counts per rank)."""
        return self.dispatch != "all_to_all"

    @property
    def gate_up_size(self) -> int:
        """Output features of the gate_up projection: 2I for SwiGLU, else I."""
        return 2 * self.intermediate_size if self.activation == "swiglu" else self.intermediate_size


def _refusing_removed_fields(init):
    """``MoEConfig.__init__`` that names the replacement of a removed field instead of
    raising a bare ``TypeError`` (a config file or ``--set moe.transport=...``)."""
    @functools.wraps(init)
    def checked(self, **kwargs):
        for name in sorted(kwargs.keys() & _REMOVED_FIELDS.keys()):
            raise ValueError(f"MoEConfig.{name} no longer exists: {_REMOVED_FIELDS[name]}")
        init(self, **kwargs)
    return checked


MoEConfig.__init__ = _refusing_removed_fields(MoEConfig.__init__)


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
    ``dispatch="all_gather"`` with a row bound, slots of this rank's experts past it
    (always 0 when dropless)."""
    with_autograd: bool = True
    """Whether the forward ran with autograd on, so that the losses carry gradients (False
    under ``torch.no_grad``, and in the first forward of a reentrant activation checkpoint)."""


def _activate(h_RF: torch.Tensor, activation: Activation, backend: str,
              num_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The expert activation; ``num_rows`` (device count): only the first rows are in use
    (the rest are neither computed nor given a gradient on the Triton SwiGLU path)."""
    if activation == "swiglu":
        if backend == "triton":
            return swiglu(h_RF, num_rows)  # one fused pass forward and backward
        gate_RI, up_RI = h_RF.chunk(2, dim=-1)
        return F.silu(gate_RI) * up_RI
    if activation == "gelu":
        return F.gelu(h_RF)
    return F.relu(h_RF)


def _resolve_backend(backend: str, x: torch.Tensor) -> str:
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    return backend


@torch.compiler.disable  # a cache lookup (maybe file reads): run eagerly, the configs enter as constants
def _kernel_configs(problem: "GemmProblem", num_rows: int, device: torch.device) -> Optional[GemmConfigs]:
    """Tuned configs for one Triton GEMM call, or None (the kernels' defaults) when the
    autotuner is not available."""
    try:
        from ep_moe.autotune import get_kernel_configs
    except ImportError:
        return None
    return get_kernel_configs(problem, num_rows, device)


class GroupedExperts(nn.Module):
    """The e local experts as two stacked weights; math only (no communication).

    ``gate_up`` is [e, 2I, H] (SwiGLU) or [e, I, H], ``down`` is [e, H, I], both
    ``out_features`` before ``in_features`` as :func:`ep_moe.grouped_gemm` expects. Local
    expert j is global expert ``first_expert + j``; the state dict uses global ids.
    """

    def __init__(self, config: MoEConfig, num_local_experts: int, first_expert: int,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.activation = config.activation
        self.num_local_experts = num_local_experts
        self.first_expert = first_expert
        factory = dict(device=device, dtype=dtype)
        self.gate_up = mark_expert_param(nn.Parameter(torch.empty(
            num_local_experts, config.gate_up_size, config.hidden_size, **factory)))
        self.down = mark_expert_param(nn.Parameter(torch.empty(
            num_local_experts, config.hidden_size, config.intermediate_size, **factory)))
        self.register_state_dict_post_hook(_split_experts_hook)
        self.register_load_state_dict_pre_hook(_stack_experts_hook)
        self.register_load_state_dict_post_hook(_mark_experts_hook)

    def global_ids(self) -> range:
        """Global ids of the local experts."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    @torch.no_grad()
    def reset_parameters(self, std: float, seed: int) -> None:
        """N(0, std) init, expert g drawn from a generator seeded with ``seed + g``, so the
        global weights are the same at every EP size for the same ``seed``. No-op on the
        meta device (deferred init)."""
        if self.gate_up.is_meta:
            return
        for j, g in enumerate(self.global_ids()):
            gen = torch.Generator(device=self.gate_up.device).manual_seed(seed + g)
            self.gate_up[j].normal_(0.0, std, generator=gen)
            self.down[j].normal_(0.0, std, generator=gen)

    def forward(
        self,
        x: torch.Tensor,
        m_sizes_e: torch.Tensor,
        *,
        gather_index: Optional[torch.Tensor] = None,
        scatter_index: Optional[torch.Tensor] = None,
        row_weights: Optional[torch.Tensor] = None,
        backend: str = "torch",
        configs: tuple[Optional[GemmConfigs], Optional[GemmConfigs]] = (None, None),
    ) -> torch.Tensor:
        """GEMM1 (gather on load), activation, GEMM2 (scatter and row weights on store).

        Rows are in expert order (``m_sizes_e`` rows per local expert); row r reads
        ``x[gather_index[r]]`` and its output lands at ``scatter_index[r]``.
        """
        return expert_mlp(x, self.gate_up, self.down, m_sizes_e, activation=self.activation,
                          gather_index=gather_index, scatter_index=scatter_index, row_weights=row_weights,
                          backend=backend, configs=configs)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, m_sizes_e: torch.Tensor, *,
               activation: Activation, gather_index: Optional[torch.Tensor] = None,
               scatter_index: Optional[torch.Tensor] = None, row_weights: Optional[torch.Tensor] = None,
               backend: str = "torch",
               configs: tuple[Optional[GemmConfigs], Optional[GemmConfigs]] = (None, None),
               slot_sum: Optional[RoutingMetadata] = None, bounded_rows: bool = False) -> torch.Tensor:
    """The math of :meth:`GroupedExperts.forward` with the weights passed in. ``slot_sum``:
    the output rows summed per token over ``slot_sum``'s slots ([T, H];
    :func:`~ep_moe.kernels.permute.sum_slot_rows`), fused with the down projection on the
    Triton backend (:func:`~ep_moe.kernels.ops.grouped_gemm_slot_sum`; no scatter then).
    ``bounded_rows``: the rows are a bound, ``m_sizes`` counts fewer (see
    :func:`~ep_moe.kernels.ops.grouped_gemm`)."""
    # Under autocast x arrives in the autocast dtype; the weights follow (a no-op otherwise).
    h_RF = grouped_gemm(x, gate_up.to(x.dtype), m_sizes_e, gather_index=gather_index,
                        configs=configs[0], backend=backend, bounded_rows=bounded_rows)
    a_RI = _activate(h_RF, activation, backend, m_sizes_e.sum() if bounded_rows else None)
    if slot_sum is not None and backend == "triton":
        return grouped_gemm_slot_sum(a_RI, down.to(x.dtype), m_sizes_e, row_weights, slot_sum.token_index_R,
                                     slot_sum.row_of_slot_N, slot_sum.top_k, configs[1], bounded_rows,
                                     source_ends=slot_sum.source_ends_ES)
    y_RH = grouped_gemm(a_RI, down.to(x.dtype), m_sizes_e, scatter_index=scatter_index,
                        row_weights=row_weights, configs=configs[1], backend=backend, bounded_rows=bounded_rows)
    return y_RH if slot_sum is None else sum_slot_rows(y_RH, slot_sum, backend)


def _split_experts_hook(module: GroupedExperts, state_dict, prefix, local_metadata) -> None:
    """state_dict: ``gate_up`` [e, ...] -> ``gate_up.{global id}`` per expert (same for down)."""
    for name in ("gate_up", "down"):
        stacked = state_dict.pop(prefix + name)
        for j, g in enumerate(module.global_ids()):
            state_dict[f"{prefix}{name}.{g}"] = stacked[j]


def _mark_experts_hook(module: GroupedExperts, incompatible_keys) -> None:
    """load_state_dict(assign=True) puts new Parameters in place: tag those as experts too."""
    mark_expert_param(module.gate_up)
    mark_expert_param(module.down)


def _stack_experts_hook(module: GroupedExperts, state_dict, prefix, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict: pick this rank's ``gate_up.{g}`` / ``down.{g}`` keys, stack them,
    and drop the other experts' keys (they belong to other ranks). A missing expert is
    reported by the key ``state_dict()`` gives it, and keeps its weights."""
    for name in ("gate_up", "down"):
        key_prefix = f"{prefix}{name}."
        per_expert = [k for k in state_dict if k.startswith(key_prefix) and k[len(key_prefix):].isdigit()]
        if prefix + name in state_dict:
            continue
        current = getattr(module, name).detach()
        local = []
        for j, g in enumerate(module.global_ids()):
            key = f"{key_prefix}{g}"
            if key in state_dict:
                local.append(state_dict[key])
            else:
                missing_keys.append(key)
                local.append(current[j])
        for key in per_expert:
            del state_dict[key]
        # on a meta module (built to load with assign=True) the loaded tensors stay where they are
        state_dict[prefix + name] = torch.stack([t if current.is_meta else t.to(current.device) for t in local])


class SharedExperts(nn.Module):
    """Dense MLP applied to every token (all shared experts fused into one)."""

    def __init__(self, config: MoEConfig, device=None, dtype=None) -> None:
        super().__init__()
        inter = config.shared_intermediate_size or config.num_shared_experts * config.intermediate_size
        self.activation = config.activation
        up_size = 2 * inter if config.activation == "swiglu" else inter
        self.gate_up = nn.Linear(config.hidden_size, up_size, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(inter, config.hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x_TH: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """[T, H] -> [T, H]; ``backend="triton"`` fuses the SwiGLU."""
        return self.down(_activate(self.gate_up(x_TH), self.activation, backend))


@dataclass
class _RowsInFlight:
    """What the all-to-all path's first half hands its second: the routed rows on their way."""

    x_TH: torch.Tensor
    backend: str
    counts: list
    routing: object
    weights_U: torch.Tensor
    packed_in: object
    exchange: NcclExchange
    send_rows: torch.Tensor
    rows_in: object


class MoELayer(nn.Module):
    """Expert-parallel Mixture-of-Experts layer, dropless by default.

    Args:
        config: the :class:`MoEConfig`.
        ep_group: ``None`` (EP=1: all experts here, no collectives), a ProcessGroup, or a
            1-D DeviceMesh of the expert-parallel axis (e.g. ``mesh["ep"]``, see
            :mod:`ep_moe.parallel`). Rank p of the group holds global experts
            ``p*e .. p*e+e-1`` with ``e = num_experts / ep_size``.
        device, dtype: of the parameters.

    Parameters: ``router.weight`` [E, H], ``experts.gate_up`` [e, 2I or I, H],
    ``experts.down`` [e, H, I] (tagged as expert parameters, see
    :func:`ep_moe.parallel.sync_gradients`), ``shared_experts.*`` when configured, and the
    buffer ``expert_bias`` [E] when ``expert_bias=True``. Init: every weight N(0,
    ``init_std``); the router and shared experts from the default RNG (seed all ranks
    alike to get replicas that agree), the experts so that the global weights do not
    depend on the EP size (:meth:`GroupedExperts.reset_parameters`).
    """

    def __init__(self, config: MoEConfig, ep_group: Union[None, ProcessGroup, DeviceMesh] = None,
                 *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.ep_group = resolve_ep_group(ep_group)
        self.ep_size = group_size(self.ep_group)
        if config.ep_size is not None and config.ep_size != self.ep_size:
            raise ValueError(f"ep_group has {self.ep_size} ranks but MoEConfig.ep_size={config.ep_size}; "
                             f"pass a group of {config.ep_size} ranks (ep_moe.parallel.build_ep_groups) "
                             "or change ep_size")
        if config.num_experts % self.ep_size != 0:
            raise ValueError(f"MoEConfig.num_experts={config.num_experts} is not divisible by the "
                             f"ep_group size {self.ep_size}; use an EP size that divides num_experts")
        self.ep_rank = 0 if self.ep_group is None else dist.get_rank(self.ep_group)
        self.num_local_experts = config.num_experts // self.ep_size
        worst = self.ep_size * min(config.top_k, self.num_local_experts) / config.top_k
        if config.gathers and config.all_gather_row_bound is None and worst >= 4:
            warnings.warn(f"MoEConfig.dispatch={config.dispatch!r} at EP={self.ep_size} sizes the expert activations for "
                          f"the worst case, {worst:g}x the average routed rows; set all_gather_row_bound (e.g. 2.0: "
                          "slots past it are dropped and counted in last_stats.num_dropped) to cap the memory",
                          stacklevel=2)
        factory = dict(device=device, dtype=dtype)
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False, **factory)
        self.experts = GroupedExperts(config, self.num_local_experts,
                                      self.ep_rank * self.num_local_experts, **factory)
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
        self._token_count_check = TokenCountCheck() if config.gathers and self.ep_size > 1 else None
        self._config_agreed = self.ep_size == 1  # checked equal over the EP group on the first forward
        self.reset_parameters()

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

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Documented init (see the class docstring); draws from the default RNG."""
        std = self.config.init_std
        self.router.weight.normal_(0.0, std)
        expert_seed = int(torch.randint(0, 2**62, (), device="cpu").item())  # also under a meta default device
        self.experts.reset_parameters(std, expert_seed)
        if self.shared_experts is not None:
            self.shared_experts.gate_up.weight.normal_(0.0, std)
            self.shared_experts.down.weight.normal_(0.0, std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self._load_since_update.zero_()

    def compute_dtype(self) -> torch.dtype:
        """The dtype the experts compute in: autocast's when it is on for the parameters'
        device (as ``nn.Linear`` does), else the parameters' own."""
        param = self.experts.gate_up
        if torch.is_autocast_enabled(param.device.type):
            return torch.get_autocast_dtype(param.device.type)
        return param.dtype

    def gemm_problems(self) -> list["GemmProblem"]:
        """The two grouped GEMMs of this layer, as :mod:`ep_moe.autotune` keys them (in
        :meth:`compute_dtype`: call ``warmup`` under the training autocast)."""
        from ep_moe.autotune.space import GemmProblem  # lazy: ep_moe.autotune may import this module

        cfg = self.config
        common = dict(num_local_experts=self.num_local_experts, top_k=cfg.top_k,
                      dtype=str(self.compute_dtype()).removeprefix("torch."))
        return [
            GemmProblem(projection="gate_up", n=cfg.gate_up_size, k=cfg.hidden_size, **common),
            GemmProblem(projection="down", n=cfg.hidden_size, k=cfg.intermediate_size, **common),
        ]

    def _check_input(self, x: torch.Tensor) -> None:
        hidden, param = self.config.hidden_size, self.experts.gate_up
        if x.dim() < 1 or x.shape[-1] != hidden:
            raise ValueError(f"x has shape {tuple(x.shape)} but the layer's hidden_size is {hidden}; "
                             f"pass x as [..., {hidden}]")
        if x.dtype != param.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"x dtype {x.dtype} does not match the layer's parameter dtype {param.dtype}; "
                             f"cast x with x.to({param.dtype}) or the layer with layer.to({x.dtype})")
        if x.device != param.device:
            raise ValueError(f"x is on {x.device} but the layer is on {param.device}; move one of them")
        if self.compute_dtype() not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the layer computes in {self.compute_dtype()}, but its experts run in float32, "
                             "float16 or bfloat16; cast the layer (layer.float()) and x, or run under autocast")

    @torch.compiler.disable  # a collective and a host read, once
    def _agree_config(self, device: torch.device) -> None:
        """Raise unless every rank of the EP group built this layer with the same config
        (one small all-gather and a host read, on the first forward). Ranks whose settings
        differ (``top_k``, ``dispatch``, ...) would exchange messages of
        different sizes, which aborts gloo and can hang NCCL."""
        config = dataclasses.replace(self.config, ep_size=self.ep_size)  # None: the group's size
        names = [field.name for field in dataclasses.fields(config)]
        mine = torch.tensor([_digest(getattr(config, name)) for name in names], dtype=torch.int64, device=device)
        every = mine.new_empty(self.ep_size * len(names))
        all_gather_single(every, mine, group=self.ep_group)
        differ = [name for name, column in zip(names, every.view(self.ep_size, -1).T.tolist()) if len(set(column)) > 1]
        if differ:
            mine_values = ", ".join(f"{name}={getattr(config, name)!r}" for name in differ)
            raise ValueError(f"the MoEConfig of this layer differs across the EP group in {differ} (this rank: "
                             f"{mine_values}); build the layer with the same MoEConfig on every rank")
        self._config_agreed = True

    def _configs(self, backend: str, num_rows: int, device: torch.device
                 ) -> tuple[Optional[GemmConfigs], Optional[GemmConfigs]]:
        """(gate_up, down) kernel configs for a Triton call over ``num_rows`` rows."""
        if backend != "triton":
            return (None, None)
        return tuple(_kernel_configs(p, num_rows, device) for p in self.gemm_problems())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MoE forward, ``x`` [..., H] -> same shape and dtype (under autocast, the
        autocast dtype, as ``nn.Linear``; the router stays in ``router_dtype``). Steps:

        1. Router (fp32): scores, top-k (expert bias for selection only), renormalise;
           aux and z losses (``last_stats``).
        2. Routing metadata on the device: per-expert counts, stable sort of the (token,
           slot) pairs by expert, gather (token) and scatter (slot) indices; capacity
           drops when configured.
        3. EP>1: exchange per-rank counts, one host sync for the split sizes; each token
           goes once to every rank that holds one of its experts (``all_to_all_single``,
           uneven splits), with its local expert ids and top-k weights there. With
           ``dispatch="all_gather"`` instead: every rank gets every token of the group
           (no host sync for a token count met before; :mod:`ep_moe.gathered`).
        4. Experts (on the arrived rows at EP>1): GEMM1 (gate_up) with gather on load;
           activation; GEMM2 (down) with the top-k weights multiplied in (fp32), scattered
           to slot order at EP=1; each row's slots summed.
        5. EP>1: reverse all-to-all of one row per row received, summed per token (or
           the partial sums reduce-scattered); plus the shared experts.
        """
        self._check_input(x)
        cfg = self.config
        x_TH = x.reshape(-1, cfg.hidden_size).to(self.compute_dtype())
        if not self._config_agreed:
            self._agree_config(x_TH.device)
        if self._token_count_check is not None:  # the counts travel while the router runs
            self._token_count_check.start(x_TH.shape[0], self.ep_group, x_TH.device)
        router = route(
            x_TH, self.router.weight, top_k=cfg.top_k, score_func=cfg.score_func,
            norm_topk_prob=cfg.norm_topk_prob, aux_loss_coef=cfg.aux_loss_coef,
            z_loss_coef=cfg.z_loss_coef, expert_bias_E=self.expert_bias, router_dtype=cfg.router_dtype,
        )
        keep_TK = None
        if cfg.capacity_factor is not None:
            capacity = expert_capacity(cfg.capacity_factor, x_TH.shape[0], cfg.top_k, cfg.num_experts)
            keep_TK = capacity_keep_mask(router.topk_ids_TK, router.topk_scores_TK, num_experts=cfg.num_experts,
                                         capacity=capacity, drop_policy=cfg.drop_policy)
        backend = _resolve_backend(cfg.backend, x)
        bound_dropped = None
        if self.ep_size == 1:
            y_TH = self._experts_local(x_TH, router, keep_TK, backend)
            shared_TH = None if self.shared_experts is None else self.shared_experts(x_TH, backend)
        elif cfg.gathers:
            y_TH, bound_dropped = self._experts_gathered(x_TH, router, keep_TK, backend)
            shared_TH = None if self.shared_experts is None else self.shared_experts(x_TH, backend)
        else:  # the shared experts' GEMMs go to the GPU while the routed rows travel
            in_flight = self._dispatch_experts_parallel(x_TH, router, keep_TK, backend)
            shared_TH = None if self.shared_experts is None else self.shared_experts(x_TH, backend)
            y_TH = self._finish_experts_parallel(in_flight)
        if shared_TH is not None:
            y_TH = y_TH + shared_TH
        self._record(router, keep_TK, torch.is_grad_enabled(), bound_dropped)
        return y_TH.view(x.shape)

    def _experts_local(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                       backend: str) -> torch.Tensor:
        """EP=1: one gather GEMM, one scatter GEMM with the top-k weights fused in."""
        meta = build_routing_metadata(router.topk_ids_TK, self.config.num_experts, keep_TK)
        weights_N = router.topk_weights_TK.flatten()
        configs = self._configs(backend, meta.slot_index_R.shape[0], x_TH.device)
        if meta.dropless:
            y_NH = self.experts(x_TH, meta.counts_E, gather_index=meta.token_index_R,
                                scatter_index=meta.slot_index_R, row_weights=weights_N,
                                backend=backend, configs=configs)
            return combine_slots(y_NH, meta)
        y_RH = self.experts(x_TH, meta.counts_E, gather_index=meta.token_index_R,
                            row_weights=weights_N[meta.slot_index_R], backend=backend, configs=configs)
        return sum_slot_rows(y_RH, meta, backend)

    @torch.compiler.disable  # async collectives, a host read for a new count: eager, as the a2a path
    def _experts_gathered(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                          backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """EP>1 by all-gather (:mod:`ep_moe.gathered`): every token of the group through this
        rank's experts where it chose them, the partial sums reduce-scattered back, through
        the expert pipeline (:mod:`ep_moe.pipeline`: the backward's input gradients travel
        back under the dW GEMMs). Returns ([T, H], slots dropped past the row bound)."""
        cfg, num_local = self.config, self.num_local_experts
        num_tokens, top_k = router.topk_ids_TK.shape
        self._token_count_check.finish()  # before any collective sized by the count
        ids_TK = router.topk_ids_TK.to(torch.int32)
        if keep_TK is not None:
            ids_TK = ids_TK.masked_fill(~keep_TK, -1)
        exchange = self._gather_exchange(x_TH, backend)
        # the expert ids (as bits) and the top-k weights in one message (their gradients go
        # back through the pipeline), then the tokens, which travel while the gathered slots
        # are routed
        weights_TK = router.topk_weights_TK
        packed = exchange.dispatch(torch.cat([ids_TK.view(torch.float32), weights_TK.detach().float()], 1), "ids")
        dispatched = exchange.dispatch(x_TH, "rows")
        packed_GK = packed.wait()
        arrived_weights = packed_GK[:, top_k:].to(weights_TK.dtype)
        max_rows = row_bound(cfg.all_gather_row_bound, num_tokens, top_k, self.ep_size, num_local)
        local, num_dropped = gathered_routing(packed_GK[:, :top_k].contiguous().view(torch.int32),
                                              self.ep_rank * num_local, num_local, max_rows,
                                              num_sources=self.ep_size, first_source=self.ep_rank)
        # configs for the rows a rank computes on average (what tuning targets), not the bound
        configs = self._configs(backend, num_tokens * top_k, x_TH.device)

        def experts(rows_GH: torch.Tensor, weights_GK: torch.Tensor, local: RoutingMetadata,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
            return expert_mlp(rows_GH, gate_up, down, local.counts_E, activation=cfg.activation,
                              gather_index=local.token_index_R,
                              row_weights=weights_GK.reshape(-1).index_select(0, local.slot_index_R),
                              backend=backend, configs=configs, slot_sum=local, bounded_rows=True)

        y_TH = expert_pipeline(experts, local, exchange, self.experts.gate_up, self.experts.down, x_TH, weights_TK,
                               arrived_weights, dispatched)
        return y_TH, num_dropped

    def _gather_exchange(self, x_TH: torch.Tensor, backend: str) -> GatherExchange:
        """The all-gather dispatch's collectives, on NCCL or (``"all_gather_copy_engine"``)
        the copy engines."""
        group = self.ep_group
        if self.config.dispatch == "all_gather":
            return GatherExchange(group)
        _check_copy_engine(group)
        workspace = SymmetricWorkspace.for_group(group, x_TH.device)
        # only the Triton GEMMs wait for rows source by source; the reference reads them whole
        return CopyEngineGather(group, workspace, x_TH.shape[0], x_TH.shape[1] * x_TH.element_size(),
                                landing=backend == "triton")

    def _experts_parallel(self, x_TH: torch.Tensor, router: RouterOutput, keep_TK: Optional[torch.Tensor],
                          backend: str) -> torch.Tensor:
        """The routed experts at EP>1, dispatch to combine, with nothing in between."""
        return self._finish_experts_parallel(self._dispatch_experts_parallel(x_TH, router, keep_TK, backend))

    # Both halves of the EP path run eagerly under torch.compile: host syncs, collectives
    # and side streams make graph breaks of nearly every line, and Dynamo 2.11 fails
    # (KeyError) tracing their comprehensions.
    @torch.compiler.disable
    def _dispatch_experts_parallel(self, x_TH: torch.Tensor, router: RouterOutput,
                                   keep_TK: Optional[torch.Tensor], backend: str) -> _RowsInFlight:
        """EP>1 up to the rows' dispatch (:meth:`_finish_experts_parallel` does the rest):
        each token sent once to every rank that holds one of its experts, with its local
        expert ids and top-k weights there (:class:`ep_moe.routing.RankRouting`). One
        exchange of counts and one host sync."""
        group, ep_size, num_local = self.ep_group, self.ep_size, self.num_local_experts
        ids_TK = router.topk_ids_TK
        send_P, counts_PX = rank_counts(ids_TK, keep_TK, num_local, ep_size)
        pending_counts = start_gather_counts(counts_PX, group)
        # Queue all that does not need the split sizes before the host waits for them, so
        # the GPU has work while the host issues the rest: the (token, rank) sort, padded to
        # T*min(P, K) rows of which the first U are sent; the top-k weights and local expert
        # ids of those rows, packed to travel in one message; the send rows themselves.
        routing = build_rank_routing(ids_TK, keep_TK, send_P, num_local)
        weights_U = permute_tokens(router.topk_weights_TK, routing.pairs, backend)
        packed = pack_rows([routing.local_ids_UK, weights_U])
        early_rows = gather_tokens(x_TH, routing.pairs, routing.num_sent, backend)
        counts = pending_counts.result()  # [source][destination][rows, slots]: the host sync
        splits = rank_splits(counts, self.ep_rank)
        num_sent = sum(splits.send)
        # Right after the sync, the exchanges: first the small one of expert ids and weights,
        # then the rows, which travel while the host queues the receiver's routing (the GPU
        # would otherwise idle until the host has issued it).
        routing = routing.first_rows(num_sent)
        packed_in = start_dispatch_packed(packed.first_rows(num_sent), splits, group)
        exchange = NcclExchange(group, splits)
        send_rows = permute_tokens(x_TH, routing.pairs, backend, gathered=early_rows[:num_sent])
        with torch.no_grad():
            rows_in = exchange.dispatch(send_rows, "rows")
        return _RowsInFlight(x_TH, backend, counts, routing, weights_U[:num_sent], packed_in, exchange, send_rows,
                             rows_in)

    @torch.compiler.disable
    def _finish_experts_parallel(self, f: _RowsInFlight) -> torch.Tensor:
        """EP>1 from the rows' dispatch on: the receiver's routing, the expert pipeline and
        the per-token sum of the rows that come back ([T, H])."""
        cfg, backend = self.config, f.backend
        recv_ids_SK, recv_weights_SK = f.packed_in.wait()  # local expert ids, -1 for slots that went elsewhere
        num_kept = sum(source[self.ep_rank][1] for source in f.counts)
        local = build_routing_metadata(recv_ids_SK.clamp(min=0), self.num_local_experts, recv_ids_SK >= 0,
                                       num_kept=num_kept)
        configs = self._configs(backend, local.slot_index_R.shape[0], f.x_TH.device)

        def experts(rows_SH: torch.Tensor, weights_SK: torch.Tensor, local: RoutingMetadata,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
            return expert_mlp(rows_SH, gate_up, down, local.counts_E, activation=cfg.activation,
                              gather_index=local.token_index_R, backend=backend, configs=configs,
                              row_weights=weights_SK.flatten().index_select(0, local.slot_index_R), slot_sum=local)

        back_rows = expert_pipeline(experts, local, f.exchange, self.experts.gate_up, self.experts.down,
                                    f.send_rows, f.weights_U, recv_weights_SK, dispatched=f.rows_in)
        return sum_slot_rows(back_rows, f.routing.pairs, backend)

    @torch.no_grad()
    def _record(self, router: RouterOutput, keep_TK: Optional[torch.Tensor], with_autograd: bool,
                bound_dropped: Optional[torch.Tensor] = None) -> None:
        if _in_backward():  # an activation checkpoint recomputing this forward: counted already
            return
        counts_E = router.counts_E.detach()
        num_dropped = (torch.zeros((), dtype=torch.int64, device=counts_E.device) if keep_TK is None
                       else keep_TK.numel() - keep_TK.sum())
        if bound_dropped is not None:
            num_dropped = num_dropped + bound_dropped
        self.last_stats = MoEStats(
            aux_loss=router.aux_loss, z_loss=router.z_loss, tokens_per_expert=counts_E,
            num_dropped=num_dropped, with_autograd=with_autograd,
        )
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


def _digest(value) -> int:
    """A 64-bit digest of a config value's repr, the same on every rank."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _check_copy_engine(group: ProcessGroup) -> None:
    """Raise unless the copy engines can run the all-gather on ``group`` (collective on first use)."""
    supported, reason = copy_engine_supported(group)
    if not supported:
        raise RuntimeError(f"MoEConfig.dispatch='all_gather_copy_engine' cannot run here: {reason}; "
                           "use dispatch='all_gather'")


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
