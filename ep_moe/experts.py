"""The experts of one MoE layer: the routed experts as stacked weights (and biases) run
through the grouped GEMMs (:class:`GroupedExperts`, :func:`expert_mlp`), or any expert
module run as is on each expert's rows (:class:`ModuleExperts`, the slow path); their
per-global-expert state dict; and the shared experts (:class:`SharedExperts`). Math only:
no communication.

Shape suffixes follow the legend in :mod:`ep_moe.routing`.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ep_moe.config import GATED_ACTIVATIONS, Activation, MoEConfig
from ep_moe.distributed import gathered_expert_rows, mark_expert_param
from ep_moe.grouped_mm_experts import grouped_mm_mlp, once_differentiable_output, use_grouped_mm
from ep_moe.kernels.activation import ClampedSwiGLU, gated
from ep_moe.kernels.config import GemmConfigs, configs_to_ints
from ep_moe.kernels.fp8 import QuantizedRows, fp8_gemm_configs, fp8_supported, layer_grouped_gemm_fp8
from ep_moe.kernels.grouped_gemm import interpreter_active
from ep_moe.kernels.ops import layer_grouped_gemm, layer_grouped_gemm_slot_sum
from ep_moe.kernels.permute import sum_slot_rows
from ep_moe.routing import RoutingMetadata, combine_slots

if TYPE_CHECKING:
    from ep_moe.autotune.space import GemmProblem

GemmConfigsArg = Union[GemmConfigs, tuple[int, ...], None]
"""One GEMM's configs: the object, its int form (:func:`~ep_moe.kernels.config.configs_to_ints`,
what a ``torch.compile`` trace looks up), or None (the kernels' defaults, or no such GEMM)."""
KernelConfigs = tuple[GemmConfigsArg, GemmConfigsArg]
"""(gate_up, down) kernel configs of one expert call."""
ConfigsArg = Union[KernelConfigs, Callable[[], KernelConfigs]]
"""Kernel configs, or a function that looks them up, called only if the kernels run."""


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype experts with this ``weight`` compute in: autocast's when it is on for the
    weight's device (as ``nn.Linear`` does), else the weight's own (always on the meta device)."""
    if not weight.is_meta and torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype


ActivationArg = Union[Activation, ClampedSwiGLU, Callable[[torch.Tensor], torch.Tensor]]
"""An :data:`Activation` name, GPT-OSS's clamped SwiGLU (fused on the Triton backend), or a
function of GEMM1's [R, F] rows ([R, I] out) run in torch between the GEMMs (a Hugging Face
model's own gate)."""


def activate(h_RF: torch.Tensor, activation: ActivationArg, backend: str,
             num_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The expert activation (:attr:`MoEConfig.activation`, or a function of the rows);
    ``num_rows`` (device count): only the first rows are in use (the rest are neither
    computed nor given a gradient on the Triton gated path)."""
    if isinstance(activation, ClampedSwiGLU):
        return activation.fused(h_RF, num_rows) if backend == "triton" else activation.reference(h_RF)
    if callable(activation):
        return activation(h_RF)
    if activation in GATED_ACTIVATIONS:
        gate_act = "silu" if activation == "swiglu" else "gelu"
        if backend == "triton":
            return gated(h_RF, gate_act, num_rows)  # one fused pass forward and backward
        gate_RI, up_RI = h_RF.chunk(2, dim=-1)
        return (F.silu(gate_RI) if gate_act == "silu" else F.gelu(gate_RI)) * up_RI
    if activation == "gelu":
        return F.gelu(h_RF)
    if activation == "gelu_tanh":
        return F.gelu(h_RF, approximate="tanh")
    if activation == "relu":
        return F.relu(h_RF)
    if activation == "silu":
        return F.silu(h_RF)
    return h_RF  # identity


def _lookup_kernel_configs(problem: "GemmProblem", num_rows: int, device: torch.device) -> Optional[GemmConfigs]:
    """Tuned configs for one Triton GEMM call, or None (the kernels' defaults) when the
    autotuner is not available."""
    try:
        from ep_moe.autotune import get_kernel_configs
    except ImportError:
        return None
    return get_kernel_configs(problem, num_rows, device)


@torch.compiler.assume_constant_result
def _kernel_configs_traced(fields: tuple, num_rows: int, device: torch.device) -> Optional[tuple[int, ...]]:
    """:func:`_lookup_kernel_configs` at ``torch.compile``'s trace time, as constants Dynamo
    takes in and hands back: the problem as its fields, the configs as their ints."""
    from ep_moe.autotune.space import GemmProblem

    configs = _lookup_kernel_configs(GemmProblem(**dict(fields)), num_rows, device)
    return None if configs is None else configs_to_ints(configs)


_PROBLEM_FIELDS = ("projection", "num_local_experts", "n", "k", "top_k", "dtype")
""":class:`~ep_moe.autotune.space.GemmProblem`'s fields (its constructor takes them by name)."""
_kernel_configs_disabled = torch.compiler.disable(_lookup_kernel_configs)


def _kernel_configs(problem: "GemmProblem", num_rows: int, device: torch.device) -> GemmConfigsArg:
    """:func:`_lookup_kernel_configs`; under ``torch.compile`` without a graph break where the
    row count is static, the configs then in their int form (:func:`~ep_moe.kernels.config.
    configs_to_ints`, which the GEMMs take as well); a symbolic count (dynamic shapes) breaks
    the graph here and looks them up on every call. A compiled graph keeps the configs of its
    trace: tune (:func:`ep_moe.autotune.warmup`, as the trainer does) before the first
    compiled call."""
    if not torch.compiler.is_compiling():  # eager: the lookup alone (host time on every call)
        return _lookup_kernel_configs(problem, num_rows, device)
    if isinstance(num_rows, int):
        fields = tuple((name, getattr(problem, name)) for name in _PROBLEM_FIELDS)
        return _kernel_configs_traced(fields, num_rows, device)
    return _kernel_configs_disabled(problem, num_rows, device)


EXPERT_TENSORS = ("gate_up", "down", "gate_up_bias", "down_bias")
""":class:`GroupedExperts`' stacked tensors, in the order :meth:`GroupedExperts.expert_tensors`
gives those there are."""


class _LocalExperts(nn.Module):
    """What both expert kinds share: the e local experts of ``config``, local expert j being
    global expert ``first_expert + j``, and the state-dict hooks that key each stacked tensor
    per global id (and restack on load, resharding)."""

    def __init__(self, config: MoEConfig, num_local_experts: int, first_expert: int) -> None:
        super().__init__()
        self.config = config
        self.num_local_experts = num_local_experts
        self.first_expert = first_expert
        self.register_state_dict_post_hook(_split_experts_hook)
        self.register_load_state_dict_pre_hook(_stack_experts_hook)
        self.register_load_state_dict_post_hook(_mark_experts_hook)

    def global_ids(self) -> range:
        """Global ids of the local experts."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    @property
    def num_global_experts(self) -> int:
        """The experts over the EP group (E)."""
        return self.config.num_experts


class StackedExpertsMath:
    """The expert math over stacked tensors, for any owner of them: :class:`GroupedExperts`
    (its own parameters) and :class:`ep_moe.integrations.transformers.HFExperts` (a Hugging
    Face experts module's, in that module's layout). What the dispatchers call
    (:meth:`expert_tensors`, :meth:`kernel_configs`, :meth:`on_routed_rows`, and the call
    itself at EP=1).

    The owner provides ``config`` (a :class:`MoEConfig`: the shapes the autotuner keys),
    ``num_local_experts``, ``activation`` (an :data:`Activation` name, or a function of
    GEMM1's [R, F] rows run in torch between the GEMMs) and the stacked tensors
    ``gate_up`` [e, F, H] (None for one Linear), ``down`` [e, H, I], ``gate_up_bias`` and
    ``down_bias`` (None without a bias), any strides with a unit one; and sets
    ``self._problems = {}``.
    """

    def tensor_names(self) -> tuple[str, ...]:
        """Names of the stacked tensors there are (of :data:`EXPERT_TENSORS`), in order."""
        return tuple(name for name in EXPERT_TENSORS if getattr(self, name) is not None)

    def expert_tensors(self) -> tuple[torch.Tensor, ...]:
        """The stacked tensors there are, in :meth:`tensor_names` order: what
        :meth:`on_routed_rows` takes after the routing."""
        return tuple(getattr(self, name) for name in self.tensor_names())

    def problems(self, dtype: torch.dtype) -> list["GemmProblem"]:
        """The grouped GEMMs of these experts in ``dtype``, as :mod:`ep_moe.autotune` keys
        them (a bias changes no problem: it costs one row read per output tile); none with
        ``expert_precision="fp8"``, whose kernels take their own configs
        (:func:`ep_moe.kernels.fp8.fp8_gemm_configs`)."""
        from ep_moe.autotune.space import GemmProblem  # lazy: `import ep_moe` does not load the autotuner

        cfg = self.config
        if cfg.expert_precision == "fp8":
            return []
        common = dict(num_local_experts=self.num_local_experts, top_k=cfg.top_k,
                      dtype=str(dtype).removeprefix("torch."))
        down = GemmProblem(projection="down", n=cfg.hidden_size, k=cfg.intermediate_size, **common)
        if self.gate_up is None:
            return [down]
        return [GemmProblem(projection="gate_up", n=cfg.gate_up_size, k=cfg.hidden_size, **common), down]

    def kernel_configs(self, backend: str, num_rows: int, like: torch.Tensor) -> KernelConfigs:
        """(gate_up, down) kernel configs for a Triton call over ``num_rows`` rows like ``like``
        (its dtype and device); (None, None) for the torch backend, None for a GEMM there
        is not."""
        if backend != "triton":
            return (None, None)
        if self.config.expert_precision == "fp8":
            fp8 = fp8_gemm_configs(like.device, like.dtype)
            return (None, fp8) if self.gate_up is None else (fp8, fp8)
        problems = self._problems.get(like.dtype)
        if problems is None:  # built once per dtype, not on every call
            problems = self._problems[like.dtype] = self.problems(like.dtype)
        configs = [_kernel_configs(p, num_rows, like.device) for p in problems]
        return (None, configs[0]) if len(configs) == 1 else (configs[0], configs[1])

    def on_routed_rows(self, rows_SH: torch.Tensor, weights_SK: torch.Tensor, local: RoutingMetadata,
                       *tensors: torch.Tensor, backend: str, configs: ConfigsArg,
                       bounded_rows: bool = False, quantized_rows: Optional[QuantizedRows] = None) -> torch.Tensor:
        """The experts on rows that arrived from the exchange (an
        :data:`ep_moe.ep.pipeline.ExpertFn`; ``tensors``: :meth:`expert_tensors`, cast):
        ``local`` routes each row's K slots to the local experts (rows as tokens); each
        row's slots come back weighted and summed, one output row per arrived row.
        ``bounded_rows``: ``local`` holds a row bound, its counts fewer (the all-gather
        dispatches). ``quantized_rows``: the rows arrived in e4m3 (FP8 experts), ``rows_SH``
        stands for them."""
        named = dict(zip(self.tensor_names(), tensors))
        return expert_mlp(rows_SH, named.get("gate_up"), named["down"], local.counts_E, activation=self.activation,
                          gate_up_bias=named.get("gate_up_bias"), down_bias=named.get("down_bias"),
                          gather_index=local.token_index_R,
                          row_weights=weights_SK.reshape(-1).index_select(0, local.slot_index_R),
                          backend=backend, configs=configs, slot_sum=local, bounded_rows=bounded_rows,
                          fp8_weights=(self.gate_up, self.down) if self.config.expert_precision == "fp8" else None,
                          quantized_rows=quantized_rows)

    def forward(
        self,
        x: torch.Tensor,
        m_sizes_e: torch.Tensor,
        *,
        gather_index: Optional[torch.Tensor] = None,
        scatter_index: Optional[torch.Tensor] = None,
        row_weights: Optional[torch.Tensor] = None,
        backend: str = "torch",
        configs: ConfigsArg = (None, None),
        gather_slots: Optional[torch.Tensor] = None,
        slots_per_token: Optional[int] = None,
    ) -> torch.Tensor:
        """GEMM1 (gather on load), activation, GEMM2 (scatter and row weights on store);
        one GEMM doing all of that with ``num_linears=1``.

        Rows are in expert order (``m_sizes_e`` rows per local expert); row r reads
        ``x[gather_index[r]]`` and its output lands at ``scatter_index[r]``. ``gather_slots``:
        a dropless top-K routing's slot of each row (``gather_index == gather_slots // K``),
        which spares the backward a sort (:func:`~ep_moe.kernels.ops.layer_grouped_gemm`).
        ``slots_per_token`` (K, with ``scatter_index`` filling all T*K slots): each token's
        K slots summed, [T, H], instead of the slot rows.
        """
        return expert_mlp(x, self.gate_up, self.down, m_sizes_e, activation=self.activation,
                          gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                          gather_index=gather_index, scatter_index=scatter_index, row_weights=row_weights,
                          backend=backend, configs=configs, gather_slots=gather_slots,
                          slots_per_token=slots_per_token,
                          fp8_weights=(self.gate_up, self.down) if self.config.expert_precision == "fp8" else None)


class GroupedExperts(StackedExpertsMath, _LocalExperts):
    """The e local experts as stacked weights; math only (no communication).

    ``gate_up`` is [e, 2I, H] (gated activation) or [e, I, H], ``down`` is [e, H, I], both
    ``out_features`` before ``in_features`` as :func:`ep_moe.grouped_gemm` expects; with
    ``num_linears=1`` there is no ``gate_up`` (None) and ``down`` [e, H, H] is the one
    Linear. With ``mlp_bias``, ``gate_up_bias`` [e, 2I or I] and ``down_bias`` [e, H]
    (else None). Local expert j is global expert ``first_expert + j``; the state dict
    holds each tensor per global id (``gate_up.{g}``, ``down_bias.{g}``, ...).
    """

    def __init__(self, config: MoEConfig, num_local_experts: int, first_expert: int,
                 device=None, dtype=None) -> None:
        super().__init__(config, num_local_experts, first_expert)
        self.activation = config.activation
        two = config.num_linears == 2
        shapes = {
            "gate_up": (config.gate_up_size, config.hidden_size) if two else None,
            "down": (config.hidden_size, config.intermediate_size),
            "gate_up_bias": (config.gate_up_size,) if two and config.mlp_bias else None,
            "down_bias": (config.hidden_size,) if config.mlp_bias else None,
        }
        for name, shape in shapes.items():
            param = None if shape is None else mark_expert_param(nn.Parameter(torch.empty(
                num_local_experts, *shape, device=device, dtype=dtype)))
            self.register_parameter(name, param)
        self._problems: dict[torch.dtype, list["GemmProblem"]] = {}  # kernel_configs' cache of problems()

    def tensor(self, name: str) -> torch.Tensor:
        """The stacked tensor whose experts the state dict holds as ``{name}.{g}``."""
        return getattr(self, name)

    @property
    def first_weight(self) -> torch.Tensor:
        """A weight of the experts: its dtype and device are the experts'."""
        return self.down

    @torch.no_grad()
    def reset_parameters(self, std: float, seed: int) -> None:
        """N(0, std) weights, zero biases; expert g drawn from a generator seeded with
        ``seed + g``, so the global weights are the same at every EP size for the same
        ``seed``. No-op on the meta device (deferred init)."""
        if self.down.is_meta:
            return
        for j, g in enumerate(self.global_ids()):
            gen = torch.Generator(device=self.down.device).manual_seed(seed + g)
            for weight in (self.gate_up, self.down):
                if weight is not None:
                    weight[j].normal_(0.0, std, generator=gen)
        for bias in (self.gate_up_bias, self.down_bias):
            if bias is not None:
                bias.zero_()


def expert_mlp(x: torch.Tensor, gate_up: Optional[torch.Tensor], down: torch.Tensor, m_sizes_e: torch.Tensor, *,
               activation: ActivationArg, gate_up_bias: Optional[torch.Tensor] = None,
               down_bias: Optional[torch.Tensor] = None, gather_index: Optional[torch.Tensor] = None,
               scatter_index: Optional[torch.Tensor] = None, row_weights: Optional[torch.Tensor] = None,
               backend: str = "torch",
               configs: ConfigsArg = (None, None),
               slot_sum: Optional[RoutingMetadata] = None, bounded_rows: bool = False,
               gather_slots: Optional[torch.Tensor] = None, slots_per_token: Optional[int] = None,
               fp8_weights: Optional[tuple[Optional[torch.Tensor], torch.Tensor]] = None,
               quantized_rows: Optional[QuantizedRows] = None) -> torch.Tensor:
    """The math of :meth:`GroupedExperts.forward` with the weights passed in (``gate_up``
    None: one Linear, ``down``, which then gathers, weights and scatters the rows itself;
    biases added in the GEMMs' epilogue). ``slot_sum``: the output rows summed per token
    over ``slot_sum``'s slots ([T, H]; :func:`~ep_moe.kernels.permute.sum_slot_rows`),
    fused with the down projection on the Triton backend of two Linears
    (:func:`~ep_moe.kernels.ops.grouped_gemm_slot_sum`; no scatter then).
    ``bounded_rows``: the rows are a bound, ``m_sizes`` counts fewer (see
    :func:`~ep_moe.kernels.ops.grouped_gemm`). ``gather_slots``: as for
    :func:`~ep_moe.kernels.ops.layer_grouped_gemm`, for the first GEMM. ``slots_per_token``:
    K, where ``scatter_index`` places the rows at all T*K slots of a dropless routing: each
    token's K slots summed, [T, H] (:func:`~ep_moe.routing.combine_slots`; on the small-call
    path in fp32 from the weighted rows, rounded once).

    On the Triton backend, a small eager call whose rows have slots (``gather_slots`` or
    ``slot_sum``) runs as torch ops instead (:mod:`ep_moe.grouped_mm_experts`), where the
    host's launches would set its pace.

    ``fp8_weights`` (``MoEConfig.expert_precision="fp8"``, Triton only): ``(gate_up, down)``,
    the tensors (the parameters) whose e4m3 copies both GEMMs multiply by
    (:func:`~ep_moe.kernels.fp8.layer_grouped_gemm_fp8`), ``gate_up`` and ``down`` then being
    what their gradients go to. Every call then runs the FP8 kernels (no small-call path),
    and the weights are not cast (the copies come from them as they are; their gradients
    come in their dtype); with ``slot_sum`` the rows are summed after the down projection.
    ``quantized_rows`` (with ``fp8_weights``): x's rows already in e4m3, which the first GEMM
    reads (x then stands for them, :mod:`ep_moe.ep.fp8_wire`)."""
    _check_slots_per_token(slots_per_token, scatter_index, slot_sum is not None)
    fp8 = fp8_weights is not None
    if fp8 and backend != "triton":
        raise ValueError(f"expert_mlp: FP8 experts run on the Triton backend, not {backend!r}")
    if quantized_rows is not None and not fp8:
        raise ValueError("expert_mlp: quantized_rows (rows in e4m3) are read by FP8 experts only; pass fp8_weights")
    if not fp8:  # Under autocast x arrives in the autocast dtype; the weights follow (a no-op otherwise).
        down, down_bias = down.to(x.dtype), None if down_bias is None else down_bias.to(x.dtype)
        gate_up = None if gate_up is None else gate_up.to(x.dtype)
        gate_up_bias = None if gate_up_bias is None else gate_up_bias.to(x.dtype)
    slot_index_R = None if gather_index is None else gather_slots if slot_sum is None else slot_sum.slot_index_R
    num_rows = x.shape[0] if gather_index is None else gather_index.shape[0]
    weights = (down,) if gate_up is None else (gate_up, down)
    if backend == "triton" and not fp8 and use_grouped_mm(x, weights, num_rows, slot_index_R):
        top_k = slot_sum.top_k if slot_sum is not None else slots_per_token or num_rows // x.shape[0]  # EP=1: R = T*K
        activation_fn = functools.partial(activate, activation=activation, backend="torch")
        return grouped_mm_mlp(x, gate_up, down, m_sizes_e, activation_fn, slot_index_R=slot_index_R,
                              token_index_R=gather_index, top_k=top_k, gate_up_bias=gate_up_bias,
                              down_bias=down_bias, scatter_index=scatter_index, row_weights=row_weights,
                              sum_slots=slot_sum is not None or slots_per_token is not None,
                              bounded_rows=bounded_rows)
    if callable(configs):
        configs = configs()
    if backend == "triton":
        m_sizes_e = m_sizes_e.to(torch.int32)  # as the kernels take it: converted once, not per GEMM
    # the GEMM, and what it takes beside the common arguments: the backend, or the FP8 copies' source
    gemm, up_args, down_args = (layer_grouped_gemm, {"backend": backend}, {"backend": backend}) if not fp8 else (
        layer_grouped_gemm_fp8, {"weight": fp8_weights[0]}, {"weight": fp8_weights[1]})
    x_args = {"quantized_rows": quantized_rows} if fp8 else {}  # for the GEMM that reads x
    if gate_up is None:
        y_RH = gemm(x, down, m_sizes_e, gather_index=gather_index, scatter_index=scatter_index,
                    row_weights=row_weights, bias=down_bias, configs=configs[1], bounded_rows=bounded_rows,
                    gather_slots=gather_slots, **down_args, **x_args)
        return once_differentiable_output(_summed_per_token(y_RH, slot_sum, slots_per_token, backend), backend)
    h_RF = gemm(x, gate_up, m_sizes_e, gather_index=gather_index, bias=gate_up_bias, configs=configs[0],
                bounded_rows=bounded_rows, gather_slots=gather_slots, **up_args, **x_args)
    a_RI = activate(h_RF, activation, backend, m_sizes_e.sum() if bounded_rows else None)
    if slot_sum is not None and backend == "triton" and not fp8:
        return once_differentiable_output(layer_grouped_gemm_slot_sum(
            a_RI, down, m_sizes_e, row_weights, slot_sum.token_index_R, slot_sum.row_of_slot_N, slot_sum.top_k,
            configs[1], bounded_rows, source_ends=slot_sum.source_ends_ES, bias=down_bias), backend)
    y_RH = gemm(a_RI, down, m_sizes_e, scatter_index=scatter_index, row_weights=row_weights, bias=down_bias,
                configs=configs[1], bounded_rows=bounded_rows, **down_args)
    return once_differentiable_output(_summed_per_token(y_RH, slot_sum, slots_per_token, backend), backend)


def check_fp8_device(device: torch.device, where: str = "MoEConfig.expert_precision='fp8'") -> None:
    """At construction of experts with ``expert_precision="fp8"`` on ``device``: raise where
    it has no FP8 tensor cores (:func:`~ep_moe.kernels.fp8.fp8_supported`), naming ``where``,
    why and the fix. A CPU stands for the current GPU where there is one and the Triton
    interpreter is off (a model built on the CPU and then moved, as the trainer does); the meta
    device is left to the first call (:func:`~ep_moe.kernels.fp8.layer_grouped_gemm_fp8`
    checks there)."""
    if device.type == "meta":
        return
    if device.type == "cpu" and not interpreter_active() and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    ok, why = fp8_supported(device)
    if not ok:
        raise ValueError(f"{where}: {why}; or use expert_precision='bf16' (the default)")


def _check_slots_per_token(slots_per_token: Optional[int], scatter_index: Optional[torch.Tensor],
                           with_slot_sum: bool = False) -> None:
    if slots_per_token is not None and (scatter_index is None or with_slot_sum):
        raise ValueError("slots_per_token sums the rows that scatter_index places at every slot of a dropless "
                         "routing; pass it with scatter_index (and without slot_sum), or sum the rows yourself")


def _summed_per_token(y_RH: torch.Tensor, slot_sum: Optional[RoutingMetadata], slots_per_token: Optional[int],
                      backend: str) -> torch.Tensor:
    """:func:`expert_mlp`'s rows as it returns them: summed per token by ``slot_sum``'s rows
    or over ``slots_per_token`` slots in slot order, else as they are."""
    if slot_sum is not None:
        return sum_slot_rows(y_RH, slot_sum, backend)
    return y_RH if slots_per_token is None else combine_slots(y_RH, slots_per_token)


_SLOW_PATH_WARNED: set[str] = set()
"""Expert module types :class:`ModuleExperts` has warned about (once each per process)."""


class ModuleExperts(_LocalExperts):
    """The e local experts as copies of any expert module: the slow path, for experts the
    grouped GEMMs cannot compute (another activation, normalisation, Megatron's parallel
    Linears, a module returning an ``(output, bias)`` pair...). Math only, like
    :class:`GroupedExperts`, whose interface it has, so the layer's dispatch (EP all-to-all,
    all-gather) is the same; only the expert math differs.

    Each parameter (and buffer) of the module is stacked over the local experts, ``[e,
    *shape]``, each expert starting as a copy of ``module``'s values, as DeepSpeed's
    ``Experts`` deep-copies its expert. The forward gathers the routed rows, splits them by
    expert (a host sync) and runs the module on each local expert's rows in a Python loop,
    with that expert's tensors (:func:`torch.func.functional_call`); an output that is a
    tuple counts by its first entry (DeepSpeed ignores the bias of a Megatron-style
    ``(output, bias)`` pair too). The rows are then weighted by their top-k weights (in
    fp32), scattered and summed as :func:`expert_mlp` does. Gradients are autograd's.

    The state dict holds each tensor per global expert id, ``{name}.{g}`` (``name`` as in
    ``module.state_dict()``), and reshards on load as :class:`GroupedExperts`' does. Warns
    once per module type that this is the slow path. Not on the copy-engine all-gather
    (``dispatch="all_gather_copy_engine"``), whose rows land while the experts run.
    """

    def __init__(self, module: nn.Module, config: MoEConfig, num_local_experts: int, first_expert: int,
                 device=None, dtype=None) -> None:
        if config.dispatch == "all_gather_copy_engine":
            raise ValueError("an expert module run as is (ModuleExperts) reads the exchanged rows before they "
                             "land on the copy engines; use dispatch='all_gather' or 'all_to_all'")
        kind = type(module).__name__
        if not any(p.is_floating_point() for p in module.parameters()):
            raise ValueError(f"expert module {kind} has no floating-point parameters, so its experts have nothing "
                             "to learn; give the expert a weight (an nn.Linear, say)")
        if kind not in _SLOW_PATH_WARNED:
            _SLOW_PATH_WARNED.add(kind)
            warnings.warn(f"ep_moe runs the expert module {kind} as is, on each local expert's rows in a Python loop "
                          "(the slow path: no grouped GEMMs, a host sync per call); for the fast path build the "
                          "expert from nn.Linear layers with an activation ep_moe names (MoEConfig.activation)",
                          stacklevel=3)
        super().__init__(config, num_local_experts, first_expert)
        self.stacked = nn.ParameterList()
        self._param_names: list[str] = []
        self._buffer_names: list[str] = []
        for name, param in module.named_parameters():
            self.stacked.append(mark_expert_param(nn.Parameter(
                _copies(param, num_local_experts, device, dtype), requires_grad=param.requires_grad)))
            self._param_names.append(name)
        for i, (name, buffer) in enumerate(module.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            persistent = leaf not in module.get_submodule(owner)._non_persistent_buffers_set
            self.register_buffer(f"buffer{i}", _copies(buffer, num_local_experts, device, dtype), persistent)
            self._buffer_names.append(name)
        # the module's structure, run with each expert's tensors in place of its own (kept
        # out of the module tree: its own tensors are neither parameters nor state of the layer)
        self._template = (copy.deepcopy(module).to("meta"),)

    def tensor_names(self) -> tuple[str, ...]:
        """Names of the stacked parameters, as in the module's state dict."""
        return tuple(self._param_names)

    def expert_tensors(self) -> tuple[torch.Tensor, ...]:
        """The stacked parameters, in :meth:`tensor_names` order."""
        return tuple(self.stacked)

    def tensor_state_names(self) -> tuple[str, ...]:
        """Names of the stacked tensors in the state dict (``{name}.{g}``): the module's
        state-dict keys (its parameters and persistent buffers)."""
        return tuple(name for name, _ in self._state_tensors())

    def tensor(self, name: str) -> torch.Tensor:
        """The stacked tensor whose experts the state dict holds as ``{name}.{g}``."""
        key = dict(self._state_tensors())[name]
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}[key]

    def _state_tensors(self) -> list[tuple[str, str]]:
        """(name in the module's state dict, key in this module's) of each stacked tensor
        in the state dict: the parameters, then the persistent buffers."""
        buffers = [(name, f"buffer{i}") for i, name in enumerate(self._buffer_names)
                   if f"buffer{i}" not in self._non_persistent_buffers_set]
        return [(name, f"stacked.{i}") for i, name in enumerate(self._param_names)] + buffers

    @property
    def first_weight(self) -> torch.Tensor:
        """A floating-point parameter of the experts: its dtype and device are the experts'."""
        return next(p for p in self.stacked if p.is_floating_point())

    def train(self, mode: bool = True) -> "ModuleExperts":
        self._template[0].train(mode)  # dropout and the like follow the layer's mode
        return super().train(mode)

    def reset_parameters(self, std: float, seed: int) -> None:
        """Nothing: the experts keep the values of the module they were copied from, which
        says how it is initialised (as DeepSpeed's experts, which are copies of it)."""

    def problems(self, dtype: torch.dtype) -> list["GemmProblem"]:
        """No grouped GEMMs to tune."""
        return []

    def kernel_configs(self, backend: str, num_rows: int, like: torch.Tensor) -> tuple[None, None]:
        """No kernel configs (no grouped GEMMs)."""
        return (None, None)

    def on_routed_rows(self, rows_SH: torch.Tensor, weights_SK: torch.Tensor, local: RoutingMetadata,
                       *tensors: torch.Tensor, backend: str, configs=None, bounded_rows: bool = False) -> torch.Tensor:
        """As :meth:`GroupedExperts.on_routed_rows` (``tensors``: :meth:`expert_tensors`, cast)."""
        row_weights = weights_SK.reshape(-1).index_select(0, local.slot_index_R)
        y_RH = self._run(rows_SH, local.counts_E, tensors, local.token_index_R, None, row_weights)
        return sum_slot_rows(y_RH, local, backend)

    def forward(self, x: torch.Tensor, m_sizes_e: torch.Tensor, *, gather_index: Optional[torch.Tensor] = None,
                scatter_index: Optional[torch.Tensor] = None, row_weights: Optional[torch.Tensor] = None,
                backend: str = "torch", configs=None, gather_slots: Optional[torch.Tensor] = None,
                slots_per_token: Optional[int] = None) -> torch.Tensor:
        """As :meth:`GroupedExperts.forward` (``gather_slots`` unused: no Triton backward here)."""
        _check_slots_per_token(slots_per_token, scatter_index)
        y_RH = self._run(x, m_sizes_e, self.expert_tensors(), gather_index, scatter_index, row_weights)
        return y_RH if slots_per_token is None else combine_slots(y_RH, slots_per_token)

    def _run(self, x: torch.Tensor, m_sizes_e: torch.Tensor, params: tuple[torch.Tensor, ...],
             gather_index: Optional[torch.Tensor], scatter_index: Optional[torch.Tensor],
             row_weights: Optional[torch.Tensor]) -> torch.Tensor:
        """Rows in expert order through each local expert's module, weighted and scattered:
        [R, H] (rows past the counts, under a row bound, are zeros)."""
        rows_RH = x if gather_index is None else x.index_select(0, gather_index)
        sizes = m_sizes_e.tolist()  # host sync: the loop over experts runs on the host
        buffers = [getattr(self, f"buffer{i}") for i in range(len(self._buffer_names))]
        outputs, start = [], 0
        for j, size in enumerate(sizes):
            if size == 0:  # no call on no rows (a module may not take them)
                continue
            tensors = {**{name: p[j] for name, p in zip(self._param_names, params)},
                       **{name: b[j] for name, b in zip(self._buffer_names, buffers)}}
            out = torch.func.functional_call(self._template[0], tensors, (rows_RH[start:start + size],))
            outputs.append((out[0] if isinstance(out, tuple) else out).to(x.dtype))
            start += size
        outputs.append(rows_RH.new_zeros(rows_RH.shape[0] - start, rows_RH.shape[1]))
        y_RH = torch.cat(outputs)
        if scatter_index is not None:
            y_RH = torch.zeros_like(y_RH).index_copy(0, scatter_index, y_RH)
        if row_weights is not None:  # by output row, as the grouped GEMM's
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # the GEMM epilogue's
            y_RH = (y_RH.to(acc) * row_weights.to(acc)[:, None]).to(x.dtype)
        return y_RH


def _copies(t: torch.Tensor, count: int, device, dtype) -> torch.Tensor:
    """``count`` copies of ``t`` stacked on a new first dim, on ``device`` (default t's) and,
    for floating-point ``t``, in ``dtype`` (default t's)."""
    t = t.detach().to(device=device if device is not None else t.device,
                      dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
    return t.unsqueeze(0).repeat(count, *([1] * t.dim()))


def _stacked_state(module: nn.Module) -> list[tuple[str, str]]:
    """(name per expert, key of the stacked tensor) of each stacked tensor of ``module`` in
    its state dict."""
    if isinstance(module, ModuleExperts):
        return module._state_tensors()
    return [(name, name) for name in module.tensor_names()]


def _split_experts_hook(module: nn.Module, state_dict, prefix, local_metadata) -> None:
    """state_dict: a stacked tensor ``down`` [e, ...] -> ``down.{global id}`` per expert (the
    same for every stacked tensor of the experts).

    Where the stacked tensor is the module's attribute of that name (GroupedExperts'), each
    key also resolves attribute by attribute, as ``get_model_state_dict``
    (torch.distributed.checkpoint.state_dict) requires of every key: the stacked tensor
    gets an attribute per global id, its row (``getattr(module.down, "5") == 1``)."""
    for name, key in _stacked_state(module):
        stacked = gathered_expert_rows(state_dict.pop(prefix + key))
        for j, g in enumerate(module.global_ids()):
            state_dict[f"{prefix}{name}.{g}"] = stacked[j]
            if name == key:
                setattr(getattr(module, key), str(g), j)


def _mark_experts_hook(module: nn.Module, incompatible_keys) -> None:
    """load_state_dict(assign=True) puts new Parameters in place: tag those as experts too."""
    for param in module.parameters():
        mark_expert_param(param)


def _stack_experts_hook(module: nn.Module, state_dict, prefix, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict: pick this rank's ``down.{g}`` (and other stacked tensors') keys,
    stack them, and drop the keys of the layer's other experts (they belong to other
    ranks). A missing expert is reported by the key ``state_dict()`` gives it, and keeps
    its weights; so does an expert whose value is not a tensor of its shape, reported in
    the load's errors by its key and both shapes. A key that names no expert of the layer
    (``gate_up.99`` with 4 experts, ``gate_up.07``) stays, for ``load_state_dict`` to
    report as unexpected."""
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, key in _stacked_state(module):
        if prefix + key in state_dict:
            continue
        current = own[key].detach()
        local = [_expert_tensor(state_dict, f"{prefix}{name}.{g}", current[j], missing_keys, error_msgs)
                 for j, g in enumerate(module.global_ids())]
        for g in range(module.config.num_experts):
            state_dict.pop(f"{prefix}{name}.{g}", None)
        if len({t.device for t in local}) == 1:  # else a meta module misses experts: left unloaded, reported
            state_dict[prefix + key] = torch.stack(local)


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
    """Dense MLP applied to every token (all shared experts fused into one), of the routed
    experts' form (:attr:`MoEConfig.activation`, ``num_linears``, ``mlp_bias``; with one
    Linear, the shared experts' sum is one Linear H -> H)."""

    def __init__(self, config: MoEConfig, device=None, dtype=None) -> None:
        super().__init__()
        inter = config.shared_intermediate_size or config.num_shared_experts * config.intermediate_size
        self.activation = config.activation
        factory = dict(bias=config.mlp_bias, device=device, dtype=dtype)
        if config.num_linears == 1:
            self.gate_up = None
            self.down = nn.Linear(config.hidden_size, config.hidden_size, **factory)
        else:
            up_size = 2 * inter if config.gated else inter
            self.gate_up = nn.Linear(config.hidden_size, up_size, **factory)
            self.down = nn.Linear(inter, config.hidden_size, **factory)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """N(0, std) weights from the default RNG, zero biases."""
        for linear in (self.gate_up, self.down):
            if linear is not None:
                linear.weight.normal_(0.0, std)
                if linear.bias is not None:
                    linear.bias.zero_()

    def forward(self, x_TH: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """[T, H] -> [T, H]; ``backend="triton"`` fuses a gated activation."""
        if self.gate_up is None:
            return self.down(x_TH)
        return once_differentiable_output(self.down(activate(self.gate_up(x_TH), self.activation, backend)), backend)
