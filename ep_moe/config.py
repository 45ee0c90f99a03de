"""``MoEConfig``: the shape and behaviour of one MoE layer, checked by one table of rules."""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Optional, get_args

import torch

from ep_moe.routing import DropPolicy, ScoreFunc

Activation = Literal["swiglu", "gelu", "relu", "geglu", "gelu_tanh", "silu", "identity"]
GATED_ACTIVATIONS = ("swiglu", "geglu")
"""The activations of gated experts: ``act(gate) * up``, gate and up stacked in ``gate_up``."""
Dispatch = Literal["auto", "all_to_all", "all_gather", "all_gather_copy_engine"]
ExpertPrecision = Literal["bf16", "fp8"]

_REMOVED_FIELDS = {
    "transport": "the transport is part of the dispatch now: dispatch='all_gather_copy_engine' for the "
                 "all-gather on the copy engines; the all-to-all runs on NCCL",
    "own_rows_first": "it measured slower on every shape and was removed; drop it",
    "overlap_chunks": "chunked overlap measured slower on every shape and was removed; drop it",
}
"""Fields MoEConfig no longer has, and what to do instead."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape and behaviour of one MoE layer. Validated on construction: each field's kind
    and range (``_RULES``: numbers finite and within bounds that keep the layer's
    arithmetic exact, e.g. ``hidden_size <= 2**20``, ``num_experts <= 2**16``), then the
    rules between fields."""

    hidden_size: int
    """H, the model dimension (input and output features)."""
    intermediate_size: int
    """I, the hidden dimension of each expert MLP."""
    num_experts: int
    """E, experts in total over the EP group."""
    top_k: int
    """K, experts each token is sent to (1 <= K <= E)."""
    activation: Activation = "swiglu"
    """The expert MLP's activation. Gated (three Linears: gate, up, down), gate_up is
    [2I, H], rows 0..I-1 gate, I..2I-1 up: ``"swiglu"`` (``silu(gate) * up``) or
    ``"geglu"`` (``gelu(gate) * up``, exact erf GELU). Not gated (gate_up is [I, H]):
    ``"gelu"`` (exact erf form), ``"gelu_tanh"`` (its tanh approximation, Megatron's
    bias-GELU), ``"relu"``, ``"silu"``, or ``"identity"`` (none: two Linears in a row)."""
    num_linears: int = 2
    """Linears of each expert, in a row: 2 (``gate_up``, the activation, ``down``; a gated
    expert's gate and up Linears are one stacked ``gate_up``) or 1 (one Linear H -> H, the
    ``down`` weight alone, as DeepSpeed's PR-MoE examples build; takes
    ``activation="identity"`` and ``intermediate_size == hidden_size``)."""
    mlp_bias: bool = False
    """The experts' Linears (routed and shared) carry a bias, as ``nn.Linear`` does by
    default: ``gate_up_bias`` [e, F] and ``down_bias`` [e, H], zero at init, added in the
    grouped GEMMs' epilogue (before the top-k weight multiplies the row)."""
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
    :meth:`ep_moe.MoELayer.update_expert_bias`."""
    bias_update_rate: float = 1e-3
    """Step of the expert-bias update: ``bias += rate * sign(mean_load - load)``."""
    capacity_factor: Optional[float] = None
    """None: dropless. Otherwise (``0 < c <= MAX_CAPACITY_FACTOR``, 65536) each expert keeps at
    most ``ceil(c * T * K / E)`` slots of this rank's T tokens; dropped slots contribute 0 to the output (the token keeps its
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
    dispatch: Dispatch = "auto"
    """EP>1: how tokens reach the experts and come back (:mod:`ep_moe.ep`).

    - ``"auto"``: ``"all_gather"`` on an NCCL group when ``ep_size <= 2 * top_k``
      (:data:`ep_moe.ep.AUTO_GATHER_RANKS_PER_CHOICE`) and the all-gather's worst case is
      at most :data:`ep_moe.ep.AUTO_GATHER_MAX_WORST` (4) times the average routed rows per
      rank (``ep_size * min(top_k, E/ep_size) / top_k``), else ``"all_to_all"``: the
      all-gather then sends at most about twice the all-to-all's bytes, never syncs with the host and can be captured in CUDA graphs, which is what made
      expert parallelism as fast per GPU as one GPU in the trainer. It needs the same token
      count on every rank (a fixed micro-batch); with uneven counts use ``"all_to_all"``.
      :func:`ep_moe.ep.resolve_dispatch` tells what it picks (``MoELayer.dispatch``).
    - ``"all_to_all"``: each token goes to the ranks of its experts (uneven
      ``all_to_all_single`` on NCCL), one host sync per call for the split sizes. Takes any
      token count per rank; sends each token once per destination rank (a small eager call
      on every rank: one row per kept slot, in fewer host ops, ``ep_moe.ep.slot_rows``).
    - ``"all_gather"``: every rank receives every token of the EP group and the partial
      outputs come back summed (NCCL): no host sync, so the layer can be captured in CUDA
      graphs; more bytes where tokens reach few of the ranks. Needs the same token count on
      every rank.
    - ``"all_gather_copy_engine"``: the all-gather with the tokens (and the backward's output
      gradients) pulled on the GPUs' copy engines through a symmetric-memory workspace, the
      experts' first GEMM starting on the rank's own tokens while the others land, and the
      forward's sums pushed back on them. One node, an NCCL group, CUDA; raises on the
      first call otherwise."""
    expert_precision: ExpertPrecision = "bf16"
    """The operands of the routed experts' two grouped GEMMs. ``"bf16"``: the compute dtype
    (bf16 under the usual autocast). ``"fp8"``: e4m3 with one scale per row and per (expert,
    output channel), fp32 accumulation, outputs in the compute dtype, in the forward and the
    dX; the weight gradients in the compute dtype, the up projection's from the tokens' e4m3
    values (:mod:`ep_moe.kernels.fp8` has the recipe); at EP>1 the tokens travel in e4m3,
    about half the bytes, with the same results (:mod:`ep_moe.ep.fp8_wire`; not the slot-row
    format of small eager calls);
    the weights' e4m3 copies are made once per optimizer step from the parameters as they
    are (fp32 master weights are quantized directly), the parameters stay in their dtype.
    The router, the shared experts and the activation between the GEMMs stay in the compute
    dtype. Runs on the Triton kernels (not ``backend="torch"``), on GPUs with FP8 tensor
    cores (compute capability 8.9 or newer; the layer's construction raises elsewhere, and
    on a CPU without ``TRITON_INTERPRET=1``); not with ``dispatch="all_gather_copy_engine"``
    nor an expert module run as is. Every call runs the FP8 kernels: small eager calls do not
    take ``torch._grouped_mm``, the EP receivers' down projection sums each row's slots
    after the GEMM rather than inside it, ``torch.compile`` runs the GEMMs eagerly (a graph
    break), and a CUDA graph quantizes the weights on every replay. The copies (one byte per
    weight value, in two layouts) stay cached with each weight until its next step, under
    FSDP too."""
    all_gather_row_bound: Optional[float] = None
    """The all-gather dispatches: the most routed rows a rank computes, as a multiple of
    T*K (its share on average); None: the worst case ``P*T*min(K, E/P)``, never exceeded,
    which sizes the expert activations for it (P times the average at K <= E/P). Slots
    past a set bound are dropped (their expert's last ones first) and counted in
    ``last_stats.num_dropped``."""

    def __post_init__(self) -> None:
        for name, rule in _RULES.items():
            rule.check(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                             f"lower top_k to at most {self.num_experts} or add experts")
        if self.shared_intermediate_size is not None and self.num_shared_experts == 0:
            raise ValueError(f"MoEConfig.shared_intermediate_size={self.shared_intermediate_size} "
                             "is set but num_shared_experts=0; set num_shared_experts >= 1 or drop it")
        if self.ep_size is not None:
            check_experts_divide(self.num_experts, self.ep_size, f"ep_size={self.ep_size}")
        if self.num_linears == 1:
            self._check_single_linear()
        if self.expert_precision == "fp8":
            check_fp8_combination(self.backend, self.dispatch, "MoEConfig")

    def _check_single_linear(self) -> None:
        """``num_linears=1``: one Linear H -> H, no activation, not on the copy engines."""
        if self.activation != "identity":
            raise ValueError(f"MoEConfig.num_linears=1 (one Linear per expert) has no activation, but "
                             f"activation={self.activation!r}; pass activation='identity', or num_linears=2")
        if self.intermediate_size != self.hidden_size:
            raise ValueError(f"MoEConfig.num_linears=1: the one Linear is H -> H, but intermediate_size="
                             f"{self.intermediate_size} != hidden_size={self.hidden_size}; pass "
                             f"intermediate_size={self.hidden_size}")
        if self.dispatch == "all_gather_copy_engine":
            raise ValueError("MoEConfig.num_linears=1 with dispatch='all_gather_copy_engine': the copy engines "
                             "hand over rows still landing, which only the first of two expert GEMMs waits for; "
                             "use dispatch='all_gather' or 'all_to_all'")

    @property
    def gated(self) -> bool:
        """Whether the activation is gated (``act(gate) * up``, :data:`GATED_ACTIVATIONS`)."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def gate_up_size(self) -> int:
        """Output features of the gate_up projection: 2I for a gated activation, else I."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size


