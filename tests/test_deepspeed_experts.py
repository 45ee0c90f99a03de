"""The DeepSpeed drop-in's expert forms against DeepSpeed 0.19.8's own MoE layer, given the
same weights: one Linear (the PR-MoE examples), two Linears with no activation and
PyTorch's default bias (DeepSpeed's own tests, one expert module shared by two layers), an
MLP of each activation (Megatron-DeepSpeed's GPT experts: GELU with biases), gated experts
(SwiGLU, GeGLU, separate or stacked gate and up, with and without biases), and any other
module, run as is on the slow path (normalisation, a Megatron-style ``(output, bias)``
pair, a buffer, a functional activation). For each: the layout read from the module, the
output, ``l_aux``, ``exp_counts`` and every gradient (input, router, each expert tensor),
at world 1 on the torch path and on the Triton kernels (interpreter on the CPU), and at
gloo EP=2; DeepSpeed's state-dict keys both ways; experts starting as copies of the
module, as DeepSpeed's; and MoELayer's EP dispatches (all-to-all, all-gather with its row
bound) with biases, one Linear and module experts against EP=1.

Skips without deepspeed (``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``).
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_distributed
from ep_moe import MoEConfig, MoELayer
from ep_moe.experts import GroupedExperts, ModuleExperts
from ep_moe.integrations.deepspeed import MoE, UnreadableExpertError, infer_expert_layout, replace_deepspeed_moe

H, I, E = 16, 12, 4
DROPLESS = dict(drop_tokens=False, top2_2nd_expert_sampling=False)


class GatedExpert(nn.Module):
    """Hugging Face naming (gate_proj, up_proj, down_proj), the gate's activation a module."""

    def __init__(self, act: nn.Module, bias: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FusedGeGLU(nn.Module):
    """One Linear H -> 2I holding [gate; up], GELU, down; biases."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Linear(H, 2 * I)
        self.act = nn.GELU()
        self.w_out = nn.Linear(I, H)

    def forward(self, x):
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(self.act(gate) * up)


class ReLUMLP(nn.Module):
    """Two Linears and an nn.ReLU, not a Sequential."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(H, I), nn.ReLU(), nn.Linear(I, H)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class MegatronStyle(nn.Module):
    """What the grouped GEMMs cannot run: a LayerNorm, tanh, a scale buffer, and an
    ``(output, bias)`` pair as Megatron's MLP returns (DeepSpeed keeps the output)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc = nn.Linear(H, H)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x):
        return self.fc(torch.tanh(self.norm(x))) * self.scale, self.fc.bias


class FunctionalGELU(nn.Module):
    """Two Linears, the activation a function: its forward cannot be read, so it runs as is."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


# form -> (expert module, the layout's (activation, num_linears, bias), or None: run as is)
FORMS = {
    "linear": (lambda: nn.Linear(H, H), ("identity", 1, True)),
    "two_linears": (lambda: nn.Sequential(nn.Linear(H, H), nn.Linear(H, H)), ("identity", 2, True)),
    "gelu_mlp": (lambda: nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H)), ("gelu", 2, True)),
    "gelu_tanh_mlp": (lambda: nn.Sequential(nn.Linear(H, I), nn.GELU(approximate="tanh"), nn.Dropout(0.0),
                                            nn.Linear(I, H)), ("gelu_tanh", 2, True)),
    "silu_mlp": (lambda: nn.Sequential(nn.Linear(H, I, bias=False), nn.SiLU(), nn.Linear(I, H, bias=False)),
                 ("silu", 2, False)),
    "relu_mlp": (ReLUMLP, ("relu", 2, True)),
    "swiglu": (lambda: GatedExpert(nn.SiLU()), ("swiglu", 2, True)),
    "geglu": (lambda: GatedExpert(nn.GELU(), bias=False), ("geglu", 2, False)),
    "fused_geglu": (FusedGeGLU, ("geglu", 2, True)),
    "module": (MegatronStyle, None),
    "functional": (FunctionalGELU, None),
}


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter N(0, 0.3^2) (biases too: they must matter), from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _build(make, ds_moe_cls, seed: int, backend: str = "auto", **kwargs):
    """A DeepSpeed MoE of the expert ``make()`` with random weights (each expert its own),
    and the drop-in from it (replace_deepspeed_moe, which reads the expert module)."""
    torch.manual_seed(seed)
    ds = _randomize(ds_moe_cls(H, make(), num_experts=E, **kwargs), seed)
    holder = nn.Module()
    holder.moe = _randomize(ds_moe_cls(H, make(), num_experts=E, **kwargs), seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow path's warning (tested below)
        assert replace_deepspeed_moe(holder, backend=backend) == 1
    return ds, holder.moe


def _step(moe, x, aux_weight=0.1):
    """Forward and backward of ``mean(y^2) + aux_weight * l_aux``: what to compare."""
    x = x.clone().requires_grad_()
    y, l_aux, counts = moe(x)
    (y.square().mean() + aux_weight * l_aux).backward()
    return dict(y=y.detach(), l_aux=l_aux.detach(), counts=counts, dx=x.grad)


def _expert_grads(moe: MoE) -> dict[str, torch.Tensor]:
    """The drop-in's expert gradients, [e, ...] per ep_moe name."""
    experts = moe.layer.experts
    return {name: experts.tensor(name).grad for name in experts.tensor_names()}


def _deepspeed_expert_grads(ds_moe, moe: MoE) -> dict[str, torch.Tensor]:
    """A DeepSpeed MoE's expert gradients in the drop-in ``moe``'s names (zeros for an
    expert no row reached)."""
    per_expert = []
    for expert in ds_moe.deepspeed_moe.experts.deepspeed_experts:
        grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in expert.named_parameters()}
        per_expert.append(moe._state_layout.from_state({**expert.state_dict(), **grads}))  # buffers: no gradient
    return {name: torch.stack([g[name] for g in per_expert]) for name in moe.layer.experts.tensor_names()}


