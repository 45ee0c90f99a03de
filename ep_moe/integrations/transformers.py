"""ep_moe as the experts of Hugging Face transformers' MoE models, with expert parallelism.

transformers 5 routes the experts of its MoE families through one registry (its
``ExpertsInterface``): an experts module (``@use_experts_implementation``) holds the stacked
weights and calls the registered function ``(module, hidden_states [T, H], top_k_index
[T, K], top_k_weights [T, K]) -> [T, H]``. Importing this module registers ``"ep_moe"``
there::

    import ep_moe.integrations.transformers as ep_hf
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="ep_moe")
    ep_hf.expert_parallel(model, ep_group)      # optional: each rank keeps 1/P of the experts

The experts then run on the module's own parameters, in their own layout (no copy: a
transposed layout is read through its strides): the fused permutation and grouped GEMMs
(forward, dX, dW, the top-k weight gradient) on a GPU, the small-call path for few tokens,
the plain-PyTorch grouped GEMM on the CPU. The activation between the GEMMs is ep_moe's
fused SwiGLU/GeGLU where the module's gate is the default ``act(gate) * up`` with SiLU or
the exact GELU; any other gate (GPT-OSS's clamped, interleaved SwiGLU, say) runs as the
module's own ``_apply_gate`` in torch between the two GEMMs. A module ep_moe cannot compute
exactly (:func:`unsupported_reason`) raises naming why; it never gives another result.

Expert parallelism (:func:`expert_parallel`) keeps the router and everything dense
replicated: each rank runs its own tokens (data parallel) and exchanges them with ep_moe's
dispatchers (``dispatch="auto"``: the all-gather or the all-to-all, :mod:`ep_moe.ep`).
transformers' own expert parallelism (``DistributedConfig``) calls the experts with local
ids and its sentinel id (``>= num_experts``) for slots of other ranks; those slots are left
out here as there (no output, no gradient).

FP8 experts (``expert_precision="fp8"`` of :func:`expert_parallel`, :func:`from_pretrained`,
and of ``ep_moe.train`` through ``moe.expert_precision``) run both grouped GEMMs of every
experts module in e4m3 as :attr:`ep_moe.MoEConfig.expert_precision` describes (forward and
dX on FP8 tensor cores, dW in bf16; the module's weights quantized once per optimizer step, a
transposed layout through its view): on the Triton kernels (``backend="auto"`` picks them for
FP8 on any device), on GPUs with FP8 tensor cores (or the CPU under ``TRITON_INTERPRET=1``).
Anything else raises naming the argument and the fix, at :func:`expert_parallel` where it can
tell (``backend="torch"``, a device without FP8, ``dispatch="all_gather_copy_engine"``), else
at the first call; never a bf16 result instead. At EP=1 ``expert_parallel(model, None,
expert_precision="fp8")`` sets it (a model loaded with ``experts_implementation="ep_moe"``
alone runs the default, bf16 in the compute dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import Literal, Optional, Union, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ep_moe.config import Dispatch, ExpertPrecision, MoEConfig, check_experts_divide, check_fp8_combination
from ep_moe.distributed import all_gather_single, check_same_config, group_size, mark_expert_param, resolve_ep_group
from ep_moe.ep import build_dispatcher
from ep_moe.experts import ActivationArg, StackedExpertsMath, check_fp8_device, compute_dtype
from ep_moe.forward_graphs import ForwardGraphs, graphable, only_own_modules
from ep_moe.kernels.activation import ClampedSwiGLU
from ep_moe.routing import RouterOutput, count_ids

try:
    from transformers.integrations.moe import ExpertsInterface, _default_apply_gate
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("ep_moe.integrations.transformers needs transformers 5 or newer (its ExpertsInterface); "
                      "install it with pip install 'ep-moe[transformers]'") from err

IMPLEMENTATION = "ep_moe"
"""The name ``from_pretrained(experts_implementation=...)`` and ``set_experts_implementation``
take once this module is imported."""

Backend = Literal["auto", "triton", "torch"]
_GRAPHABLE_LIBRARIES = ("transformers.", "torch.nn.", "ep_moe.")
"""Modules a graphed call may run below the experts module (its activation)."""


@dataclass(frozen=True)
class ExpertsOptions:
    """How ep_moe runs one experts module (set by :func:`expert_parallel`, also at EP=1:
    ``expert_parallel(model, None, ...)``; a module never passed there runs the defaults)."""

    dispatch: Dispatch = "auto"
    """At EP>1, how the tokens reach the experts (:attr:`ep_moe.MoEConfig.dispatch`)."""
    backend: Backend = "auto"
    """The grouped GEMM: Triton kernels, the torch reference, or ``"auto"`` (Triton on CUDA)."""
    all_gather_row_bound: Optional[float] = None
    """The all-gather dispatches' row bound (:attr:`ep_moe.MoEConfig.all_gather_row_bound`)."""
    expert_precision: ExpertPrecision = "bf16"
    """The experts' GEMM operands: ``"bf16"``, the compute dtype, or ``"fp8"``, e4m3
    (:attr:`ep_moe.MoEConfig.expert_precision`): the Triton kernels, a device with FP8 tensor
    cores; not with ``backend="torch"`` nor ``dispatch="all_gather_copy_engine"`` (raises here)."""

    def __post_init__(self) -> None:
        choices = get_args(ExpertPrecision)
        if self.expert_precision not in choices:
            raise ValueError(f"ExpertsOptions.expert_precision={self.expert_precision!r}: use one of {choices}")
        if self.expert_precision == "fp8":
            check_fp8_combination(self.backend, self.dispatch, "ExpertsOptions", verb="pass")


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """Why ep_moe cannot run this experts module exactly as transformers' ``"eager"`` does,
    or None when it can."""
    if not hasattr(module, "has_gate"):
        return (f"{type(module).__name__} is not an experts module of transformers' ExpertsInterface "
                "(no @use_experts_implementation)")
    if getattr(module, "has_post_expert_norm", False):
        return (f"{type(module).__name__} normalises each expert's output before the routing weight "
                "(has_post_expert_norm), which the grouped GEMM's epilogue does not compute")
    first = "gate_up_proj" if module.has_gate else "up_proj"
    for name in (first, "down_proj"):
        weight = getattr(module, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            return f"{type(module).__name__}.{name} is not a 3-D [experts, out, in] tensor"
    if module.has_bias:
        for name in (f"{first}_bias", "down_proj_bias"):
            if not isinstance(getattr(module, name, None), torch.Tensor):
                return f"{type(module).__name__} has has_bias=True but no {name}"
    return None


def _check_supported(module: nn.Module) -> None:
    reason = unsupported_reason(module)
    if reason is not None:
        raise NotImplementedError(f"experts_implementation='{IMPLEMENTATION}' cannot run this module: {reason}; "
                                  "use experts_implementation='grouped_mm' for this model")


def _transformers_ep(module: nn.Module) -> bool:
    """Whether transformers' own expert parallelism split this module (its experts are then
    called with local ids and a sentinel; the flag is absent before transformers 5.18)."""
    return getattr(module, "_is_expert_parallel", False)


def _named_activation(act: nn.Module, gated: bool) -> Optional[str]:
    """ep_moe's name for a transformers activation module (fused on the Triton path), or None."""
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    exact_gelu = ((isinstance(act, nn.GELU) and act.approximate == "none")
                  or (type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is F.gelu))
    if gated:
        return "swiglu" if silu else "geglu" if exact_gelu else None
    if silu or exact_gelu:
        return "silu" if silu else "gelu"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return "relu" if isinstance(act, nn.ReLU) else None


def _clamped_swiglu(module: nn.Module) -> Optional[ClampedSwiGLU]:
    """GPT-OSS's gate as ep_moe's fused :class:`~ep_moe.kernels.activation.ClampedSwiGLU`
    where the module's ``_apply_gate`` is that function (its ``alpha`` and ``limit``): checked
    on values on both sides of the limits, float64, so that a gate that only looks like it
    keeps running as the module's own."""
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float, type(None))):
        return None
    form = ClampedSwiGLU(alpha=float(alpha), clamp_at=None if limit is None else float(limit))
    bound = 2.0 * (abs(limit) if limit else 4.0)
    probe = torch.linspace(-bound, bound, 2 * 3 * 37, dtype=torch.float64).view(3, -1)
    probe = probe[:, torch.randperm(probe.shape[1], generator=torch.Generator().manual_seed(0))]
    try:
        theirs = module._apply_gate(probe)
    except Exception:  # noqa: BLE001 - a gate that does not take such a tensor is not this one
        return None
    return form if theirs.shape == (3, 37) and torch.allclose(theirs, form.reference(probe), rtol=1e-12,
                                                             atol=1e-12) else None


