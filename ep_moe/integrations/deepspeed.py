"""Drop-in for ``deepspeed.moe.layer.MoE`` (DeepSpeed 0.19.8) backed by :class:`ep_moe.MoELayer`.

:class:`MoE` takes DeepSpeed's constructor arguments and returns DeepSpeed's
``(output, l_aux, exp_counts)``; :func:`replace_deepspeed_moe` swaps the DeepSpeed MoE
layers of a built model for it, copying the weights. This module maps arguments and
weights, and mixes in Residual MoE's MLP; the math lives in :mod:`ep_moe.layer` and the
gating in :mod:`ep_moe.integrations.deepspeed_gate`. DeepSpeed itself is imported only
by :func:`replace_deepspeed_moe`, :meth:`MoE.set_deepspeed_parallelism` and when an
engine-class layer is unpickled.

Gating. :class:`MoE` routes with DeepSpeed's ``TopKGate``
(:class:`~ep_moe.integrations.deepspeed_gate.DeepSpeedGate`, computed by DeepSpeed's own
tensor operations and random draws, fed to the layer through ``MoELayer.forward``'s
``route_fn``): k = 1, 2 and more; ``drop_tokens`` with ``capacity_factor`` (training),
``eval_capacity_factor`` (eval mode), ``min_capacity`` and ``use_rts``; ``noisy_gate_policy``
"Jitter" and "RSample"; ``top2_2nd_expert_sampling``; ``forward``'s ``used_token``. Its
``l_aux`` (unscaled: the caller multiplies it by its coefficient) and ``exp_counts`` are
DeepSpeed's. The router weight is ``gate.wg`` (bias-free, fp32 logits); the experts, the EP
dispatch and the kernels are ep_moe's. ``hidden_states`` of any shape [..., H]; the output
keeps shape and dtype. ``use_tutel`` (a DeepSpeed speed option, same math) is accepted and
ignored.

Residual MoE (``use_residual=True``): as DeepSpeed's, the expert module itself (not a copy)
is a dense MLP every token goes through, mixed with the MoE output by ``softmax`` of a
learned ``coefficient`` Linear (H -> 2); keys ``mlp.*`` and ``coefficient.*``. Pyramid MoE
(layers of different ``num_experts`` and ``ep_size``) needs nothing more: each layer has its
own experts and the EP group of its ``ep_size``. ``enable_expert_tensor_parallelism=True`` is
accepted where it changes nothing in DeepSpeed (no tensor parallelism); under tensor
parallelism :meth:`MoE.set_deepspeed_parallelism` raises, since ep_moe cannot run
tensor-parallel experts.

Expert modules. DeepSpeed deep-copies the expert module into each local expert, and so
does the drop-in: every local expert starts as the module's values. Experts made of
``nn.Linear`` layers run on the grouped GEMMs (biases in their epilogue), their form read
from the module's structure (:func:`infer_expert_layout`, giving ``MoEConfig.activation``,
``num_linears`` and ``mlp_bias``), all of their Linears with a bias or none:

- ``nn.Linear(H, H)``: one Linear (the PR-MoE examples);
- an ``nn.Sequential`` of Linear, Linear (no activation, as DeepSpeed's tests build), or
  of Linear, activation, Linear with ``nn.ReLU``, ``nn.GELU()``,
  ``nn.GELU(approximate="tanh")`` or ``nn.SiLU`` (Megatron-DeepSpeed's GPT experts are a
  GELU MLP with biases); ``nn.Identity`` and ``nn.Dropout(0)`` layers are skipped;
- three Linears named gate/up/down (``gate_proj/up_proj/down_proj``, Mixtral's
  ``w1/w3/w2``, or ``gate/up/down``): a gated expert, SwiGLU, or GeGLU when its
  activation module is an ``nn.GELU()``;
- any other module of two Linears (first H -> F, second I -> H, in registration order):
  a gated expert with ``[gate; up]`` stacked when F = 2I, else an MLP whose activation is
  its one activation module.

``activation=`` stands for the activation module where the module has none. Any other
expert (other layers or parameters, an activation ep_moe does not run or one applied as
a function, Megatron's parallel Linears, a module returning an ``(output, bias)`` pair, of
which DeepSpeed keeps the output) runs as is, on each local expert's rows in a loop
(:class:`ep_moe.experts.ModuleExperts`, the slow path, which a warning names), with the
same dispatch and gradients. Passing both ``intermediate_size=`` and ``activation=`` for
a module that does not fit them builds grouped experts of that shape instead, with
ep_moe's init (their weights cannot be mapped from the module's).

Process groups and training. ``ep_size > 1`` builds the EP group with
:func:`ep_moe.parallel.build_ep_groups` (consecutive ranks, DeepSpeed's default layout),
once per ``ep_size`` and shared by every layer. Outside the DeepSpeed engine, average the
gradients with :func:`ep_moe.parallel.sync_gradients`.

Under ``deepspeed.initialize`` the layer trains as DeepSpeed's own MoE does, at any
``ep_size``. The engine recognises MoE layers by ``isinstance(module,
deepspeed.moe.layer.MoE)``, so when ``deepspeed`` is already imported, :class:`MoE`
builds an instance of a subclass of both classes (``isinstance(layer, MoE)`` still
holds; the layer's code is ours). The engine then calls
:meth:`MoE.set_deepspeed_parallelism`, which, as DeepSpeed's ``_create_process_groups``
does, creates DeepSpeed's expert and expert-data-parallel groups named
``ep_size_<ep_size>`` (honouring the engine's ``use_data_before_expert_parallelism``),
makes DeepSpeed's expert-parallel group the layer's all-to-all group. The expert weights
carry DeepSpeed's tags (``allreduce=False``, ``group_name="ep_size_<ep_size>"``) from the
layer's construction when ``deepspeed`` is imported by then (as DeepSpeed's ``Experts``
tags its own; the ZeRO 1/2 param groups below read them), else from
``set_deepspeed_parallelism``. The engine thus all-reduces expert gradients over
the expert-data-parallel group only and divides them, like every other gradient, by the
data-parallel world size, exactly as :func:`ep_moe.parallel.sync_gradients` does; the
router and the rest of the model are averaged over all data-parallel ranks; at start the
engine broadcasts expert weights from the first rank of their expert-data-parallel group
and the rest from rank 0. ZeRO stages 1 and 2 partition the expert parameter groups over
the expert-data-parallel group, and gradient clipping takes DeepSpeed's MoE-aware norm, as
for DeepSpeed's own layer. For ZeRO 1/2, pass a client optimizer DeepSpeed's MoE parameter
groups (``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``, which
reads the tags above), as for DeepSpeed's own MoE; ZeRO 3 the engine refuses for MoE.
Tested against DeepSpeed's own MoE layer (``tests/test_deepspeed_engine.py``, CPU, gloo):
ZeRO 0, 1 and 2, each in float32 and in bf16 (the ``"bf16"`` section: DeepSpeed's CPU
accelerator runs it), a client ``torch.optim`` optimizer, gradient clipping, at world 2
and 4 with ``ep_size=2``: losses, global gradient norms and weights match step by step
(float32 to rounding, bf16 to its precision).
:meth:`MoE.set_deepspeed_parallelism` raises (naming the fix) where this cannot work: a
layer built before ``import deepspeed`` at ``ep_size > 1``, DeepSpeed groups that are not
ep_moe's expert-then-data layout (``use_data_before_expert_parallelism=True`` with
several EP groups), or a custom ``ep_group`` of other ranks.

Checkpoints. :class:`MoE`'s ``state_dict`` has DeepSpeed's MoE keys: the router as
``deepspeed_moe.gate.wg.weight``, local expert j's weights under
``deepspeed_moe.experts.deepspeed_experts.{j}.``, named as in the expert module (grouped
experts of an explicit shape: ``gate_up.weight`` and ``down.weight``). So
``engine.save_checkpoint`` writes DeepSpeed's files, one per global expert
(``layer_X_expert_Y_mp_rank_00_model_states.pt``), and ``engine.load_checkpoint`` reads
them, and checkpoints move between the drop-in and DeepSpeed's own layer both ways. What
loads where is DeepSpeed's rule, the same for its own layer (tested at every ZeRO stage,
float32 and bf16, saved at world 2 with ``ep_size=2``):

- A full load (optimizer state included) at the same ``ep_size`` and world size resumes
  exactly.
- The weights load at any ``ep_size`` dividing ``num_experts`` and any world size (tested:
  ``ep_size`` 1 at world 1 and 2, 2 at world 2 and 4, 4 at world 4), and from DeepSpeed's
  layer's checkpoints (its optimizer holds other parameters): pass
  ``load_module_only=True``, or ``load_optimizer_states=False`` except in bf16 at ZeRO 0,
  where DeepSpeed's ``FP16_UnfusedOptimizer`` then keeps its old fp32 master weights and
  its next step overwrites the loaded ones.
- Optimizer states do not carry across ``ep_size``: ZeRO 0 keeps them per expert-parallel
  rank, ZeRO 1/2 as flat partitions per data-parallel rank (and DeepSpeed refuses another
  world size). For its own layer DeepSpeed refuses another ``ep_size`` too (its parameter
  groups change size); the drop-in's stacked expert tensors keep the parameter count alike
  at every ``ep_size``, so there ZeRO 1/2 would load states (and fp32 master weights) that
  do not fit, silently. The drop-in therefore checks every full load (optimizer states
  loaded, no ``load_module_only``) into an engine that holds it (:func:`check_checkpoint`):
  a checkpoint saved at another ``ep_size``, or under ZeRO 1/2 by DeepSpeed's layer, raises
  :class:`CheckpointLayoutError` on every rank before anything is loaded, naming both
  ``ep_size`` values and the fix (``load_module_only=True``, or resume at the saved
  ``ep_size``). It reads what DeepSpeed wrote, so checkpoints of either layer and of
  earlier versions are checked: under ZeRO 1/2 each layer's saved expert shapes
  (``param_shapes`` of the model-states file: [experts a rank, ...] for the drop-in, one
  entry per local expert for DeepSpeed's layer), at ZeRO 0 the largest saved ``ep_size``
  (one ``expp_rank_R_..._optim_states.pt`` per expert-parallel rank); DeepSpeed's layer's
  ZeRO 0 checkpoints torch refuses itself (parameter groups of other sizes).
  ``DeepSpeedEngine.load_checkpoint`` runs the check: :meth:`MoE.set_deepspeed_parallelism`
  wraps it once per process, and engines without the drop-in are unaffected.

One difference: ``save_checkpoint(exclude_frozen_parameters=True)`` still saves a frozen router
(the engine leaves out frozen weights by parameter name, and the router's key is renamed).
Keys the expert layout does not name (a bias of bias-free experts) are not taken: a
strict load reports them. As for DeepSpeed's layer, these
keys hold local expert ids, so a ``torch.save(model.state_dict())`` of each rank loads back
at the same ``ep_size`` and rank only; ``moe.layer.state_dict()`` has ep_moe's keys (global
expert ids: they reshard on load, :class:`ep_moe.MoELayer`). ``load_state_dict`` takes
either.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Union, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ep_moe.config import Activation, MoEConfig
from ep_moe.distributed import is_expert_param
from ep_moe.integrations.deepspeed_gate import DeepSpeedGate, check_arguments
from ep_moe.layer import MoELayer
from ep_moe.parallel import build_ep_groups, ep_layout

_GATE_NAMES = ("gate_proj", "w1", "gate")
_UP_NAMES = ("up_proj", "w3", "up")
_DOWN_NAMES = ("down_proj", "w2", "down")

# (ep_size, default group) -> this rank's EP group; the key holds the default group so a
# group of an earlier, destroyed default group is never reused.
_EP_GROUPS: dict[tuple[int, ProcessGroup], ProcessGroup] = {}


class UnreadableExpertError(ValueError):
    """:func:`infer_expert_layout` cannot read the expert's math from its structure (the
    drop-in then runs the module as is, :class:`ep_moe.experts.ModuleExperts`)."""


class _StateKeys:
    """Maps one expert's tensors, by ep_moe's names, to the expert module's state-dict keys
    (``state_keys``: name -> the keys whose tensors, stacked on dim 0, make it)."""

    state_keys: dict[str, tuple[str, ...]]

    def from_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ep_moe's tensors of one expert (``gate_up`` [2I or I, H], ``down`` [H, I],
        biases...) from the expert module's state-dict entries (``expert.state_dict()``,
        or its gradients by the same keys). Raises ``KeyError`` for a missing one."""
        return {name: _stacked([state[key] for key in keys]) for name, keys in self.state_keys.items()}

    def to_state(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`from_state`: one expert's tensors as the expert module's
        state-dict entries (views of ``tensors``)."""
        return {key: part for name, keys in self.state_keys.items()
                for key, part in zip(keys, tensors[name].chunk(len(keys)) if len(keys) > 1 else [tensors[name]])}


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _key(module_name: str, tensor: str) -> str:
    """State-dict key of ``tensor`` of the submodule ``module_name`` ("": the expert itself)."""
    return f"{module_name}.{tensor}" if module_name else tensor


@dataclass(frozen=True)
class ExpertLayout(_StateKeys):
    """Where a DeepSpeed expert module keeps the tensors of an ep_moe expert."""

    activation: Activation
    """The expert MLP's activation, as :class:`ep_moe.MoEConfig` names it."""
    intermediate_size: int
    """I, the expert's hidden dimension (H for one Linear)."""
    up: Optional[str]
    """Submodule of the Linear H -> I (the up projection of a gated expert, or the first
    layer of an MLP), or H -> 2I holding ``[gate; up]`` when ``gate`` is None and the
    activation is gated; None for an expert of one Linear."""
    down: str
    """Submodule of the Linear I -> H ("": the expert itself is that Linear)."""
    gate: Optional[str] = None
    """Submodule of a gated expert's separate gate Linear H -> I, if there is one."""
    bias: bool = False
    """Whether the Linears have biases (all of them or none)."""

    @property
    def num_linears(self) -> int:
        """:attr:`ep_moe.MoEConfig.num_linears` of this expert."""
        return 1 if self.up is None else 2

    @property
    def state_keys(self) -> dict[str, tuple[str, ...]]:
        """ep_moe's tensor names -> the expert module's keys (gate before up in ``gate_up``)."""
        tensors = ("weight", "bias") if self.bias else ("weight",)
        first = () if self.up is None else ((self.up,) if self.gate is None else (self.gate, self.up))
        keys = {}
        for tensor in tensors:
            suffix = "" if tensor == "weight" else "_bias"
            if first:
                keys[f"gate_up{suffix}"] = tuple(_key(m, tensor) for m in first)
            keys[f"down{suffix}"] = (_key(self.down, tensor),)
        return keys

    def config_fields(self) -> dict:
        """The :class:`ep_moe.MoEConfig` fields of these experts."""
        return dict(intermediate_size=self.intermediate_size, activation=self.activation,
                    num_linears=self.num_linears, mlp_bias=self.bias)


class _ModuleStateKeys(_StateKeys):
    """The keys of experts run as is (:class:`ep_moe.experts.ModuleExperts`): the expert
    module's own, each tensor under its name."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.state_keys = {name: (name,) for name in names}


def _find(names_by_leaf: dict[str, str], candidates: tuple[str, ...]) -> Optional[str]:
    return next((names_by_leaf[c] for c in candidates if c in names_by_leaf), None)


def _activation_module(module: nn.Module) -> Optional[Activation]:
    """The activation an activation module computes, as :class:`ep_moe.MoEConfig` names it
    (None: not one ep_moe runs)."""
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    return next((name for kind, name in _ACTIVATION_MODULES if isinstance(module, kind)), None)


_ACTIVATION_MODULES = ((nn.ReLU, "relu"), (nn.SiLU, "silu"), (nn.Identity, "identity"))
_GATED = {"silu": "swiglu", "gelu": "geglu"}
"""Gated activations by the gate's activation."""


def _is_noop(module: nn.Module) -> bool:
    return isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout) and module.p == 0)