def _assert_same_step(ours: MoE, ds, got: dict, want: dict) -> None:
    assert torch.equal(got["counts"], want["counts"])
    for key in ("y", "dx", "l_aux"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(ours.layer.router.weight.grad, ds.deepspeed_moe.gate.wg.weight.grad,
                               atol=1e-5, rtol=1e-5)
    want_grads = _deepspeed_expert_grads(ds, ours)
    got_grads = _expert_grads(ours)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        assert grad is not None, name
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------
# World 1.


@pytest.mark.parametrize("form", list(FORMS))
def test_layout_of_each_form(form):
    make, expected = FORMS[form]
    if expected is None:
        with pytest.raises(UnreadableExpertError, match=r"cannot read expert .*runs it as is"):
            infer_expert_layout(make(), H)
        return
    layout = infer_expert_layout(make(), H)
    assert (layout.activation, layout.num_linears, layout.bias) == expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("form", list(FORMS))
def test_matches_deepspeed(deepspeed, form, backend):
    """k=2, dropless: output, l_aux, counts, the input, router and expert gradients."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    make, expected = FORMS[form]
    ds, ours = _build(make, DeepSpeedMoE, seed=1, backend=backend, k=2, **DROPLESS)
    assert isinstance(ours.layer.experts, GroupedExperts if expected else ModuleExperts)
    if expected:
        config = ours.layer.config
        assert (config.activation, config.num_linears, config.mlp_bias) == expected
    x = torch.randn(3, 7, H)
    _assert_same_step(ours, ds, _step(ours, x), _step(ds, x))


@pytest.mark.parametrize("form", ["linear", "two_linears", "fused_geglu", "module"])
def test_state_dict_round_trips_deepspeed_keys(deepspeed, form):
    """The drop-in's state dict has DeepSpeed's keys and values, loads strictly into
    DeepSpeed's layer and into a fresh drop-in; ep_moe's own keys (per global expert id)
    round-trip through the layer."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    make, _ = FORMS[form]
    ds, ours = _build(make, DeepSpeedMoE, seed=2, k=1, **DROPLESS)
    saved = ours.state_dict()
    assert saved.keys() == ds.state_dict().keys()
    for key, value in ds.state_dict().items():
        torch.testing.assert_close(saved[key], value, atol=0, rtol=0)
    fresh_ds = DeepSpeedMoE(H, make(), num_experts=E, k=1, **DROPLESS)
    fresh_ds.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = MoE(H, make(), num_experts=E, k=1, **DROPLESS)
    fresh.load_state_dict(saved)
    x = torch.randn(9, H)
    torch.testing.assert_close(fresh(x)[0], ds(x)[0])
    torch.testing.assert_close(fresh_ds(x)[0], ds(x)[0])
    layer_state = ours.layer.state_dict()
    assert {k for k in layer_state if k.startswith("experts.")} == {
        f"experts.{name}.{g}" for name in ours._state_layout.state_keys for g in range(E)}
    fresh.layer.load_state_dict(layer_state)
    torch.testing.assert_close(fresh(x)[0], ds(x)[0])


@pytest.mark.parametrize("form", ["linear", "gelu_mlp", "swiglu", "module"])
def test_experts_start_as_copies_of_the_module(deepspeed, form):
    """As DeepSpeed's Experts deep-copies its expert, every local expert of the drop-in
    starts as the module (the module itself is left as it was): the same layer as
    DeepSpeed's built from that module, once the router is copied."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    make, _ = FORMS[form]
    expert = _randomize(make(), seed=3)
    before = {k: v.clone() for k, v in expert.state_dict().items()}
    ds = DeepSpeedMoE(H, expert, num_experts=E, k=2, **DROPLESS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = MoE(H, expert, num_experts=E, k=2, **DROPLESS)
    with torch.no_grad():
        ours.layer.router.weight.copy_(ds.deepspeed_moe.gate.wg.weight)
    x = torch.randn(11, H)
    torch.testing.assert_close(ours(x)[0], ds(x)[0], atol=1e-6, rtol=1e-5)
    for key, value in expert.state_dict().items():
        assert torch.equal(value, before[key])


def test_deepspeeds_unit_test_model(deepspeed):
    """DeepSpeed's own MoE tests: ONE ``Sequential(Linear(H, H), Linear(H, H))`` expert (with
    PyTorch's default bias) passed to two MoE layers, k=1 and DeepSpeed's default gating
    (drop_tokens, use_rts), dense layers between. The drop-in's layers hold their own
    copies (one layer's step leaves the other's and the module alone) and compute
    DeepSpeed's model."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class SimpleMoEModel(nn.Module):
        def __init__(self, moe_cls):
            super().__init__()
            torch.manual_seed(4)
            self.linear1 = nn.Linear(H, H)
            expert = nn.Sequential(nn.Linear(H, H), nn.Linear(H, H))
            self.moe_1 = moe_cls(hidden_size=H, expert=expert, num_experts=E, k=1)
            self.linear2 = nn.Linear(H, H)
            self.moe_2 = moe_cls(hidden_size=H, expert=expert, num_experts=E, k=1)
            self.expert = expert

        def forward(self, x):
            h = self.linear1(x)
            h, l1, _ = self.moe_1(h)
            h, l2, _ = self.moe_2(self.linear2(h))
            return h, l1 + l2

    reference, ours = SimpleMoEModel(DeepSpeedMoE), SimpleMoEModel(MoE)
    ours.load_state_dict(reference.state_dict())
    module_before = {k: v.clone() for k, v in ours.expert.state_dict().items()}
    x = torch.randn(2, 8, H)
    results = []
    for model in (reference, ours):
        torch.manual_seed(5)  # the gate's random token selection (use_rts) draws the same
        xx = x.clone().requires_grad_()
        y, l_aux = model(xx)
        (y.square().mean() + 0.01 * l_aux).backward()
        results.append((y.detach(), xx.grad, model.linear1.weight.grad))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for moe_ds, moe_ours in ((reference.moe_1, ours.moe_1), (reference.moe_2, ours.moe_2)):
        want = _deepspeed_expert_grads(moe_ds, moe_ours)
        for name, grad in _expert_grads(moe_ours).items():
            torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ours.moe_1.layer.experts.down.add_(1.0)
    assert not torch.equal(ours.moe_1.layer.experts.down, ours.moe_2.layer.experts.down)
    for key, value in ours.expert.state_dict().items():
        assert torch.equal(value, module_before[key])


def test_module_experts_warn_once_and_keep_deepspeeds_keys():
    """The slow path warns once per module type; the module's buffers are per expert and
    under DeepSpeed's keys, the module itself untouched."""
    class OncePerTypeExpert(MegatronStyle):
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = MoE(H, OncePerTypeExpert(), num_experts=E, k=1, **DROPLESS)
        MoE(H, OncePerTypeExpert(), num_experts=E, k=1, **DROPLESS)
    slow = [w for w in caught if "slow path" in str(w.message)]
    assert len(slow) == 1 and "OncePerTypeExpert as is" in str(slow[0].message)
    assert f"deepspeed_moe.experts.deepspeed_experts.{E - 1}.scale" in first.state_dict()
    assert first.layer.experts.tensor("scale").shape == (E,)


def test_experts_forms_errors():
    """Forms that contradict the arguments name the fix; an expert of a hidden size other
    than the layer's is refused, not run as is."""
    cases = [
        (nn.Linear(H, H), dict(activation="relu"), r"is one Linear \(no activation\) but activation='relu'"),
        (nn.Linear(H, 8), {}, r"one Linear of shape \[8, 16\], not an expert of hidden_size=16"),
        (GatedExpert(nn.SiLU()), dict(activation="geglu"), r"gated expert \(swiglu\) but activation='geglu'"),
        (FORMS["gelu_mlp"][0](), dict(activation="swiglu"), r"activation 'gelu' but activation='swiglu'"),
        (nn.Sequential(nn.Linear(H, 2 * I), nn.SiLU(), nn.Linear(I, H)), {}, r"not an MLP of hidden_size=16"),
    ]
    for expert, kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            MoE(H, expert, num_experts=E, k=1, **DROPLESS, **kwargs)
    with pytest.raises(UnreadableExpertError, match=r"some of its Linears have a bias and some do not"):
        infer_expert_layout(nn.Sequential(nn.Linear(H, I), nn.ReLU(), nn.Linear(I, H, bias=False)), H)
    with pytest.raises(ValueError, match=r"num_linears=1 .* activation='gelu'; pass activation='identity'"):
        MoEConfig(hidden_size=H, intermediate_size=H, num_experts=E, top_k=1, num_linears=1, activation="gelu")
    with pytest.raises(ValueError, match=r"intermediate_size=12 != hidden_size=16; pass intermediate_size=16"):
        MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=1, num_linears=1, activation="identity")
    with pytest.raises(ValueError, match=r"num_linears=3: use 2 .* or 1"):
        MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=1, num_linears=3)
    config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=1, dispatch="all_gather_copy_engine")
    with pytest.raises(ValueError, match=r"ModuleExperts.*use dispatch='all_gather' or 'all_to_all'"):
        MoELayer(config, expert_module=MegatronStyle())
    with pytest.raises(ValueError, match=r"expert module GELU has no floating-point parameters"):
        MoE(H, nn.GELU(), num_experts=E, k=1, **DROPLESS)