def _activation(module: nn.Module) -> ActivationArg:
    """What runs between the GEMMs: a fused ep_moe activation where the module's is one (the
    default gate with SiLU or the exact GELU, GPT-OSS's clamped SwiGLU), else the module's own
    gate (or activation), in torch."""
    if module.has_gate:
        default_gate = getattr(type(module)._apply_gate, "__func__", type(module)._apply_gate) is _default_apply_gate
        if default_gate:
            name = _named_activation(module.act_fn, gated=True) if module.is_concatenated else None
            return name or module._apply_gate
        return _clamped_swiglu(module) or module._apply_gate
    return _named_activation(module.act_fn, gated=False) or module.act_fn


class HFExperts(StackedExpertsMath):
    """One transformers experts module seen as ep_moe's stacked experts: the tensors are the
    module's own parameters, read on every call (views where the module stores them
    transposed), so loading, casting or sharding the module needs nothing here.

    Holds the :class:`ep_moe.MoEConfig` its GEMMs are tuned and dispatched by, and the
    dispatcher (:func:`ep_moe.ep.build_dispatcher`) for its EP group."""

    def __init__(self, module: nn.Module, top_k: int, num_experts: int, group: Optional[ProcessGroup],
                 options: ExpertsOptions) -> None:
        self.module = module
        self.activation = _activation(module)
        local = self.down.shape[0]
        hidden, inter = self.down.shape[1], self.down.shape[2]
        gate_up_size = self.gate_up.shape[1]
        gated = gate_up_size == 2 * inter
        if not gated and gate_up_size != inter:
            raise NotImplementedError(f"{type(module).__name__}: the first projection has {gate_up_size} outputs "
                                      f"and the down projection {inter} inputs; ep_moe runs gate_up [E, 2I or I, H] "
                                      "with down [E, H, I]")
        self.config = MoEConfig(
            hidden_size=hidden, intermediate_size=inter, num_experts=num_experts, top_k=top_k,
            activation=self.activation if isinstance(self.activation, str) else ("swiglu" if gated else "identity"),
            mlp_bias=module.has_bias, dispatch=options.dispatch, backend=options.backend,
            all_gather_row_bound=options.all_gather_row_bound, expert_precision=options.expert_precision,
            ep_size=group_size(group))
        self.fp8_devices: set[torch.device] = set()
        """With ``expert_precision="fp8"``: the devices a call checked FP8 runs on (:meth:`check_device`)."""
        self.num_local_experts = local
        rank = 0 if group is None else dist.get_rank(group)
        self.dispatcher = build_dispatcher(self.config, group, rank, group_size(group), local)
        self.agreed = group is None
        self.forward_graphs = ForwardGraphs() if group is None else None
        """At EP=1, the CUDA graphs of small calls without autograd (:mod:`ep_moe.forward_graphs`)."""
        self._problems = {}
        self.last_tokens_per_expert: Optional[torch.Tensor] = None
        """[E] tokens of this rank per global expert in the last call (:func:`expert_load`)."""

    def check_device(self, x: torch.Tensor) -> None:
        """With ``expert_precision="fp8"``, at the first call on a device: raise where it has
        no FP8 tensor cores (naming the option and the fix), before any exchange."""
        if self.config.expert_precision == "fp8" and x.device not in self.fp8_devices:
            check_fp8_device(x.device, f"{type(self.module).__name__} under experts_implementation='ep_moe': "
                             "expert_precision='fp8'")
            self.fp8_devices.add(x.device)

    def agree(self, x_TH: torch.Tensor) -> None:
        """First call at EP>1: every rank of the group checks that all run the same experts
        on inputs of the same width and dtype (:func:`ep_moe.distributed.check_same_config`), so
        a mismatch raises on every rank instead of hanging an exchange."""
        module = self.module
        others = {"experts module": type(module).__qualname__, "compute dtype": x_TH.dtype,
                  "input hidden size": x_TH.shape[-1],
                  "gate": getattr(self.activation, "__qualname__", self.activation)}
        try:
            check_same_config(self.config, self.dispatcher.group, x_TH.device, others)
        except ValueError as err:
            raise ValueError(f"{type(module).__name__} under expert_parallel: {err}") from None
        self.agreed = True

    # what ForwardGraphs asks of what it graphs (ep_moe.forward_graphs.GraphedForward)
    @property
    def training(self) -> bool:
        return self.module.training

    def graphed_tensors(self):
        """The module's parameters and buffers: what a call reads."""
        return itertools.chain(self.module.parameters(), self.module.buffers())

    def uncounted(self):
        """A call changes no state of the module."""
        return contextlib.nullcontext()

    def call_outputs(self) -> None:
        """A call hands out its result alone."""

    def take_replayed(self, outputs: None) -> None:
        """Nothing besides the result to hand out."""

    def takes_graphs(self, x: torch.Tensor, backend: str) -> bool:
        """Whether this call may replay a CUDA graph: EP=1 without transformers' own EP
        (whose sentinels cost a host sync), the Triton backend, a call
        :func:`ep_moe.forward_graphs.graphable` allows, and nothing below the module but
        transformers' and torch's modules, with no hooks."""
        return (self.forward_graphs is not None and backend == "triton" and not _transformers_ep(self.module)
                and graphable(x) and only_own_modules(self.module, _GRAPHABLE_LIBRARIES))

    def _weight(self, name: str) -> torch.Tensor:
        weight = getattr(self.module, name)
        return weight.transpose(1, 2) if self.module.is_transposed else weight

    @property
    def gate_up(self) -> torch.Tensor:
        """[e, F, H]: ``gate_up_proj`` (``up_proj`` without a gate), as stored or transposed."""
        return self._weight("gate_up_proj" if self.module.has_gate else "up_proj")

    @property
    def down(self) -> torch.Tensor:
        """[e, H, I]: ``down_proj``, as stored or transposed."""
        return self._weight("down_proj")

    @property
    def gate_up_bias(self) -> Optional[torch.Tensor]:
        if not self.module.has_bias:
            return None
        return self.module.gate_up_proj_bias if self.module.has_gate else self.module.up_proj_bias

    @property
    def down_bias(self) -> Optional[torch.Tensor]:
        return self.module.down_proj_bias if self.module.has_bias else None

    __call__ = StackedExpertsMath.forward