def check_fp8_combination(backend: str, dispatch: str, owner: str, verb: str = "use") -> None:
    """``expert_precision="fp8"`` with ``backend`` and ``dispatch``: the FP8 Triton kernels, on
    rows that have landed. Raises naming ``owner``'s fields (``MoEConfig``, or an integration's
    options) and the fix (``verb``: how the caller sets a field)."""
    if backend == "torch":
        raise ValueError(f"{owner}.expert_precision='fp8' runs the experts' GEMMs on ep_moe's FP8 Triton kernels, but "
                         "backend='torch' is the plain-PyTorch path; pass backend='auto' (or 'triton'), or "
                         "expert_precision='bf16'")
    if dispatch == "all_gather_copy_engine":
        raise ValueError(f"{owner}.expert_precision='fp8' with dispatch='all_gather_copy_engine': the copy engines "
                         "hand over rows still landing, which only the bf16 GEMM waits for (the FP8 GEMM reads rows "
                         f"whole, in e4m3); {verb} dispatch='all_gather' or 'all_to_all', or expert_precision='bf16'")


def check_experts_divide(num_experts: int, ep_size: int, what: str) -> None:
    """Raise unless ``ep_size`` ranks (``what``: where the size comes from) share
    ``num_experts`` experts evenly."""
    if num_experts % ep_size != 0:
        raise ValueError(f"MoEConfig.num_experts={num_experts} is not divisible by {what}; "
                         "pick an EP size that divides num_experts")