def _unreadable(kind: str, why: str) -> UnreadableExpertError:
    return UnreadableExpertError(f"cannot read expert {kind}: {why}; ep_moe's drop-in then runs it as is (the "
                                 "slow path), or pass intermediate_size= and activation= to use grouped experts "
                                 "of that shape")


def infer_expert_layout(expert: nn.Module, hidden_size: int,
                        activation: Optional[Activation] = None) -> ExpertLayout:
    """Read an expert module's layout (see the module docstring); ``activation``, when
    given, stands for what the module's activation submodules would tell. Raises
    :class:`UnreadableExpertError` when the structure does not say the expert's math, and
    ``ValueError`` naming what does not fit when it contradicts ``activation`` or
    ``hidden_size``."""
    kind = type(expert).__name__
    linears = [(name, m) for name, m in expert.named_modules() if type(m) is nn.Linear]
    owned = {id(p) for _, m in linears for p in m.parameters()}
    if any(id(p) not in owned for p in expert.parameters()) or next(expert.buffers(), None) is not None:
        raise _unreadable(kind, "it has parameters or buffers besides those of its nn.Linear layers")
    if len({m.bias is not None for _, m in linears}) > 1:
        raise _unreadable(kind, "some of its Linears have a bias and some do not")
    bias = bool(linears) and linears[0][1].bias is not None
    others = [m for m in expert.modules() if m is not expert and not list(m.children())
              and type(m) is not nn.Linear and not _is_noop(m)]
    found = {_activation_module(m) for m in others}
    if None in found or len(found) > 1:
        raise _unreadable(kind, f"its modules {sorted({type(m).__name__ for m in others})} are not one "
                                "activation ep_moe runs (nn.ReLU, nn.GELU, nn.SiLU)")
    found_act = next(iter(found), None)
    if isinstance(expert, nn.Sequential):
        return _sequential_layout(expert, kind, hidden_size, activation, bias)
    if type(expert) is nn.Linear:
        return _single_linear_layout(expert, "", kind, hidden_size, activation, bias)
    if len(linears) == 3:
        return _gated_layout(expert, linears, kind, hidden_size, activation, found_act, bias)
    if len(linears) == 2:
        return _two_linear_layout(linears, kind, hidden_size, activation, found_act, bias)
    raise _unreadable(kind, f"it has {len(linears)} nn.Linear layers in a {kind}, whose forward ep_moe cannot see "
                            "(it reads nn.Linear experts, nn.Sequential MLPs, gate/up/down experts and two-Linear "
                            "MLPs with an activation module)")