@dataclass
class _ModuleState:
    """What ep_moe keeps on one experts module: :func:`expert_parallel`'s options, and the
    :class:`HFExperts` built per top-k. The EP group and the expert count are the module's
    own attributes (``ep_group``, ``num_global_experts``), which :func:`expert_parallel` sets."""

    options: ExpertsOptions
    runners: dict = dataclasses.field(default_factory=dict)
    """top_k -> :class:`HFExperts`."""


_STATE_ATTR = "_ep_moe_state"


def _state(module: nn.Module) -> _ModuleState:
    state = module.__dict__.get(_STATE_ATTR)
    if state is None:
        state = _ModuleState(ExpertsOptions())
        object.__setattr__(module, _STATE_ATTR, state)
    return state


def _num_experts(module: nn.Module) -> int:
    """E over the module's EP group (transformers' own EP: its local count, which its ids index)."""
    return getattr(module, "num_global_experts", module.num_experts)


def _runner(module: nn.Module, top_k: int) -> HFExperts:
    """The module's :class:`HFExperts` for calls of ``top_k`` experts per token (built once)."""
    state = _state(module)
    runner = state.runners.get(top_k)
    if runner is None:
        _check_supported(module)
        runner = state.runners[top_k] = HFExperts(module, top_k, _num_experts(module),
                                                  getattr(module, "ep_group", None), state.options)
    return runner