# ---------------------------------------------------------------------------------------
# gloo EP=2.


def _init_deepspeed():
    """deepspeed.init_distributed over the gloo group of run_distributed (no shared-memory
    op build: gloo does its job here)."""
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def _ep2_deepspeed_worker(rank, world_size):
    """Every form at ep_size=2 (DeepSpeed's groups, gloo all-to-all) on Triton kernels:
    DeepSpeed's layer and the drop-in on this rank's tokens."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    _init_deepspeed()
    out = {}
    for form in FORMS:
        make, _ = FORMS[form]
        torch.manual_seed(6)
        ds = DeepSpeedMoE(H, make(), num_experts=E, ep_size=2, k=2, **DROPLESS)
        _randomize(ds, seed=6)
        _randomize(ds.deepspeed_moe.experts, seed=60 + rank)  # each rank's experts differ
        ds.set_deepspeed_parallelism()
        holder = nn.Module()
        holder.moe = DeepSpeedMoE(H, make(), num_experts=E, ep_size=2, k=2, **DROPLESS)
        holder.moe.load_state_dict(ds.state_dict())
        holder.moe.set_deepspeed_parallelism()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            replace_deepspeed_moe(holder, backend="triton")
        ours = holder.moe
        x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(rank))
        want, got = _step(ds, x), _step(ours, x)
        out[form] = dict(got=got, want=want, grads=_expert_grads(ours),
                         want_grads=_deepspeed_expert_grads(ds, ours),
                         router=(ours.layer.router.weight.grad, ds.deepspeed_moe.gate.wg.weight.grad))
    return out


@pytest.mark.distributed
def test_matches_deepspeed_at_ep2(deepspeed):
    for rank, res in enumerate(run_distributed(_ep2_deepspeed_worker, 2, timeout_s=120)):
        for form, r in res.items():
            assert torch.equal(r["got"]["counts"], r["want"]["counts"]), form
            for key in ("y", "dx", "l_aux"):
                torch.testing.assert_close(r["got"][key], r["want"][key], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"rank {rank} {form} {key}: {m}")
            torch.testing.assert_close(*r["router"], atol=1e-5, rtol=1e-5)
            assert r["grads"].keys() == r["want_grads"].keys()
            for name, grad in r["grads"].items():
                torch.testing.assert_close(grad, r["want_grads"][name], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"rank {rank} {form} {name}: {m}")


# MoELayer configurations at EP=2 against EP=1: biases (a gated activation), one Linear,
# module experts; on each dispatch
EP2_LAYERS = {
    "geglu_bias": dict(config=dict(activation="geglu", mlp_bias=True)),
    "one_linear": dict(config=dict(activation="identity", num_linears=1, intermediate_size=H, mlp_bias=True)),
    "module": dict(config=dict(), expert_module=MegatronStyle),
}


def _layer(name: str, dispatch: str, group, seed: int = 7) -> MoELayer:
    """One EP2_LAYERS layer on the Triton kernels; every global expert's tensors drawn from
    a generator of its id, so the layer is the same at any EP size."""
    spec = EP2_LAYERS[name]
    config = MoEConfig(**{**dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, backend="triton",
                                 dispatch=dispatch), **spec["config"]})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = MoELayer(config, group, expert_module=spec.get("expert_module", lambda: None)())
    experts = layer.experts
    with torch.no_grad():
        for i, name in enumerate(experts.tensor_names()):
            for j, g in enumerate(experts.global_ids()):
                gen = torch.Generator().manual_seed(1000 * g + i)
                experts.tensor(name)[j].copy_(torch.randn(experts.tensor(name)[j].shape, generator=gen) * 0.3)
    return layer


def _layer_step(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    return y.detach(), x.grad


def _ep2_layer_worker(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    xs = [torch.randn(6, H, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    out = {}
    for name in EP2_LAYERS:
        reference = _layer(name, "auto", None)
        ref_y, ref_dx = _layer_step(reference, xs[rank])
        _layer_step(reference, xs[1 - rank])  # expert gradients of both ranks' tokens
        ref_experts = reference.experts
        for dispatch in ("all_to_all", "all_gather"):
            layer = _layer(name, dispatch, group)
            y, dx = _layer_step(layer, xs[rank])
            local = slice(layer.experts.first_expert, layer.experts.first_expert + layer.experts.num_local_experts)
            out[(name, dispatch)] = dict(
                y=(y, ref_y), dx=(dx, ref_dx),
                experts={n: (layer.experts.tensor(n).grad, ref_experts.tensor(n).grad[local])
                         for n in layer.experts.tensor_names()})
    return out


@pytest.mark.distributed
def test_layer_forms_at_ep2_match_ep1():
    """MoELayer with biases, one Linear and module experts, at EP=2 on the all-to-all and
    on the all-gather (rows in a bound, the expert GEMMs computing only the counted ones),
    on Triton kernels: outputs and input gradients equal EP=1's on the same tokens; each
    rank's expert gradients equal EP=1's over both ranks' tokens."""
    for rank, res in enumerate(run_distributed(_ep2_layer_worker, 2, timeout_s=120)):
        for (name, dispatch), r in res.items():
            for key in ("y", "dx"):
                torch.testing.assert_close(*r[key], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {dispatch} {key}")
            for tensor, (got, want) in r["experts"].items():
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"rank {rank} {name} {dispatch} {tensor}: {m}")
