"""The experts of one MoE layer: the routed experts as two stacked weights run through the
grouped GEMMs (:class:`GroupedExperts`, :func:`expert_mlp`), their per-global-expert state
dict, and the shared experts (:class:`SharedExperts`). Math only: no communication.

Shape suffixes follow the legend in :mod:`ep_moe.routing`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ep_moe.config import Activation, MoEConfig
from ep_moe.kernels.activation import swiglu
from ep_moe.kernels.config import GemmConfigs
from ep_moe.kernels.ops import grouped_gemm, grouped_gemm_slot_sum
from ep_moe.kernels.permute import sum_slot_rows
from ep_moe.parallel import mark_expert_param
from ep_moe.routing import RoutingMetadata

if TYPE_CHECKING:
    from ep_moe.autotune.space import GemmProblem


def activate(h_RF: torch.Tensor, activation: Activation, backend: str,
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
        self.config = config
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

    def problems(self, dtype: torch.dtype) -> list["GemmProblem"]:
        """The two grouped GEMMs of these experts in ``dtype``, as :mod:`ep_moe.autotune` keys them."""
        from ep_moe.autotune.space import GemmProblem  # lazy: ep_moe.autotune may import this module

        cfg = self.config
        common = dict(num_local_experts=self.num_local_experts, top_k=cfg.top_k,
                      dtype=str(dtype).removeprefix("torch."))
        return [
            GemmProblem(projection="gate_up", n=cfg.gate_up_size, k=cfg.hidden_size, **common),
            GemmProblem(projection="down", n=cfg.hidden_size, k=cfg.intermediate_size, **common),
        ]

    def kernel_configs(self, backend: str, num_rows: int, like: torch.Tensor
                       ) -> tuple[Optional[GemmConfigs], Optional[GemmConfigs]]:
        """(gate_up, down) kernel configs for a Triton call over ``num_rows`` rows like ``like``
        (its dtype and device); (None, None) for the torch backend."""
        if backend != "triton":
            return (None, None)
        return tuple(_kernel_configs(p, num_rows, like.device) for p in self.problems(like.dtype))

    def on_routed_rows(self, rows_SH: torch.Tensor, weights_SK: torch.Tensor, local: RoutingMetadata,
                       gate_up: torch.Tensor, down: torch.Tensor, *, backend: str,
                       configs: tuple[Optional[GemmConfigs], Optional[GemmConfigs]],
                       bounded_rows: bool = False) -> torch.Tensor:
        """The experts on rows that arrived from the exchange (an
        :data:`ep_moe.ep.pipeline.ExpertFn`): ``local`` routes each row's K slots to the
        local experts (rows as tokens); each row's slots come back weighted and summed, one
        output row per arrived row. ``bounded_rows``: ``local`` holds a row bound, its counts
        fewer (the all-gather dispatches)."""
        return expert_mlp(rows_SH, gate_up, down, local.counts_E, activation=self.activation,
                          gather_index=local.token_index_R,
                          row_weights=weights_SK.reshape(-1).index_select(0, local.slot_index_R),
                          backend=backend, configs=configs, slot_sum=local, bounded_rows=bounded_rows)

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
    a_RI = activate(h_RF, activation, backend, m_sizes_e.sum() if bounded_rows else None)
    if slot_sum is not None and backend == "triton":
        return grouped_gemm_slot_sum(a_RI, down.to(x.dtype), m_sizes_e, row_weights, slot_sum.token_index_R,
                                     slot_sum.row_of_slot_N, slot_sum.top_k, configs[1], bounded_rows,
                                     source_ends=slot_sum.source_ends_ES)
    y_RH = grouped_gemm(a_RI, down.to(x.dtype), m_sizes_e, scatter_index=scatter_index,
                        row_weights=row_weights, configs=configs[1], backend=backend, bounded_rows=bounded_rows)
    return y_RH if slot_sum is None else sum_slot_rows(y_RH, slot_sum, backend)


def _split_experts_hook(module: GroupedExperts, state_dict, prefix, local_metadata) -> None:
    """state_dict: ``gate_up`` [e, ...] -> ``gate_up.{global id}`` per expert (same for down).

    Each key also resolves attribute by attribute, as ``get_model_state_dict``
    (torch.distributed.checkpoint.state_dict) requires of every key: the stacked parameter
    gets an attribute per global id, its row (``getattr(module.gate_up, "5") == 1``)."""
    for name in ("gate_up", "down"):
        param = getattr(module, name)
        stacked = state_dict.pop(prefix + name)
        for j, g in enumerate(module.global_ids()):
            state_dict[f"{prefix}{name}.{g}"] = stacked[j]
            setattr(param, str(g), j)


def _mark_experts_hook(module: GroupedExperts, incompatible_keys) -> None:
    """load_state_dict(assign=True) puts new Parameters in place: tag those as experts too."""
    mark_expert_param(module.gate_up)
    mark_expert_param(module.down)


def _stack_experts_hook(module: GroupedExperts, state_dict, prefix, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict: pick this rank's ``gate_up.{g}`` / ``down.{g}`` keys, stack them,
    and drop the keys of the layer's other experts (they belong to other ranks). A missing
    expert is reported by the key ``state_dict()`` gives it, and keeps its weights; so does
    an expert whose value is not a tensor of its shape, reported in the load's errors by its
    key and both shapes. A key that names no expert of the layer (``gate_up.99`` with 4
    experts, ``gate_up.07``) stays, for ``load_state_dict`` to report as unexpected."""
    for name in ("gate_up", "down"):
        if prefix + name in state_dict:
            continue
        current = getattr(module, name).detach()
        local = [_expert_tensor(state_dict, f"{prefix}{name}.{g}", current[j], missing_keys, error_msgs)
                 for j, g in enumerate(module.global_ids())]
        for g in range(module.config.num_experts):
            state_dict.pop(f"{prefix}{name}.{g}", None)
        if len({t.device for t in local}) == 1:  # else a meta module misses experts: left unloaded, reported
            state_dict[prefix + name] = torch.stack(local)


def _expert_tensor(state_dict, key: str, current: torch.Tensor, missing_keys: list[str],
                   error_msgs: list[str]) -> torch.Tensor:
    """What one local expert loads: ``state_dict[key]`` on ``current``'s device (where it is
    on a meta module, built to load with assign=True), or ``current`` (weights kept) when
    the key is missing or holds no tensor of ``current``'s shape, which is reported."""
    if key not in state_dict:
        missing_keys.append(key)
        return current
    value = state_dict[key]
    if not isinstance(value, torch.Tensor):
        error_msgs.append(f"expert weight {key} is a {type(value).__name__}, not a tensor of shape "
                          f"{tuple(current.shape)}; save it from MoELayer.state_dict()")
        return current
    if value.shape != current.shape:
        error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                          f"checkpoint, the shape in current model is {tuple(current.shape)}; load a "
                          "checkpoint of a layer with the same hidden_size, intermediate_size and activation")
        return current
    return value if current.is_meta else value.to(current.device)


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
        return self.down(activate(self.gate_up(x_TH), self.activation, backend))