def gemm_problems(model: nn.Module, top_k: int, dtype: torch.dtype) -> list:
    """The grouped GEMMs of every experts module of ``model`` called with ``top_k`` experts
    per token in ``dtype``, as :mod:`ep_moe.autotune` keys them: what to hand
    :func:`ep_moe.autotune.warmup` before the first step (after :func:`expert_parallel`)."""
    problems = (p for _, module in experts_modules(model) for p in _runner(module, top_k).problems(dtype))
    return list(dict.fromkeys(problems))


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"ep_moe"`` experts implementation: ``hidden_states`` [T, H] through the experts
    ``top_k_index`` [T, K] names, weighted by ``top_k_weights`` [T, K] and summed per token:
    [T, H] in ``hidden_states``' dtype (computed in autocast's dtype where it is on, else the
    weights'). At EP=1 a small call without autograd replays a CUDA graph once its shapes
    recur (:mod:`ep_moe.forward_graphs`)."""
    runner = _runner(module, top_k_index.shape[-1])
    runner.check_device(hidden_states)
    backend = runner.config.backend
    if backend == "auto":  # FP8: Triton's kernels on any device (the CPU under the interpreter)
        backend = "triton" if hidden_states.is_cuda or runner.config.expert_precision == "fp8" else "torch"
    call = functools.partial(_routed_experts, runner, backend)
    if runner.takes_graphs(hidden_states, backend):
        return runner.forward_graphs(runner, (hidden_states, top_k_index, top_k_weights), call)
    return call(hidden_states, top_k_index, top_k_weights)


def _routed_experts(runner: HFExperts, backend: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`experts_forward`'s call, op by op: the router's choice as a
    :class:`~ep_moe.routing.RouterOutput`, then the dispatcher's steps."""
    module, top_k = runner.module, runner.config.top_k
    x_TH = hidden_states.reshape(-1, hidden_states.shape[-1]).to(compute_dtype(module.down_proj))
    ids_TK = top_k_index.reshape(-1, top_k).long()
    weights_TK = top_k_weights.reshape(-1, top_k)
    keep_TK = None
    if _transformers_ep(module):  # transformers' EP: ids >= num_experts are other ranks' slots
        keep_TK = ids_TK < module.num_experts
        ids_TK = ids_TK.clamp(max=module.num_experts - 1)
    num_experts = runner.config.num_experts
    if keep_TK is None:
        counts_E = count_ids(ids_TK.flatten(), num_experts)
    else:  # the sentinel slots counted in a bin past the experts: no mask index, no host sync
        counts_E = count_ids(torch.where(keep_TK, ids_TK, num_experts).flatten(), num_experts + 1)[:num_experts]
    runner.last_tokens_per_expert = counts_E
    zero = weights_TK.new_zeros(())
    router = RouterOutput(topk_ids_TK=ids_TK, topk_weights_TK=weights_TK, topk_scores_TK=weights_TK.detach(),
                          counts_E=counts_E, aux_loss=zero, z_loss=zero)
    if not runner.agreed:
        runner.agree(x_TH)
    dispatcher = runner.dispatcher
    dispatcher.start(x_TH.shape[0], x_TH.device)
    routed = dispatcher.dispatch(x_TH, router, keep_TK, backend)
    y_TH = dispatcher.combine(routed, dispatcher.experts(routed, runner)).to(hidden_states.dtype)
    # no view when the shape is the same: FSDP hooks the experts' backward unshard on this
    # output, which an in-place op on a view would drop
    return y_TH if hidden_states.dim() == 2 else y_TH.view(hidden_states.shape)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every transformers experts module in ``model``
    (``@use_experts_implementation`` classes), in module order."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "_apply_gate")]