MAX_WIDTH = 2**20
"""The most features of ``hidden_size`` and ``intermediate_size``: no model is a million wide."""
MAX_EXPERTS = 2**16
"""The most experts of a layer (and so the largest ``top_k``, ``ep_size``)."""
MAX_CAPACITY_FACTOR = float(MAX_EXPERTS)
"""The largest ``capacity_factor``: from ``num_experts / top_k`` on (at most
:data:`MAX_EXPERTS`) every slot is kept already, and ``ceil(c * T * K / E)`` must stay an
int64 for any token count; ``1e300`` overflowed in ``capacity_keep_mask``."""
MAX_LOSS_COEF = 100.0
"""The largest router-loss coefficient: past it the router's loss drowns the model's."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_float_dtype(value: Any) -> bool:
    return isinstance(value, torch.dtype) and value.is_floating_point


def _number_text(value: float) -> str:
    """A bound as an error message writes it: ``65536``, ``0.001``, ``1e+12``."""
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class _Rule:
    """What one field takes: a kind (checked first, so that a string from a config file or
    ``--set`` is named, not compared), then a range (``minimum``..``maximum``, which
    ``valid`` defaults to) or a set of choices. A range error names the value, the range
    (``allowed: 0 < capacity_factor <= 65536``) and the fix."""

    kind: Callable[[Any], bool]
    kind_text: str
    """How to say the kind in an error ("must be an int")."""
    valid: Optional[Callable[[Any], bool]] = None
    """None: within ``minimum`` and ``maximum``."""
    range_text: str = ""
    """What the error says of a value below the range (or failing ``valid``)."""
    optional: bool = False
    """None is allowed (and skips the range check)."""
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    """The range's bounds; None: unbounded on that side (a number is still finite)."""
    above_minimum: bool = False
    """``minimum`` itself is outside the range (``> 0`` rather than ``>= 0``)."""
    upper_text: str = ""
    """What the error says of a value past ``maximum``; default ``must be <= maximum``."""
    fix: str = ""
    """What to do instead, appended to a range error."""

    def allowed(self, name: str) -> str:
        """The range as an error message writes it (``0 < capacity_factor <= 65536, or None``)."""
        if self.minimum is None and self.maximum is None:
            return ""
        low = "" if self.minimum is None else f"{_number_text(self.minimum)} {'<' if self.above_minimum else '<='} "
        high = "" if self.maximum is None else f" <= {_number_text(self.maximum)}"
        return f"{low}{name}{high}{', or None' if self.optional else ''}"

    def in_range(self, value: Any) -> bool:
        if self.valid is not None:
            return self.valid(value)
        if self.minimum is not None and (value <= self.minimum if self.above_minimum else value < self.minimum):
            return False
        return self.maximum is None or value <= self.maximum

    def problem(self, name: str, value: Any) -> Optional[str]:
        """What is wrong with ``value`` of field ``name`` (without the name), None if nothing."""
        if value is None and self.optional:
            return None
        allowed = self.allowed(name)
        tail = (f"; allowed: {allowed}" if allowed else "") + (f"; {self.fix}" if self.fix else "")
        if not self.kind(value):
            number = isinstance(value, float) and not math.isfinite(value)  # nan, inf: say the range too
            return f"{self.kind_text}{', or None' if self.optional else ''}{tail if number else ''}"
        if self.in_range(value):
            return None
        if self.maximum is not None and value > self.maximum:
            return f"{self.upper_text or f'must be <= {_number_text(self.maximum)}'}{tail}"
        return f"{self.range_text}{tail}"

    def check(self, name: str, value: Any, prefix: str = "MoEConfig.", sep: str = ": ") -> None:
        """Raise ``ValueError("{prefix}{name}={value!r}{sep}{problem}")`` for a value outside
        the rule; ``prefix`` and ``sep`` fit the message to its caller (the DeepSpeed
        drop-in names its arguments bare: ``capacity_factor=nan must be ...``)."""
        problem = self.problem(name, value)
        if problem is not None:
            raise ValueError(f"{prefix}{name}={value!r}{sep}{problem}")


