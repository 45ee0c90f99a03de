"""ep_moe.integrations.deepspeed: DeepSpeed's arguments and return convention, expert
layouts, and replace_deepspeed_moe against DeepSpeed 0.19.8's own MoE layer (float32, CPU
accelerator, gloo at EP=2, one step of the DeepSpeed engine at ep_size 1). The engine at
ep_size > 1, its ZeRO stages, bf16 and checkpoints are in ``tests/test_deepspeed_engine.py``.

The DeepSpeed tests skip when deepspeed is not installed; install it with
``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``.
"""

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_distributed
from ep_moe import MoEConfig
from ep_moe.integrations.deepspeed import MoE, deepspeed_moe_config, infer_expert_layout, replace_deepspeed_moe

H, I, E = 16, 12, 4
DROPLESS = dict(drop_tokens=False, top2_2nd_expert_sampling=False)


class SwiGLUExpert(nn.Module):
    """Hugging Face naming: gate_proj, up_proj, down_proj."""

    def __init__(self, hidden=H, inter=I):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    """Mixtral naming: w1 gate, w3 up, w2 down."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FusedSwiGLUExpert(nn.Module):
    """One H -> 2I Linear holding [gate; up]."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(H, 2 * I, bias=False)
        self.out = nn.Linear(I, H, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.out(F.silu(gate) * up)


def mlp_expert(act: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(H, I, bias=False), act, nn.Linear(I, H, bias=False))


def _init_(module: nn.Module, seed: int, std: float = 0.3) -> nn.Module:
    """Weights large enough that routing and experts matter (DeepSpeed's experts are copies)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module


# ---------------------------------------------------------------------------------------
# Without DeepSpeed.


def test_imports_and_runs_without_deepspeed():
    code = ("import sys; sys.modules['deepspeed'] = None  # import deepspeed fails\n"
            "import torch\n"
            "from ep_moe.integrations.deepspeed import MoE\n"
            "moe = MoE(8, None, 4, k=2, drop_tokens=False, top2_2nd_expert_sampling=False,\n"
            "          intermediate_size=8, activation='swiglu')\n"
            "out, l_aux, counts = moe(torch.randn(3, 8))\n"
            "assert out.shape == (3, 8) and counts.sum() == 6\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def test_returns_deepspeed_convention():
    torch.manual_seed(0)
    moe = MoE(H, SwiGLUExpert(), num_experts=E, k=2, **DROPLESS)
    x = torch.randn(2, 5, H, requires_grad=True)
    out, l_aux, exp_counts = moe(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert l_aux.shape == () and l_aux.dtype == torch.float32 and l_aux.requires_grad
    assert exp_counts.shape == (E,) and exp_counts.dtype == torch.int64 and int(exp_counts.sum()) == 2 * 10
    (out.sum() + l_aux).backward()
    assert moe.layer.router.weight.grad is not None and x.grad.shape == x.shape
    assert (moe.num_experts, moe.ep_size, moe.num_local_experts) == (E, 1, E)


def test_config_mapping():
    cfg = deepspeed_moe_config(H, I, "swiglu", num_experts=E, k=1)
    assert cfg == MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=1, norm_topk_prob=False,
                            aux_loss_coef=1.0, z_loss_coef=0.0, ep_size=1)
    assert deepspeed_moe_config(H, I, "gelu", num_experts=E, k=3).norm_topk_prob
    assert deepspeed_moe_config(H, I, "swiglu", num_experts=E, k=2).norm_topk_prob


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(drop_tokens=False, num_experts=6, ep_size=4), r"num_experts=6 is not divisible by ep_size=4"),
    (dict(drop_tokens=False, ep_size=2), r"ep_size=2 needs torch.distributed"),
])
def test_unsupported_arguments_raise(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MoE(H, SwiGLUExpert(), **{"num_experts": E, **kwargs})


def test_forward_and_engine_errors(monkeypatch):
    moe = MoE(H, SwiGLUExpert(), num_experts=E, k=1, drop_tokens=False)
    with pytest.raises(ValueError, match=r"used_token has 2 elements \(shape \(2,\)\) but the input has 3 tokens"):
        moe(torch.randn(3, H), torch.ones(2))
    # a layer the engine cannot see as an MoE layer (built before ``import deepspeed``)
    monkeypatch.setattr("ep_moe.integrations.deepspeed._deepspeed_moe_class", lambda: None)
    moe.set_deepspeed_parallelism()  # ep_size=1: the engine's all-reduce over all ranks is right
    moe.ep_size = 2
    with pytest.raises(ValueError, match=r"ep_size=2 was built before deepspeed was imported.*import deepspeed "
                                         r"before building the model"):
        moe.set_deepspeed_parallelism()


@pytest.mark.parametrize("make,expected", [
    (SwiGLUExpert, ("swiglu", I, "up_proj", "down_proj", "gate_proj")),
    (MixtralExpert, ("swiglu", I, "w3", "w2", "w1")),
    (FusedSwiGLUExpert, ("swiglu", I, "gate_up", "out", None)),
    (lambda: mlp_expert(nn.GELU()), ("gelu", I, "0", "2", None)),
    (lambda: mlp_expert(nn.ReLU()), ("relu", I, "0", "2", None)),
], ids=["hf", "mixtral", "fused", "gelu", "relu"])
def test_expert_layout_inference(make, expected):
    expert = _init_(make(), 0)
    layout = infer_expert_layout(expert, H)
    assert (layout.activation, layout.intermediate_size, layout.up, layout.down, layout.gate) == expected
    # the expert's weights under DeepSpeed's MoE keys load (strictly) into weights that compute
    # the expert, and the layer's state dict gives them back under the same keys
    moe = MoE(H, expert, num_experts=1, k=1, drop_tokens=False)
    deepspeed_keys = {"deepspeed_moe.gate.wg.weight": torch.zeros(1, H),
                      **{f"deepspeed_moe.experts.deepspeed_experts.0.{k}": v for k, v in expert.state_dict().items()}}
    moe.load_state_dict(deepspeed_keys)
    x = torch.randn(7, H)
    torch.testing.assert_close(moe(x)[0], expert(x))
    saved = moe.state_dict()
    assert saved.keys() == deepspeed_keys.keys()
    for key, value in deepspeed_keys.items():
        torch.testing.assert_close(saved[key], value, atol=0, rtol=0)


def test_deepspeed_keys_load_only_what_the_layout_names():
    """Keys of DeepSpeed's MoE that the expert layout does not name (a bias) stay and a strict
    load reports them; a gate without its up loads nothing of gate_up, but the down loads."""
    moe = MoE(H, SwiGLUExpert(), num_experts=2, k=1, drop_tokens=False)
    full = moe.state_dict()
    with_bias = {**full, "deepspeed_moe.experts.deepspeed_experts.0.down_proj.bias": torch.zeros(H)}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\).*"deepspeed_moe.experts.deepspeed_experts.0.'
                                           r'down_proj.bias"'):
        moe.load_state_dict(with_bias)
    partial = {k: torch.full_like(v, 7.0) for k, v in full.items() if not k.endswith("1.up_proj.weight")}
    result = moe.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["layer.experts.gate_up.1"]
    assert result.unexpected_keys == ["deepspeed_moe.experts.deepspeed_experts.1.gate_proj.weight"]
    assert torch.all(moe.layer.experts.down == 7.0) and torch.all(moe.layer.experts.gate_up[0] == 7.0)
    assert not torch.any(moe.layer.experts.gate_up[1] == 7.0)


@pytest.mark.parametrize("expert,kwargs,pattern", [
    (SwiGLUExpert(), dict(activation="gelu"), r"gated expert \(swiglu\) but activation='gelu'"),
    (mlp_expert(nn.ReLU()), dict(activation="gelu"), r"has an activation 'relu' but activation='gelu'; drop "
                                                     r"activation="),
    (SwiGLUExpert(), dict(intermediate_size=8), r"intermediate_size=8 but the expert module's is 12"),
    (SwiGLUExpert(hidden=8), {}, r"do not fit hidden_size=16"),
    (None, dict(activation="gelu"), r"expert=None: pass intermediate_size= and activation="),
])
def test_expert_layout_errors(expert, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MoE(H, expert, num_experts=E, k=1, drop_tokens=False, **kwargs)


def test_explicit_shape_when_expert_is_unreadable():
    moe = MoE(H, nn.Linear(H, H, bias=False), num_experts=E, k=1, drop_tokens=False, intermediate_size=I,
              activation="relu")
    assert moe.expert_layout is None and moe.layer.config.activation == "relu"
    assert moe(torch.randn(3, H))[0].shape == (3, H)


# ---------------------------------------------------------------------------------------
# Against DeepSpeed's own layer.


class TwoMoEModel(nn.Module):
    """Linear -> DeepSpeed MoE (SwiGLU experts) -> DeepSpeed MoE (GELU experts) -> Linear."""

    def __init__(self, ds_moe_cls, k: int, ep_size: int = 1, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(H, H)
        self.moes = nn.ModuleList([
            ds_moe_cls(H, SwiGLUExpert(), num_experts=E, ep_size=ep_size, k=k, **DROPLESS),
            ds_moe_cls(H, mlp_expert(nn.GELU()), num_experts=E, ep_size=ep_size, k=k, **DROPLESS),
        ])
        self.out = nn.Linear(H, H)
        _init_(self, seed)

    def forward(self, x):
        h = self.inp(x)
        l_aux, counts = [], []
        for moe in self.moes:
            y, aux, count = moe(h)
            h = h + y
            l_aux.append(aux)
            counts.append(count)
        return self.out(h), torch.stack(l_aux), torch.stack(counts)


def _run(model, x, aux_weight=0.1):
    """Forward and backward of ``mean(y^2) + aux_weight * sum(l_aux)``; outputs, the input
    gradient and the gradients of the dense layers around the MoE layers."""
    x = x.clone().requires_grad_()
    y, l_aux, counts = model(x)
    (y.square().mean() + aux_weight * l_aux.sum()).backward()
    return dict(y=y.detach(), l_aux=l_aux.detach(), counts=counts, dx=x.grad,
                inp=model.inp.weight.grad, out=model.out.weight.grad)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_replace_matches_deepspeed(deepspeed, k):
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    ds_model = TwoMoEModel(DeepSpeedMoE, k)
    ours = TwoMoEModel(DeepSpeedMoE, k)
    assert replace_deepspeed_moe(ours) == 2
    assert all(isinstance(m, MoE) for m in ours.moes)
    assert ours.moes[1].layer.config.activation == "gelu"
    x = torch.randn(3, 10, H)
    ref, got = _run(ds_model, x), _run(ours, x)
    assert torch.equal(got["counts"], ref["counts"])
    for key in ("y", "dx", "inp", "out"):
        torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["l_aux"], ref["l_aux"], atol=1e-6, rtol=1e-6)
    for ds_moe, our_moe in zip(ds_model.moes, ours.moes):
        torch.testing.assert_close(our_moe.layer.router.weight.grad, ds_moe.deepspeed_moe.gate.wg.weight.grad,
                                   atol=1e-5, rtol=1e-5)
        for j, expert in enumerate(ds_moe.deepspeed_moe.experts.deepspeed_experts):
            grads = _expert_grads(our_moe.expert_layout, expert)
            torch.testing.assert_close(our_moe.layer.experts.gate_up.grad[j], grads["gate_up"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(our_moe.layer.experts.down.grad[j], grads["down"], atol=1e-5, rtol=1e-5)


def _expert_grads(layout, expert: nn.Module) -> dict[str, torch.Tensor]:
    """A DeepSpeed expert's gradients in ep_moe's layout (zeros for an expert no row reached)."""
    return layout.from_state({name: torch.zeros_like(p) if p.grad is None else p.grad
                              for name, p in expert.named_parameters()})


def test_replace_rejects_a_bare_layer(deepspeed):
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    layer = DeepSpeedMoE(H, SwiGLUExpert(), num_experts=E, k=1, drop_tokens=False)
    with pytest.raises(ValueError, match=r"model is itself a deepspeed MoE layer.*MoE.from_deepspeed"):
        replace_deepspeed_moe(layer)


def _init_deepspeed():
    """deepspeed.init_distributed over the gloo group of run_distributed."""
    import deepspeed

    # DeepSpeed's CPU backend compiles a shared-memory all-reduce op on init (about a
    # minute); gloo does the same job for these tests. (The attribute deepspeed.comm.torch
    # is the torch package, so reach the module through importlib.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _ep2_worker(rank, world_size):
    """EP=2 on gloo: DeepSpeed's layer against the replaced one on each rank's tokens; then
    the DeepSpeed engine trains an ep_size=1 replacement."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    deepspeed = _init_deepspeed()
    out = {}
    ds_model = TwoMoEModel(DeepSpeedMoE, k=2, ep_size=2)
    for moe in ds_model.moes:  # each rank's local experts differ; routers stay replicated
        _init_(moe.deepspeed_moe.experts, seed=10 + rank)
    ours = TwoMoEModel(DeepSpeedMoE, k=2, ep_size=2)
    ours.load_state_dict(ds_model.state_dict())
    for moe in ds_model.moes:
        moe.set_deepspeed_parallelism()
    for moe in ours.moes:
        moe.set_deepspeed_parallelism()  # replacement checks DeepSpeed's group against ours
    out["replaced"] = replace_deepspeed_moe(ours)
    x = torch.randn(4, 5, H, generator=torch.Generator().manual_seed(rank))
    out["ds"], out["ours"] = _run(ds_model, x, aux_weight=0.0), _run(ours, x, aux_weight=0.0)

    model = TwoMoEModel(DeepSpeedMoE, k=1)
    replace_deepspeed_moe(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={"train_micro_batch_size_per_gpu": 1})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    y, l_aux, _ = engine(torch.randn(6, H, generator=torch.Generator().manual_seed(rank)))
    engine.backward(y.square().mean() + 0.01 * l_aux.sum())
    engine.step()
    out["before"], out["after"] = before, model.state_dict()
    return out


@pytest.mark.distributed
def test_replace_at_ep2_and_engine(deepspeed):
    results = run_distributed(_ep2_worker, 2, timeout_s=120)
    for res in results:
        assert res["replaced"] == 2
        assert torch.equal(res["ours"]["counts"], res["ds"]["counts"])
        for key in ("y", "dx", "inp", "out"):
            torch.testing.assert_close(res["ours"][key], res["ds"][key], atol=1e-5, rtol=1e-5)
    # ep_size=1 under the engine: gradients all-reduced, so both ranks take the same step
    after = [res["after"] for res in results]
    for key, value in after[0].items():
        torch.testing.assert_close(after[1][key], value)
    changed = [k for k in after[0] if not torch.equal(after[0][k], results[0]["before"][k])]
    assert "moes.0.deepspeed_moe.experts.deepspeed_experts.0.gate_proj.weight" in changed
    assert "moes.0.deepspeed_moe.gate.wg.weight" in changed