_EXPERT_TENSOR_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                        "down_proj_bias")


def expert_parallel(model: nn.Module, ep_group: Union[None, ProcessGroup, DeviceMesh], *,
                    dispatch: Dispatch = "auto", backend: Backend = "auto",
                    all_gather_row_bound: Optional[float] = None,
                    expert_precision: ExpertPrecision = "bf16") -> nn.Module:
    """Split every experts module of ``model`` over ``ep_group`` (a ProcessGroup, a 1-D
    DeviceMesh, or None for EP=1, which only sets the options) and run it with ep_moe.

    Rank p keeps experts ``p*e .. p*e+e-1`` (``e = E / P``) of each module: its stacked
    tensors are cut to them in place (tagged as expert parameters for
    :func:`ep_moe.parallel.sync_gradients`). Everything else stays replicated. Each rank
    feeds its own tokens; the router's global expert ids reach the right rank through
    ``dispatch``. Sets ``experts_implementation="ep_moe"``. Call on every rank of the group,
    with the same model, before building the optimizer. Returns ``model``.

    ``expert_precision="fp8"``: the experts' grouped GEMMs in e4m3
    (:attr:`ExpertsOptions.expert_precision`); raises here, naming the fix, with
    ``backend="torch"`` or where the experts' device has no FP8 tensor cores (a CPU without
    ``TRITON_INTERPRET=1``; the meta device is left to the first call).
    """
    group = resolve_ep_group(ep_group)
    size = group_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    try:
        options = ExpertsOptions(dispatch=dispatch, backend=backend, all_gather_row_bound=all_gather_row_bound,
                                 expert_precision=expert_precision)
    except ValueError as err:
        raise ValueError(f"expert_parallel: {err}") from None
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no transformers experts module (@use_experts_implementation); "
                         "expert_parallel splits the experts of a transformers MoE model")
    if expert_precision == "fp8":  # before any module is split
        for name, module in modules:
            check_fp8_device(module.down_proj.device, f"expert_parallel: {name}: expert_precision='fp8'")
    for name, module in modules:
        reason = unsupported_reason(module)
        if reason is not None:
            raise NotImplementedError(f"expert_parallel: {name}: {reason}")
        if _transformers_ep(module):
            raise ValueError(f"expert_parallel: {name} is already split by transformers' own expert parallelism "
                             "(DistributedConfig / tp_plan); load the model without it")
        if getattr(module, "ep_group", None) is not None:
            raise ValueError(f"expert_parallel: {name} is already split over an EP group; call it once per model")
        num_experts = module.down_proj.shape[0]
        check_experts_divide(num_experts, size, f"the ep_group size {size} ({name})")
        local = num_experts // size
        first = rank * local
        for tensor_name in _EXPERT_TENSOR_NAMES:
            param = module._parameters.get(tensor_name)
            if param is None:
                continue
            if size > 1:
                param = nn.Parameter(param.detach()[first:first + local].clone(), requires_grad=param.requires_grad)
                module._parameters[tensor_name] = param
            mark_expert_param(param)
        object.__setattr__(module, _STATE_ATTR, _ModuleState(options))
        # what ep_moe.checkpoint and apply_fsdp ask of an experts module: its rows' global
        # experts and its EP group
        module.global_ids = functools.partial(range, first, first + local)
        module.num_global_experts = num_experts
        module.ep_group, module.ep_size = group, size
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        if top_k is not None:  # its runner built here, not inside a torch.compile trace (graph breaks)
            _runner(module, int(top_k))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    else:  # experts modules outside a transformers model: their configs pick the implementation
        for _, module in modules:
            module.config._experts_implementation = IMPLEMENTATION
    return model