def _single_linear_layout(linear: nn.Linear, name: str, kind: str, hidden_size: int,
                          activation: Optional[Activation], bias: bool) -> ExpertLayout:
    if tuple(linear.weight.shape) != (hidden_size, hidden_size):
        raise ValueError(f"expert {kind} is one Linear of shape {list(linear.weight.shape)}, not an expert of "
                         f"hidden_size={hidden_size}: expected [{hidden_size}, {hidden_size}]")
    if activation not in (None, "identity"):
        raise ValueError(f"expert {kind} is one Linear (no activation) but activation={activation!r}; "
                         "drop activation=")
    return ExpertLayout("identity", hidden_size, up=None, down=name, bias=bias)


def _sequential_layout(expert: nn.Sequential, kind: str, hidden_size: int, activation: Optional[Activation],
                       bias: bool) -> ExpertLayout:
    """Linear; Linear, Linear; or Linear, activation, Linear (no-op layers left out)."""
    steps = [(name, m) for name, m in expert.named_children() if not _is_noop(m)]
    types = tuple("linear" if type(m) is nn.Linear else _activation_module(m) for _, m in steps)
    if types == ("linear",):
        return _single_linear_layout(steps[0][1], steps[0][0], kind, hidden_size, activation, bias)
    if types == ("linear", "linear"):
        found = "identity"
    elif len(types) == 3 and types[0] == types[2] == "linear" and types[1] not in (None, "linear"):
        found = types[1]
    else:
        raise _unreadable(kind, f"its layers {[type(m).__name__ for _, m in steps]} are not Linear, an "
                                "activation ep_moe runs, Linear")
    linears = [step for step in steps if type(step[1]) is nn.Linear]
    return _two_linear_layout(linears, kind, hidden_size, activation, found, bias, gated_ok=False)