def _choice(*choices: str) -> _Rule:
    return _Rule(lambda value: value in choices, f"use one of {choices}")


def _int_rule(minimum: int, maximum: int, range_text: str, optional: bool = False, fix: str = "",
              upper_text: str = "") -> _Rule:
    return _Rule(_is_int, "must be an int", range_text=range_text, optional=optional, minimum=minimum,
                 maximum=maximum, fix=fix, upper_text=upper_text)


def _number_rule(minimum: float, maximum: Optional[float], range_text: str, *, above_minimum: bool,
                 optional: bool = False, fix: str = "") -> _Rule:
    return _Rule(_is_number, "must be a finite number", range_text=range_text, optional=optional,
                 minimum=minimum, maximum=maximum, above_minimum=above_minimum, fix=fix)


_FLAG = _Rule(lambda value: isinstance(value, bool), "must be True or False")
_WIDTH = _int_rule(1, MAX_WIDTH, "must be a positive int")
_LOSS_COEF = _number_rule(0.0, MAX_LOSS_COEF, "must be >= 0 (0 disables it)", above_minimum=False,
                          fix="0 disables it; the usual values are 1e-3 to 1e-2 (past 100 the router's loss drowns the "
                              "model's)")

_RULES: dict[str, _Rule] = {
    "hidden_size": _WIDTH,
    "intermediate_size": _WIDTH,
    "num_experts": _int_rule(1, MAX_EXPERTS, "must be a positive int"),
    "top_k": _int_rule(1, MAX_EXPERTS, "must be a positive int", fix="top_k is also at most num_experts"),
    "activation": _choice(*get_args(Activation)),
    "num_linears": _int_rule(1, 2, "use 2 (gate_up, activation, down) or 1 (one Linear H -> H)",
                             upper_text="use 2 (gate_up, activation, down) or 1 (one Linear H -> H)"),
    "mlp_bias": _FLAG,
    "score_func": _choice("softmax", "sigmoid"),
    "norm_topk_prob": _FLAG,
    "aux_loss_coef": _LOSS_COEF,
    "z_loss_coef": _LOSS_COEF,
    "expert_bias": _FLAG,
    "bias_update_rate": _number_rule(0.0, 1.0, "must be >= 0 (0 disables it)", above_minimum=False,
                                     fix="the usual rate is 1e-3 (a step past 1 overturns every expert choice each update)"),
    "capacity_factor": _number_rule(0.0, MAX_CAPACITY_FACTOR, "must be > 0, or None for dropless routing",
                                    above_minimum=True, optional=True,
                                    fix="pass None for dropless routing (from num_experts / top_k on, every slot is kept "
                                        "already)"),
    "drop_policy": _choice("probs", "position"),
    "num_shared_experts": _int_rule(0, 1024, "must be an int >= 0"),
    "shared_intermediate_size": _int_rule(1, 16 * MAX_WIDTH, "must be a positive int", optional=True),
    "router_dtype": _Rule(_is_float_dtype, "use a float dtype, normally torch.float32"),
    "backend": _choice("auto", "triton", "torch"),
    "init_std": _number_rule(0.0, 1.0, "must be > 0", above_minimum=True,
                             fix="the usual std is 0.02 (past 1, activations grow out of range in deep models)"),
    "ep_size": _int_rule(1, MAX_EXPERTS, "must be a positive int that divides num_experts", optional=True),
    "dispatch": _choice("auto", "all_to_all", "all_gather", "all_gather_copy_engine"),
    "expert_precision": _choice(*get_args(ExpertPrecision)),
    "all_gather_row_bound": _number_rule(0.0, float(MAX_EXPERTS), "must be > 0, or None for the worst case",
                                         above_minimum=True, optional=True,
                                         fix="the worst case is at most ep_size times the average; pass None "
                                             "for it"),
}
"""One rule per field of :class:`MoEConfig` (checked at import below)."""
assert set(_RULES) == {f.name for f in fields(MoEConfig)}, "every MoEConfig field needs a rule in _RULES"


def _refusing_removed_fields(init):
    """``MoEConfig.__init__`` that names the replacement of a removed field, and the fields
    there are for an unknown one or a positional argument, instead of a bare ``TypeError``
    (a config file or ``--set moe.transport=...``)."""
    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        if args:
            raise TypeError(f"MoEConfig takes keyword arguments only, got {len(args)} positional; "
                            "write MoEConfig(hidden_size=..., intermediate_size=..., num_experts=..., top_k=...)")
        for name in sorted(kwargs.keys() & _REMOVED_FIELDS.keys()):
            raise ValueError(f"MoEConfig.{name} no longer exists: {_REMOVED_FIELDS[name]}")
        for name in sorted(kwargs.keys() - _RULES.keys()):
            close = difflib.get_close_matches(name, _RULES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(f"MoEConfig has no field {name!r}; {hint}its fields are {', '.join(_RULES)}")
        init(self, **kwargs)
    return checked


MoEConfig.__init__ = _refusing_removed_fields(MoEConfig.__init__)