# ---------------------------------------------------------------------------------------
# Checkpoints: each rank reads its own experts; a save gathers them into one HF folder

_PER_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<rest>.+)$")
"""A checkpoint key of one expert (transformers' original layout: ``...experts.{g}.gate_proj.weight``)."""
_STACKED_KEY = re.compile(r"^.*\.experts\.(?:" + "|".join(_EXPERT_TENSOR_NAMES) + r")$")
"""A checkpoint key of every expert stacked on the first dim (``...experts.gate_up_proj``)."""


class _ExpertRows:
    """Rows ``first:first+count`` of a stacked expert tensor in a safetensors file, read only
    when transformers' loader materialises it (``value[...]``)."""

    def __init__(self, file_slice, first: int, count: int) -> None:
        self._slice, self._first, self._count = file_slice, first, count

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[self._first:self._first + self._count][index]

    def get_shape(self) -> list[int]:
        return [self._count, *self._slice.get_shape()[1:]]

    def get_dtype(self) -> str:
        return self._slice.get_dtype()


def _checkpoint_files(path: str) -> list[str]:
    """The safetensors files of an HF folder (sharded with an index, or one file)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path} holds no model.safetensors nor model.safetensors.index.json; pass a folder "
                            "written by save_pretrained (safetensors weights)")


def _local_checkpoint(files: list, num_experts: int, first: int, count: int) -> dict:
    """This rank's view of the checkpoint, lazily read: every key but other ranks' experts;
    per-expert keys renumbered from 0 (as a checkpoint of ``count`` experts), stacked ones
    cut to this rank's rows. ``files``: open safetensors handles."""
    state = {}
    for handle in files:
        for key in handle.keys():
            match = _PER_EXPERT_KEY.match(key)
            if match is not None:
                expert = int(match["expert"])
                if first <= expert < first + count:
                    state[f"{match['prefix']}.{expert - first}.{match['rest']}"] = handle.get_slice(key)
                continue
            value = handle.get_slice(key)
            if _STACKED_KEY.match(key) and value.get_shape()[0] == num_experts and count != num_experts:
                value = _ExpertRows(value, first, count)
            state[key] = value
    return state


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters created inside go to the meta device (no memory); buffers stay real (a
    rotary embedding's frequencies are computed at construction, not loaded)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def from_pretrained(model_class, path: str, ep_group: Union[None, ProcessGroup, DeviceMesh], *,
                    dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu",
                    dispatch: Dispatch = "auto", backend: Backend = "auto",
                    all_gather_row_bound: Optional[float] = None, expert_precision: ExpertPrecision = "bf16",
                    **config_kwargs) -> nn.Module:
    """``model_class.from_pretrained(path)`` split over ``ep_group`` as :func:`expert_parallel`
    splits it, each rank reading only its own experts from the safetensors files (and every
    dense tensor). ``model_class``: an Auto class (``AutoModelForCausalLM``) or a model
    class; ``path``: a local HF folder with safetensors weights; ``dtype``: of the
    parameters (default: the checkpoint's); ``config_kwargs`` go to ``AutoConfig``. Returns
    the model in eval mode, on ``device``, with ``experts_implementation="ep_moe"``;
    ``dispatch``, ``backend``, ``all_gather_row_bound`` and ``expert_precision`` (``"fp8"``:
    e4m3 experts) as :func:`expert_parallel` takes them, checked before any file is read (FP8
    on ``device`` too). Raises naming the tensors the checkpoint lacks or holds in another
    shape."""
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from safetensors import safe_open

    options = dict(dispatch=dispatch, backend=backend, all_gather_row_bound=all_gather_row_bound,
                   expert_precision=expert_precision)
    try:
        ExpertsOptions(**options)
    except ValueError as err:
        raise ValueError(f"from_pretrained: {err}") from None
    if expert_precision == "fp8":
        check_fp8_device(torch.device(device), f"from_pretrained(device={str(device)!r}): expert_precision='fp8'")
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    if getattr(config, "quantization_config", None) is not None:
        raise NotImplementedError(f"{path} is a quantized checkpoint ({config.quantization_config}); "
                                  "ep_moe.integrations.transformers.from_pretrained loads bf16/fp32 weights")
    config._experts_implementation = IMPLEMENTATION
    build = getattr(model_class, "from_config", None) or model_class._from_config
    with _parameters_on_meta():
        model = build(config, dtype=dtype) if dtype is not None else build(config)
    expert_parallel(model, ep_group, **options)
    for module in model.modules():  # the buffers (parameters stay on meta until loaded)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    group = resolve_ep_group(ep_group)
    size, rank = group_size(group), (0 if group is None else dist.get_rank(group))
    num_experts = {_num_experts(m) for _, m in experts_modules(model)}
    if len(num_experts) != 1:
        raise NotImplementedError(f"{type(model).__name__} has experts modules of {sorted(num_experts)} experts; "
                                  "from_pretrained renumbers the experts of models with one expert count")
    total = num_experts.pop()
    local = total // size
    handles = [safe_open(f, framework="pt", device="cpu") for f in _checkpoint_files(path)]
    try:
        state = _local_checkpoint(handles, total, rank * local, local)
        load_config = LoadStateDictConfig(pretrained_model_name_or_path=path, dtype=dtype,
                                          device_map={"": torch.device(device)},
                                          weight_mapping=get_model_conversion_mapping(model))
        info, _ = convert_and_load_state_dict_in_model(model=model, state_dict=state, load_config=load_config)
    finally:
        for handle in handles:
            handle.__exit__(None, None, None)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    unloaded = [name for name, p in model.named_parameters() if p.is_meta]
    if info.mismatched_keys or unloaded:
        shapes = "; ".join(f"{k}: checkpoint {tuple(a)}, model {tuple(b)}" for k, a, b in sorted(info.mismatched_keys))
        raise ValueError(f"from_pretrained({path!r}): the checkpoint does not fill the model: missing "
                         f"{unloaded[:8]}{' ...' if len(unloaded) > 8 else ''}; other shapes: {shapes or 'none'}. "
                         "Load a checkpoint of this config (save it with ep_moe.integrations.transformers."
                         "save_pretrained or transformers' save_pretrained)")
    for _, module in experts_modules(model):
        for tensor_name in _EXPERT_TENSOR_NAMES:
            if module._parameters.get(tensor_name) is not None:
                mark_expert_param(module._parameters[tensor_name])
    return model.eval()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every expert tensor split by :func:`expert_parallel`
    gathered whole over its EP group (a collective: call on every rank of it)."""
    return gather_experts(model, model.state_dict())


def gather_experts(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state``, a state dict of ``model`` holding each rank's own expert rows (as
    ``model.state_dict()``, or FSDP's full state dict, ``get_model_state_dict(...,
    full_state_dict=True)``, holds them), with every expert tensor split by
    :func:`expert_parallel` gathered whole over its EP group, in place (a collective: call
    on every rank of the group). Returns ``state``."""
    for name, module in experts_modules(model):
        group = getattr(module, "ep_group", None)
        if group_size(group) == 1:
            continue
        prefix = f"{name}." if name else ""
        for tensor_name in _EXPERT_TENSOR_NAMES:
            if module._parameters.get(tensor_name) is None:
                continue
            local = state[prefix + tensor_name].detach().contiguous()
            whole = local.new_empty((local.shape[0] * group_size(group), *local.shape[1:]))
            all_gather_single(whole, local, group=group)
            state[prefix + tensor_name] = whole
    return state