def _two_linear_layout(linears: list[tuple[str, nn.Linear]], kind: str, hidden_size: int,
                       activation: Optional[Activation], found: Optional[Activation], bias: bool,
                       gated_ok: bool = True) -> ExpertLayout:
    """First Linear H -> F, second I -> H: a gated expert with ``[gate; up]`` stacked when
    F = 2I (``gated_ok``), else an MLP whose activation is ``found`` (its module's)."""
    (first, layer1), (second, layer2) = linears
    out1, in1 = layer1.weight.shape
    out2, inter = layer2.weight.shape
    fused = gated_ok and out1 == 2 * inter
    if in1 != hidden_size or out2 != hidden_size or not (out1 == inter or fused):
        raise ValueError(f"expert {kind} Linears {first} [{out1}, {in1}] and {second} [{out2}, {inter}] are "
                         f"not an MLP of hidden_size={hidden_size}: expected [F, {hidden_size}] then "
                         f"[{hidden_size}, I] with F = I{' or 2I (gated)' if gated_ok else ''}")
    if fused:
        return ExpertLayout(_gated_activation(kind, activation, found), inter, up=first, down=second, bias=bias)
    if activation is not None and found is not None and activation != found:
        raise ValueError(f"expert {kind} has an activation {found!r} but activation={activation!r}; drop "
                         f"activation= or pass {found!r}")
    activation = activation or found
    if activation is None:
        raise _unreadable(kind, f"it has two Linears of I={inter} and no activation module (its forward may "
                                "apply one); pass activation=")
    if activation in _GATED.values():
        raise ValueError(f"expert {kind}'s first Linear has I={out1} outputs, not the 2I of a gated [gate; up], "
                         f"but activation={activation!r}; pass one that is not gated")
    return ExpertLayout(activation, inter, up=first, down=second, bias=bias)


def _gated_activation(kind: str, activation: Optional[Activation], found: Optional[Activation]) -> Activation:
    """The gated activation of a gated expert: ``activation`` if given, else the gate's
    activation module's (SiLU when there is none, as in most SwiGLU experts)."""
    gated = _GATED.get(found or "silu")
    if gated is None:
        raise _unreadable(kind, f"its gate's activation {found!r} is not SiLU or the exact GELU")
    if activation is not None and activation != gated and (found is not None or activation not in _GATED.values()):
        raise ValueError(f"expert {kind} is a gated expert ({gated}) but activation={activation!r}; drop "
                         f"activation= or pass {gated!r}")
    return activation or gated


def _gated_layout(expert: nn.Module, linears: list[tuple[str, nn.Linear]], kind: str, hidden_size: int,
                  activation: Optional[Activation], found: Optional[Activation], bias: bool) -> ExpertLayout:
    """Three Linears named gate/up/down: a gated expert."""
    by_leaf = {name.rsplit(".", 1)[-1]: name for name, _ in linears}
    gate, up, down = (_find(by_leaf, names) for names in (_GATE_NAMES, _UP_NAMES, _DOWN_NAMES))
    if None in (gate, up, down):
        raise _unreadable(kind, f"it has three Linears {sorted(by_leaf)}; a gated expert names them gate/up/down "
                                f"as one of {_GATE_NAMES}, {_UP_NAMES}, {_DOWN_NAMES}")
    gated = _gated_activation(kind, activation, found)
    inter = expert.get_submodule(gate).out_features
    shapes = {n: tuple(expert.get_submodule(n).weight.shape) for n in (gate, up, down)}
    if shapes != {gate: (inter, hidden_size), up: (inter, hidden_size), down: (hidden_size, inter)}:
        raise ValueError(f"expert {kind} weight shapes {shapes} do not fit hidden_size={hidden_size}: "
                         f"gate and up must be [I, {hidden_size}], down [{hidden_size}, I]")
    return ExpertLayout(gated, inter, up=up, down=down, gate=gate, bias=bias)


def deepspeed_moe_config(
    hidden_size: int,
    intermediate_size: int,
    activation: Activation,
    *,
    num_experts: int = 1,
    ep_size: int = 1,
    k: int = 1,
    backend: str = "auto",
    dispatch: str = "auto",
    num_linears: int = 2,
    mlp_bias: bool = False,
    expert_precision: str = "bf16",
) -> MoEConfig:
    """The :class:`ep_moe.MoEConfig` of the layer behind :class:`MoE`: DeepSpeed's experts
    and k, and as router DeepSpeed's without capacity or noise (``drop_tokens=False``,
    no ``noisy_gate_policy``, ``top2_2nd_expert_sampling=False``). :class:`MoE` routes
    with :class:`~ep_moe.integrations.deepspeed_gate.DeepSpeedGate` instead, which adds
    them; this config alone computes the same except ``l_aux`` at k=2 (module docstring)."""
    if activation not in get_args(Activation):
        raise ValueError(f"activation={activation!r}: use one of {get_args(Activation)}")
    return MoEConfig(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts, top_k=k,
        activation=activation, score_func="softmax", norm_topk_prob=k > 1, aux_loss_coef=1.0,
        z_loss_coef=0.0, capacity_factor=None, router_dtype=torch.float32, backend=backend, dispatch=dispatch,
        ep_size=ep_size, num_linears=num_linears, mlp_bias=mlp_bias, expert_precision=expert_precision,
    )


def _ep_group(ep_size: int) -> Optional[ProcessGroup]:
    """This rank's EP group of ``ep_size`` consecutive ranks, built once per default group."""
    if ep_size == 1:
        return None
    if not dist.is_initialized():
        raise ValueError(f"ep_size={ep_size} needs torch.distributed: call torch.distributed.init_process_group "
                         "(or deepspeed.init_distributed) before building the layer, or pass ep_size=1")
    key = (ep_size, dist.group.WORLD)
    if key not in _EP_GROUPS:
        _EP_GROUPS[key] = build_ep_groups(ep_size).ep_group
    return _EP_GROUPS[key]


def _first_param(module: Optional[nn.Module]) -> Optional[torch.Tensor]:
    return None if module is None else next(module.parameters(), None)


def _deepspeed_moe_class() -> Optional[type]:
    """``deepspeed.moe.layer.MoE`` if deepspeed is imported in this process, else None
    (never imports deepspeed)."""
    return getattr(sys.modules.get("deepspeed.moe.layer"), "MoE", None)


# our class -> its subclass that is also a deepspeed.moe.layer.MoE
_ENGINE_CLASSES: dict[type, type] = {}


def _engine_class(cls: type, ds_cls: type) -> type:
    """``cls`` made an instance of DeepSpeed's MoE too, so that the DeepSpeed engine sees
    it as an MoE layer (see the module docstring)."""
    if cls not in _ENGINE_CLASSES:
        name = "_EngineMoE" if cls is MoE else cls.__name__
        _ENGINE_CLASSES[cls] = type(name, (cls, ds_cls), {
            "__module__": cls.__module__, "__qualname__": name if cls is MoE else cls.__qualname__,
            "__doc__": cls.__doc__})
    return _ENGINE_CLASSES[cls]


def __getattr__(name: str):
    # lets pickle find the class of a layer built after ``import deepspeed``
    if name == "_EngineMoE":
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        return _engine_class(MoE, DeepSpeedMoE)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rank_group(layout: list[list[int]], rank: int) -> list[int]:
    return next(ranks for ranks in layout if rank in ranks)