def expert_load(model: nn.Module) -> torch.Tensor:
    """[num_modules, E] int64 tokens per global expert of each experts module's last call
    under ``"ep_moe"`` (this rank's tokens: all-reduce over every rank for the whole job);
    modules not yet called are skipped, as :func:`ep_moe.layer.expert_load` skips layers."""
    counts = [runner.last_tokens_per_expert for _, module in experts_modules(model)
              for runner in _state(module).runners.values() if runner.last_tokens_per_expert is not None]
    if not counts:
        return torch.zeros((0, 0), dtype=torch.int64)
    return torch.stack(counts)


def save_pretrained(model: nn.Module, path: str, **kwargs) -> None:
    """Write ``model`` as an HF folder that plain transformers loads (``from_pretrained``)
    with the same outputs: the experts split by :func:`expert_parallel` are gathered
    (:func:`full_state_dict`, a collective: call on every rank), and rank 0 of the default
    group writes (``kwargs`` go to transformers' ``save_pretrained``); every rank returns
    once the folder is complete."""
    state = full_state_dict(model)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=state, is_main_process=True, **kwargs)
    if distributed:
        dist.barrier()


def register() -> None:
    """Register ``"ep_moe"`` in transformers' ``ExpertsInterface`` (done on import; idempotent)."""
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


register()

__all__ = ["ExpertsOptions", "HFExperts", "IMPLEMENTATION", "experts_forward", "experts_modules", "expert_load",
           "expert_parallel", "from_pretrained", "full_state_dict", "gather_experts", "gemm_problems", "register",
           "save_pretrained", "unsupported_reason"]