class MoE(nn.Module):
    """``deepspeed.moe.layer.MoE``'s interface on an :class:`ep_moe.MoELayer`.

    Args: DeepSpeed's, in its order (``hidden_size, expert, num_experts, ep_size, k,
    capacity_factor, eval_capacity_factor, min_capacity, use_residual, noisy_gate_policy,
    drop_tokens, use_rts, use_tutel, enable_expert_tensor_parallelism,
    top2_2nd_expert_sampling``, with DeepSpeed's meaning; the gate's are checked by
    :class:`~ep_moe.integrations.deepspeed_gate.DeepSpeedGate`, kept as ``self.gate``), then,
    keyword-only (every numeric one has a range in
    :data:`~ep_moe.integrations.deepspeed_gate.ARGUMENT_RULES`, checked first: a NaN,
    infinite or absurd capacity factor is an error naming it; ``expert`` must be an
    ``nn.Module`` or None):

        intermediate_size, activation: the expert MLP when ``expert`` does not tell them.
        ep_group: a ProcessGroup or 1-D DeviceMesh of ``ep_size`` ranks instead of the one
            built from ``ep_size``.
        backend: the grouped GEMM backend of :class:`ep_moe.MoEConfig`.
        dispatch: how tokens travel at ``ep_size`` > 1, :class:`ep_moe.MoEConfig`'s choice
            (default ``"auto"``; with ``drop_tokens`` the all-gather needs no host sync).
        expert_precision: ``"bf16"`` (default) or ``"fp8"``, :class:`ep_moe.MoEConfig`'s:
            the experts' GEMMs in e4m3 (an expert ep_moe cannot read, run as is, refuses it;
            the residual MLP stays in the compute dtype).
        device, dtype: of the parameters; default those of ``expert``.

    The layer is ``self.layer``; its weights are initialised by ep_moe (the expert module
    is only read for its shape, except as Residual MoE's ``self.mlp``), so copy trained
    weights with :meth:`load_deepspeed` or build with :meth:`from_deepspeed`. Built while
    ``deepspeed`` is imported, the instance is also a ``deepspeed.moe.layer.MoE`` so that
    the DeepSpeed engine treats it as an MoE layer (see the module docstring).
    """

    def __new__(cls, *args, **kwargs):
        ds_cls = _deepspeed_moe_class()
        if ds_cls is not None and not issubclass(cls, ds_cls):
            cls = _engine_class(cls, ds_cls)
        return super().__new__(cls)

    def __init__(
        self,
        hidden_size: int,
        expert: Optional[nn.Module] = None,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        intermediate_size: Optional[int] = None,
        activation: Optional[Activation] = None,
        ep_group: Union[None, ProcessGroup, DeviceMesh] = None,
        backend: str = "auto",
        dispatch: str = "auto",
        expert_precision: str = "bf16",
        device=None,
        dtype=None,
    ) -> None:
        nn.Module.__init__(self)  # not super(): under DeepSpeed the next class is DeepSpeed's MoE
        if expert is not None and not isinstance(expert, nn.Module):
            a_class = isinstance(expert, type) and issubclass(expert, nn.Module)
            raise TypeError("expert must be an nn.Module: the expert MLP that every local expert copies, as "
                            "DeepSpeed's Experts deep-copies it (e.g. nn.Sequential(nn.Linear(H, I), nn.GELU(), "
                            "nn.Linear(I, H))), or None with intermediate_size= and activation=; got "
                            + (f"the class {expert.__name__}: pass an instance of it" if a_class else
                               f"{type(expert).__name__} {expert!r:.80}"))
        check_arguments(hidden_size=hidden_size, num_experts=num_experts, ep_size=ep_size, k=k,
                        capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
                        min_capacity=min_capacity, intermediate_size=intermediate_size)
        self.expert_layout = self._layout(expert, hidden_size, intermediate_size, activation)
        expert_fields, expert_module = self._expert_form(expert, hidden_size, intermediate_size, activation)
        self.gate = DeepSpeedGate(num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                                  noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        config = deepspeed_moe_config(hidden_size, num_experts=num_experts, ep_size=ep_size, k=k, backend=backend,
                                      dispatch=dispatch, expert_precision=expert_precision, **expert_fields)
        param = _first_param(expert)
        self.layer = MoELayer(config, ep_group if ep_group is not None else _ep_group(ep_size),
                              device=device if device is not None or param is None else param.device,
                              dtype=dtype if dtype is not None or param is None else param.dtype,
                              expert_module=expert_module)
        self._copy_expert(expert)
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"  # DeepSpeed's name of the expert groups
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism  # see set_deepspeed_parallelism
        if use_residual:
            self._build_residual(expert, hidden_size)
        # the state dict in DeepSpeed's keys (module docstring)
        if self.expert_layout is not None:
            self._state_layout = self.expert_layout
        elif expert_module is not None:  # the module's own keys
            self._state_layout = _ModuleStateKeys(self.layer.experts.tensor_state_names())
        else:  # grouped experts of the explicit shape: ep_moe's two weights under names of their own
            self._state_layout = ExpertLayout(activation, intermediate_size, up="gate_up", down="down")
        self.register_state_dict_post_hook(_deepspeed_keys_hook)
        self.register_load_state_dict_pre_hook(_ep_moe_keys_hook)
        ds_cls = _deepspeed_moe_class()
        if ds_cls is not None and isinstance(self, ds_cls):
            # tagged now, as DeepSpeed's Experts tags its own: the optimizer's param groups
            # (split_params_into_different_moe_groups_for_optimizer) are built before
            # deepspeed.initialize calls set_deepspeed_parallelism
            self._tag_expert_params()

    @staticmethod
    def _layout(expert: Optional[nn.Module], hidden_size: int, intermediate_size: Optional[int],
                activation: Optional[Activation]) -> Optional[ExpertLayout]:
        """The expert's layout; None when its structure does not tell (the module then runs
        as is) or when the explicit arguments say enough and do not fit it (grouped experts
        of that shape); checks the explicit arguments against it."""
        explicit = intermediate_size is not None and activation is not None
        if expert is None:
            if not explicit:
                raise ValueError("expert=None: pass intermediate_size= and activation= to describe the experts")
            return None
        try:
            layout = infer_expert_layout(expert, hidden_size, activation)
        except ValueError as err:
            if explicit or isinstance(err, UnreadableExpertError):
                return None
            raise
        if intermediate_size is not None and intermediate_size != layout.intermediate_size:
            raise ValueError(f"intermediate_size={intermediate_size} but the expert module's is "
                             f"{layout.intermediate_size}; drop intermediate_size= or fix the expert")
        return layout

    def _expert_form(self, expert: Optional[nn.Module], hidden_size: int, intermediate_size: Optional[int],
                     activation: Optional[Activation]) -> tuple[dict, Optional[nn.Module]]:
        """The :class:`ep_moe.MoEConfig` expert fields and the module to run as is (None:
        grouped experts): the layout's; the explicit shape's when the layout is None; the
        module itself when neither tells (its fields are then a placeholder, one Linear)."""
        if self.expert_layout is not None:
            return self.expert_layout.config_fields(), None
        if intermediate_size is not None and activation is not None:
            return dict(intermediate_size=intermediate_size, activation=activation), None
        return dict(intermediate_size=hidden_size, activation="identity", num_linears=1), expert

    @torch.no_grad()
    def _copy_expert(self, expert: Optional[nn.Module]) -> None:
        """Every local expert starts as a copy of ``expert``, as DeepSpeed's ``Experts``
        deep-copies it (a module run as is was copied already; an expert that could not be
        read, or on the meta device, leaves ep_moe's init)."""
        state = {} if expert is None or self.expert_layout is None else expert.state_dict()
        if not state or any(t.is_meta for t in state.values()):
            return
        for name, value in self.expert_layout.from_state(state).items():
            self.layer.experts.tensor(name).copy_(value)  # the same values for every local expert

    @classmethod
    def from_deepspeed(cls, ds_moe: nn.Module, *, backend: str = "auto", dispatch: str = "auto",
                       expert_precision: str = "bf16") -> "MoE":
        """Our layer with the arguments and weights of a ``deepspeed.moe.layer.MoE``
        (this rank's experts; its EP group must match ep_moe's layout), and a copy of its
        residual MLP (``use_residual``); ``backend``, ``dispatch`` and ``expert_precision``
        as :class:`ep_moe.MoEConfig`'s."""
        gate, experts = ds_moe.deepspeed_moe.gate, ds_moe.deepspeed_moe.experts.deepspeed_experts
        expert = copy.deepcopy(ds_moe.mlp) if ds_moe.use_residual else experts[0]  # the residual MLP is ours
        ours = cls(
            gate.wg.weight.shape[1], expert, ds_moe.num_experts, ds_moe.ep_size, gate.k,
            gate.capacity_factor, gate.eval_capacity_factor, gate.min_capacity, ds_moe.use_residual,
            gate.noisy_gate_policy, gate.drop_tokens, gate.use_rts, ds_moe.deepspeed_moe.use_tutel,
            ds_moe.enable_expert_tensor_parallelism, gate.top2_2nd_expert_sampling, backend=backend,
            dispatch=dispatch, expert_precision=expert_precision,
        )
        ours.load_deepspeed(ds_moe)
        return ours.train(ds_moe.training)

    @torch.no_grad()
    def load_deepspeed(self, ds_moe: nn.Module) -> None:
        """Copy the router and this rank's experts from a ``deepspeed.moe.layer.MoE`` of
        the same shape (DeepSpeed's local expert j is ep_moe's local expert j), and with
        ``use_residual`` its residual MLP and coefficient."""
        if isinstance(self._state_layout, ExpertLayout) and self.expert_layout is None:
            raise ValueError("this layer was built from intermediate_size=/activation= because its expert module "
                             "did not fit them, so DeepSpeed's expert weights cannot be mapped; build it without "
                             "them (see ep_moe.integrations.deepspeed)")
        if (ds_moe.num_experts, ds_moe.ep_size) != (self.num_experts, self.ep_size):
            raise ValueError(f"DeepSpeed layer has num_experts={ds_moe.num_experts}, ep_size={ds_moe.ep_size}; "
                             f"this one {self.num_experts}, {self.ep_size}: build them alike")
        ds_group = ds_moe.deepspeed_moe.ep_group
        if ds_group is not None and self.layer.ep_group is not None:
            ds_ranks = dist.get_process_group_ranks(ds_group)
            our_ranks = dist.get_process_group_ranks(self.layer.ep_group)
            if ds_ranks != our_ranks:
                raise ValueError(f"DeepSpeed's EP group is ranks {ds_ranks} but ep_moe's is {our_ranks}: the local "
                                 "experts would not line up; use DeepSpeed's default expert-then-data layout "
                                 "(use_data_before_expert_parallel_=False)")
        if ds_moe.use_residual != self.use_residual:
            raise ValueError(f"DeepSpeed layer has use_residual={ds_moe.use_residual}, this one "
                             f"{self.use_residual}: build them alike")
        if self.use_residual:
            self.mlp.load_state_dict(ds_moe.mlp.state_dict())
            self.coefficient.load_state_dict(ds_moe.coefficient.state_dict())
        self.layer.router.weight.copy_(ds_moe.deepspeed_moe.gate.wg.weight)
        for j, expert in enumerate(ds_moe.deepspeed_moe.experts.deepspeed_experts):
            for name, value in self._state_layout.from_state(expert.state_dict()).items():
                self.layer.experts.tensor(name)[j].copy_(value)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by ``deepspeed.initialize`` on every module that has it (call on every
        rank, in the same order): as DeepSpeed's MoE, create (once per ``ep_size``) and
        take DeepSpeed's expert-parallel group, and tag the expert weights so the engine
        all-reduces them over the expert-data-parallel group only (module docstring)."""
        ds_cls = _deepspeed_moe_class()
        if ds_cls is None or not isinstance(self, ds_cls):
            if self.ep_size == 1:
                return  # the engine sees no MoE and averages every weight over all ranks: right at ep_size=1
            raise ValueError(f"ep_moe's DeepSpeed MoE with ep_size={self.ep_size} was built before deepspeed was "
                             "imported, so the DeepSpeed engine does not see it as an MoE layer and would "
                             "all-reduce its expert weights over all data-parallel ranks, mixing different "
                             "experts; import deepspeed before building the model (or build the layer with "
                             "MoE.from_deepspeed / replace_deepspeed_moe)")
        from deepspeed.utils import groups

        _check_engine_loads()
        self._check_expert_tensor_parallelism(groups.mpu)
        name = self.expert_group_name
        if name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        ds_ep_group = groups._get_expert_parallel_group(name)
        ds_ep = dist.get_process_group_ranks(ds_ep_group)
        ds_edp = dist.get_process_group_ranks(groups._get_expert_data_parallel_group(name))
        rank = dist.get_rank()
        ep_groups, edp_groups = ep_layout(dist.get_world_size(), self.ep_size)
        ours = (_rank_group(ep_groups, rank), _rank_group(edp_groups, rank))
        if (ds_ep, ds_edp) != ours:
            raise ValueError(f"DeepSpeed's expert groups {name!r} put rank {rank} in expert-parallel group {ds_ep} "
                             f"and expert-data-parallel group {ds_edp}, but ep_moe's expert-then-data layout "
                             f"(ep_moe.parallel.ep_layout) in {ours[0]} and {ours[1]}; set "
                             '"use_data_before_expert_parallelism": false in the DeepSpeed config (without '
                             "pipeline or tensor parallelism), or create the groups that way before "
                             "deepspeed.initialize")
        if self.ep_size > 1:
            current = dist.get_process_group_ranks(self.layer.ep_group)
            if current != ds_ep:
                raise ValueError(f"this layer's ep_group is ranks {current} but DeepSpeed's expert-parallel group "
                                 f"{name!r} is {ds_ep}: the engine would reduce gradients over the wrong "
                                 "replicas; build the layer without ep_group= (or with one of ranks "
                                 f"{ds_ep}) to train it under deepspeed.initialize")
            self.layer.ep_group = ds_ep_group  # same ranks, so ep_rank and the expert sharding hold
        self._tag_expert_params()

    def _check_expert_tensor_parallelism(self, mpu) -> None:
        """Raise under tensor parallelism (an ``mpu`` of tensor-parallel size > 1): DeepSpeed
        then either shards each expert over the tensor-parallel ranks
        (``enable_expert_tensor_parallelism=True``) or splits the tokens, which every
        tensor-parallel rank holds alike, among those ranks before its experts and gathers
        them after (False). ep_moe does neither: each tensor-parallel rank would run every
        token, so expert gradients would come out too large by the tensor-parallel size.
        Without tensor parallelism the flag changes nothing in DeepSpeed, and is accepted."""
        if mpu is None:
            return
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

        tp_size = bwc_tensor_model_parallel_world_size(mpu)
        if tp_size <= 1:
            return
        how = ("shards each expert over the tensor-parallel ranks (e.g. Megatron's ColumnParallelLinear/"
               "RowParallelLinear)" if self.enable_expert_tensor_parallelism else
               "splits the tokens, alike on every tensor-parallel rank, among those ranks before its experts")
        raise ValueError(f"ep_moe's DeepSpeed drop-in does not run under tensor parallelism (size {tp_size} here, "
                         f"enable_expert_tensor_parallelism={self.enable_expert_tensor_parallelism}): DeepSpeed "
                         f"{how}, which ep_moe does not; each tensor-parallel rank would run every token and the "
                         "expert gradients would come out too large. Use DeepSpeed's own MoE layer under tensor "
                         "parallelism, or train without it and spread the experts over more ranks with ep_size")

    def _tag_expert_params(self) -> None:
        """Tag the expert weights as ``deepspeed.moe.experts.Experts`` tags its own."""
        for param in self.layer.parameters():
            if is_expert_param(param):
                param.allreduce = False
                param.group_name = self.expert_group_name

    def _build_residual(self, expert: Optional[nn.Module], hidden_size: int) -> None:
        """Residual MoE (DeepSpeed's ``use_residual``): the expert module itself, not a copy,
        is a dense MLP that every token goes through, mixed with the MoE output by
        ``softmax(coefficient(x))``, a Linear H -> 2 with a bias (``mlp.*`` and
        ``coefficient.*``, DeepSpeed's keys)."""
        if expert is None:
            raise ValueError("use_residual=True runs the expert module as the residual MLP, as DeepSpeed's MoE "
                             "does, but expert=None; pass the expert module")
        router = self.layer.router.weight
        self.mlp = expert
        self.coefficient = nn.Linear(hidden_size, 2, device=router.device, dtype=router.dtype)

    def _mix_residual(self, hidden_states: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's Residual MoE output: ``output * c0 + mlp(x) * c1``, ``c = softmax(coefficient(x))``."""
        output_mlp = self.mlp(hidden_states)
        if isinstance(output_mlp, tuple):
            output_mlp = output_mlp[0]  # a Megatron-style (output, bias) pair: DeepSpeed keeps the output
        coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
        return output * coef[..., 0:1] + output_mlp * coef[..., 1:]

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)`` as DeepSpeed returns them: the output of
        ``hidden_states``' shape and dtype, the unscaled load-balancing loss (0-dim, fp32,
        differentiable), and the assignments per global expert of this rank's tokens ([E]
        int64), routed by DeepSpeed's gating (:mod:`ep_moe.integrations.deepspeed_gate`).
        ``used_token``: k=1 only (DeepSpeed ignores it for k >= 2), one entry per token,
        zero for a token to leave out (its output is 0, or the residual MLP's share)."""
        weight = self.layer.router.weight

        def route_fn(x_TH: torch.Tensor):
            return self.gate.route(x_TH, weight, training=self.training, used_token=used_token)

        output = self.layer(hidden_states, route_fn=route_fn)
        stats = self.layer.last_stats
        if self.use_residual:
            output = self._mix_residual(hidden_states, output)
        return output, stats.aux_loss, stats.tokens_per_expert


_DS_ROUTER_KEY = "deepspeed_moe.gate.wg.weight"
_DS_EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."


def _deepspeed_keys_hook(module: MoE, state_dict, prefix, local_metadata) -> None:
    """state_dict: ep_moe's keys of ``layer`` -> DeepSpeed's MoE keys, the router as
    ``deepspeed_moe.gate.wg.weight`` and local expert j's tensors as
    ``deepspeed_moe.experts.deepspeed_experts.{j}.<its Linear>.weight`` (``.bias``, or
    the module's own keys for a module run as is)."""
    layer, layout = module.layer, module._state_layout
    state_dict[prefix + _DS_ROUTER_KEY] = state_dict.pop(prefix + "layer.router.weight")
    for j, g in enumerate(layer.experts.global_ids()):
        tensors = {name: state_dict.pop(f"{prefix}layer.experts.{name}.{g}") for name in layout.state_keys}
        for key, value in layout.to_state(tensors).items():
            state_dict[f"{prefix}{_DS_EXPERT_PREFIX}{j}.{key}"] = value


def _ep_moe_keys_hook(module: MoE, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs) -> None:
    """load_state_dict: DeepSpeed's MoE keys -> ep_moe's (the inverse of
    :func:`_deepspeed_keys_hook`); ep_moe's own keys pass as they are. Only the keys of the
    expert layout are taken: any other key (a bias of bias-free experts, say) stays and a
    strict load reports it as unexpected; so does a gate without its up, whose ``gate_up``
    is then reported missing."""
    if prefix + _DS_ROUTER_KEY in state_dict:
        state_dict[prefix + "layer.router.weight"] = state_dict.pop(prefix + _DS_ROUTER_KEY)
    layout = module._state_layout
    for j, g in enumerate(module.layer.experts.global_ids()):
        expert_prefix = f"{prefix}{_DS_EXPERT_PREFIX}{j}."
        for name, keys in layout.state_keys.items():
            keys = [expert_prefix + key for key in keys]
            if all(key in state_dict for key in keys):
                state_dict[f"{prefix}layer.experts.{name}.{g}"] = _stacked([state_dict.pop(k) for k in keys])


class CheckpointLayoutError(ValueError):
    """A full ``engine.load_checkpoint`` (optimizer state included) of a checkpoint whose
    optimizer state does not fit the engine's drop-in layers: saved at another ``ep_size``,
    or by DeepSpeed's own MoE layer (:func:`check_checkpoint`)."""


def check_checkpoint(engine, load_dir: str, tag=None, *, load_optimizer_states: bool = True,
                     load_module_only: bool = False) -> None:
    """Raise :class:`CheckpointLayoutError` where ``engine.load_checkpoint(load_dir, tag,
    load_optimizer_states=..., load_module_only=...)`` would load optimizer state that does
    not fit the drop-in layers of ``engine.module`` (see the module docstring); return
    otherwise, and where it cannot tell (no drop-in layer, no optimizer state loaded, no
    such checkpoint, a universal checkpoint). ``engine.load_checkpoint`` calls it before
    reading anything else; every rank reads the same files and decides alike, so all raise."""
    if load_module_only or not load_optimizer_states or engine.optimizer is None:
        return
    layers = [(name, m) for name, m in engine.module.named_modules() if isinstance(m, MoE)]
    if not layers or engine.load_universal_checkpoint():
        return
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return  # DeepSpeed warns and loads nothing
        with open(latest) as f:
            tag = f.read().strip()
    if engine.zero_optimization():
        problems, saved_ep = _zero_layout_mismatch(engine, load_dir, tag, layers)
        kept = (f"ZeRO stage {engine.zero_optimization_stage()} keeps optimizer states and fp32 master weights as "
                "flat partitions of the saved parameters, which would load into other experts' places")
    else:
        problems, saved_ep = _stage0_layout_mismatch(engine, load_dir, tag)
        kept = ("ZeRO stage 0 keeps optimizer states per expert-parallel rank, of that rank's experts at the saved "
                "ep_size, and each rank would load those of other experts")
    if problems:
        resume = f"resume at ep_size={saved_ep}" if saved_ep else "resume with the layer and ep_size that saved it"
        raise CheckpointLayoutError(
            f"engine.load_checkpoint({load_dir!r}, tag={tag!r}) with optimizer states refused, nothing loaded: "
            f"{'; '.join(problems)}. {kept}. Pass load_module_only=True to load the weights (at any ep_size) "
            f"with a fresh optimizer state, or {resume}")


def _zero_layout_mismatch(engine, load_dir: str, tag, layers: list[tuple[str, MoE]]
                          ) -> tuple[list[str], Optional[int]]:
    """ZeRO 1/2: the saved shape of each optimizer parameter (``param_shapes`` of the
    model-states file) against the drop-in's stacked experts ([num_local_experts, ...]);
    DeepSpeed's layer saved one parameter per local expert instead."""
    path = engine._get_ckpt_name(load_dir, tag)
    if not os.path.isfile(path):
        return [], None  # DeepSpeed reports it
    try:  # memory-mapped: only the metadata is read
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # not torch's zip format: read it as the engine does
        checkpoint = engine.checkpoint_engine.load(path, map_location="cpu")
    saved = {name: tuple(shape) for group in checkpoint.get("param_shapes") or [] for name, shape in group.items()}
    problems, saved_eps = [], set()
    for name, layer in layers:
        prefix = f"{name}." if name else ""
        if any(key.startswith(prefix + _DS_EXPERT_PREFIX) for key in saved):
            problems.append(f"layer {name!r} was saved by DeepSpeed's own MoE layer, whose optimizer holds one "
                            "parameter per local expert where the drop-in stacks them")
            continue
        for key, param in layer.named_parameters():
            shape = saved.get(prefix + key)
            if is_expert_param(param) and shape is not None and shape != tuple(param.shape):
                local = shape[0]
                saved_ep = layer.num_experts // local if local and layer.num_experts % local == 0 else None
                saved_eps.add(saved_ep)
                at = f"ep_size={saved_ep}" if saved_ep else "another ep_size"
                problems.append(f"layer {name!r} was saved at {at} ({local} of its {layer.num_experts} experts a "
                                f"rank) and runs at ep_size={layer.ep_size} here ({layer.num_local_experts} a rank)")
                break
    return problems, next(iter(saved_eps)) if len(saved_eps) == 1 else None


def _stage0_layout_mismatch(engine, load_dir: str, tag) -> tuple[list[str], Optional[int]]:
    """ZeRO 0: DeepSpeed writes one optimizer file per rank of the largest expert-parallel
    group (``expp_rank_R_mp_rank_00_optim_states.pt``) and each rank reads that of its own
    expert-parallel rank: their count is the saved largest ``ep_size``."""
    folder = os.path.join(load_dir, str(tag))
    pattern = re.compile(rf"expp_rank_(\d+)_mp_rank_{engine.checkpoint_mp_rank:02d}_optim_states\.pt")
    ranks = [int(m.group(1)) for f in (os.listdir(folder) if os.path.isdir(folder) else [])
             if (m := pattern.fullmatch(f))]
    ds_cls = _deepspeed_moe_class()
    current = max((m.ep_size for m in engine.module.modules() if isinstance(m, ds_cls)), default=1)
    if not ranks or max(ranks) + 1 == current:  # no such files (DeepSpeed reports it), or the same ep_size
        return [], None
    saved = max(ranks) + 1
    return [f"the checkpoint holds the optimizer states of {saved} expert-parallel ranks, saved at ep_size={saved} "
            f"(its largest), and this model runs at ep_size={current} (its largest)"], saved


def _check_engine_loads() -> None:
    """Make ``DeepSpeedEngine.load_checkpoint`` call :func:`check_checkpoint` first, once
    per process (engines without drop-in layers are unaffected)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    load = DeepSpeedEngine.load_checkpoint
    if getattr(load, "_ep_moe_checked", False):
        return
    signature = inspect.signature(load)

    @functools.wraps(load)
    def load_checkpoint(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arg = bound.arguments
        check_checkpoint(self, arg["load_dir"], arg["tag"], load_optimizer_states=arg["load_optimizer_states"],
                         load_module_only=arg["load_module_only"])
        return load(self, *args, **kwargs)

    load_checkpoint._ep_moe_checked = True
    DeepSpeedEngine.load_checkpoint = load_checkpoint


def replace_deepspeed_moe(model: nn.Module, *, backend: str = "auto", dispatch: str = "auto",
                          expert_precision: str = "bf16") -> int:
    """Swap every ``deepspeed.moe.layer.MoE`` inside ``model`` for :class:`MoE` in place,
    with the same arguments and weights (:meth:`MoE.from_deepspeed`, ``backend``,
    ``dispatch`` and ``expert_precision`` as :class:`ep_moe.MoEConfig`'s); returns how many
    were swapped. Call on every rank, in the same order (EP groups are built collectively)."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    if isinstance(model, MoE):
        return 0
    if isinstance(model, DeepSpeedMoE):
        raise ValueError("model is itself a deepspeed MoE layer and cannot be swapped in place; use "
                         "MoE.from_deepspeed(model) or pass the module that holds it")
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, DeepSpeedMoE) and not isinstance(m, MoE)]  # ours are DeepSpeedMoE too
    for name, ds_moe in found:
        parent_name, _, attr = name.rpartition(".")
        ours = MoE.from_deepspeed(ds_moe, backend=backend, dispatch=dispatch, expert_precision=expert_precision)
        if ds_moe.use_residual:
            ours.mlp = ds_moe.mlp  # the model's own module: layers that shared a residual MLP still do
        setattr(model.get_submodule(parent_name), attr, ours)
    return len(found)


__all__ = ["CheckpointLayoutError", "ExpertLayout", "MoE", "UnreadableExpertError", "check_checkpoint",
           "deepspeed_moe_config", "infer_expert_layout", "replace_deepspeed_moe"]
