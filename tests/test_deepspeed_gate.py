"""DeepSpeed's gating in the drop-in (ep_moe.integrations.deepspeed_gate), Residual MoE and
pyramid MoE against DeepSpeed 0.19.8's own TopKGate and MoE layer: same weights, inputs and
seed -> the same routes, combine weights, dropped tokens, output, l_aux, exp_counts,
gradients and RNG state afterwards (float32, CPU accelerator, gloo at EP=2).

The argument combinations are those of DeepSpeed's MoE docs and tutorials (its defaults:
k=1, drop_tokens with random token selection; CIFAR-10's RSample noise; PR-MoE's residual
and pyramid layers) and of Megatron-DeepSpeed's GPT MoE (k=1 or 2, train/eval capacity
factors, min_capacity, token dropping on or off, top-2 second-expert sampling). Every
random draw is DeepSpeed's, drawn in its order, so sampling matches by seed, exactly.

The DeepSpeed tests skip when deepspeed is not installed; install it with
``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``.
"""

import importlib
import types

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from ep_moe.integrations.deepspeed import MoE, replace_deepspeed_moe
from ep_moe.integrations.deepspeed_gate import DeepSpeedGate, capacity

H, I, E = 8, 6, 4

# id -> DeepSpeed MoE arguments (besides num_experts=E); capacities small enough to drop
CASES = {
    "k1-defaults": dict(),
    "k1-no-rts": dict(use_rts=False),
    "k1-capacity": dict(capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=1),
    "k1-min-capacity": dict(capacity_factor=0.25, min_capacity=5),
    "k1-dropless": dict(drop_tokens=False),
    "k1-rsample": dict(noisy_gate_policy="RSample", min_capacity=1),
    "k1-jitter": dict(noisy_gate_policy="Jitter", use_rts=False, capacity_factor=0.75, min_capacity=1),
    "k1-residual": dict(use_residual=True, capacity_factor=0.5, min_capacity=1),
    "k2-defaults": dict(k=2),
    "k2-no-sampling": dict(k=2, top2_2nd_expert_sampling=False, capacity_factor=0.5, eval_capacity_factor=0.75,
                           min_capacity=1),
    "k2-dropless": dict(k=2, drop_tokens=False),
    "k2-dropless-no-sampling": dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False),
    "k2-jitter": dict(k=2, noisy_gate_policy="Jitter", capacity_factor=0.5, min_capacity=1),
    "k2-residual": dict(k=2, use_residual=True, capacity_factor=0.5, min_capacity=1),
    "k3-capacity": dict(k=3, capacity_factor=0.5, eval_capacity_factor=0.25, min_capacity=1),
    "k3-dropless": dict(k=3, drop_tokens=False),
}
GATE_ARGS = ("k", "capacity_factor", "eval_capacity_factor", "min_capacity", "noisy_gate_policy", "drop_tokens",
             "use_rts", "top2_2nd_expert_sampling")
MOE_DEFAULTS = dict(k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, noisy_gate_policy=None,
                    drop_tokens=True, use_rts=True, top2_2nd_expert_sampling=True)


def mlp_expert() -> nn.Module:
    """A GELU MLP expert: ep_moe's gate_up[j] is its ``0.weight``, down[j] its ``2.weight``."""
    return nn.Sequential(nn.Linear(H, I, bias=False), nn.GELU(), nn.Linear(I, H, bias=False))


def _init_(module: nn.Module, seed: int, std: float = 0.5) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module


# ---------------------------------------------------------------------------------------
# The gate alone: DeepSpeed's TopKGate routes (sparse_routes, as its MOELayer asks).


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", [c for c in CASES if "residual" not in c])
def test_gate_matches_topkgate(deepspeed, case, training):
    """Routes of 96 tokens over 8 experts: expert of each slot (-1: dropped), combine
    weight, l_aux, exp_counts and the RNG state afterwards, bit for bit."""
    from deepspeed.moe.sharded_moe import TopKGate

    args = {**MOE_DEFAULTS, **{k: v for k, v in CASES[case].items() if k in GATE_ARGS}}
    num_experts, num_tokens = 8, 96
    ds_gate = TopKGate(H, num_experts, args["k"], args["capacity_factor"], args["eval_capacity_factor"],
                       args["min_capacity"], args["noisy_gate_policy"], args["drop_tokens"], args["use_rts"], None,
                       args["top2_2nd_expert_sampling"]).train(training)
    _init_(ds_gate, 1)
    ours = DeepSpeedGate(num_experts, **args)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    l_aux, _, _, ids_KT, _, gates_KT, counts = ds_gate(x, None, True)
    ds_next = torch.rand(4)
    torch.manual_seed(3)
    router, keep = ours.route(x, ds_gate.wg.weight, training=training)
    assert torch.equal(torch.rand(4), ds_next)  # the same draws, in the same order
    ids = router.topk_ids_TK if keep is None else router.topk_ids_TK.masked_fill(~keep, -1)
    assert torch.equal(ids, ids_KT.t().long())
    assert torch.equal(router.topk_weights_TK, gates_KT.t())
    assert torch.equal(router.aux_loss, l_aux) and torch.equal(router.counts_E, counts)
    factor = args["capacity_factor"] if training else args["eval_capacity_factor"]
    cap = capacity(num_tokens, num_experts, factor * args["k"], args["min_capacity"])
    assert bool((ids_KT < 0).any()) == (args["drop_tokens"] and bool((counts > cap).any()))
    if args["drop_tokens"] and factor <= 0.5:
        assert bool((ids_KT < 0).any())  # the small capacities do drop
    assert (keep is None) == (not args["drop_tokens"])


def test_capacity_rounds_in_float32():
    """DeepSpeed's ceil(T / E * c) runs on a float32 tensor: 50 / 4 * 1.2 is 15 in float64
    but 15.0000006 in float32 (1.2 rounds up), so the capacity is 16."""
    assert capacity(50, 4, 1.2, 0) == 16
    assert capacity(50, 4, 1.2, 17) == 17 and capacity(3, 4, 1.0, 0) == 1


# ---------------------------------------------------------------------------------------
# The layer: the drop-in against DeepSpeed's MoE.


def _pair(kwargs: dict, seed: int = 0, backend: str = "torch"):
    """DeepSpeed's MoE with ``kwargs`` and random weights, and the drop-in built from it."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    ds = _init_(DeepSpeedMoE(H, mlp_expert(), num_experts=E, **kwargs), seed)
    return ds, MoE.from_deepspeed(ds, backend=backend)


def _step(layer: nn.Module, x: torch.Tensor, seed: int, used_token=None) -> dict:
    """Forward from RNG seed ``seed``, backward of ``sum(out * proj) + 0.1 * l_aux``; the
    results, the input gradient and a probe of the RNG state afterwards."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out, l_aux, counts = layer(x, used_token)
    rng_after = torch.rand(4)
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    ((out * proj).sum() + 0.1 * l_aux).backward()
    return dict(out=out.detach(), l_aux=l_aux.detach(), counts=counts, dx=x.grad, rng_after=rng_after)


def _assert_same_step(ds, ours, ref: dict, got: dict) -> None:
    """Outputs, l_aux, exp_counts, RNG state and every gradient agree."""
    assert torch.equal(got["counts"], ref["counts"]) and got["counts"].dtype == ref["counts"].dtype
    assert torch.equal(got["rng_after"], ref["rng_after"])
    for key in ("out", "l_aux", "dx"):
        torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.layer.router.weight.grad, ds.deepspeed_moe.gate.wg.weight.grad, **close)
    for j, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
        for ours_grad, linear in ((ours.layer.experts.gate_up.grad[j], expert[0]),
                                  (ours.layer.experts.down.grad[j], expert[2])):
            want = torch.zeros_like(linear.weight) if linear.weight.grad is None else linear.weight.grad
            torch.testing.assert_close(ours_grad, want, **close)
    if ds.use_residual:
        for name, p in [*ds.mlp.named_parameters(prefix="mlp"), *ds.coefficient.named_parameters(prefix="coef")]:
            mine = ours.get_parameter(name.replace("coef", "coefficient"))
            torch.testing.assert_close(mine.grad, p.grad, **close, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_deepspeed(deepspeed, case, training):
    ds, ours = _pair(CASES[case])
    ds.train(training)
    ours.train(training)
    x = torch.randn(2, 13, H, generator=torch.Generator().manual_seed(1))
    ref, got = _step(ds, x, seed=11), _step(ours, x, seed=11)
    _assert_same_step(ds, ours, ref, got)
    if ds.use_residual:
        assert ours.mlp is not ds.mlp and ours.coefficient.bias is not None


@pytest.mark.parametrize("drop_tokens", [True, False], ids=["drop", "dropless"])
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool])
def test_used_token_matches_deepspeed(deepspeed, drop_tokens, mask_dtype):
    """k=1: masked-out tokens are neither routed nor counted (their output is 0); l_aux
    counts only used tokens but averages probabilities over all."""
    ds, ours = _pair(dict(drop_tokens=drop_tokens, min_capacity=1, capacity_factor=0.75))
    x = torch.randn(2, 13, H, generator=torch.Generator().manual_seed(1))
    used = (torch.arange(26) % 3 != 0).to(mask_dtype)
    ref, got = _step(ds, x, seed=5, used_token=used), _step(ours, x, seed=5, used_token=used)
    _assert_same_step(ds, ours, ref, got)
    assert int(got["counts"].sum()) <= int(used.sum()) and torch.all(got["out"].view(26, H)[~used.bool()] == 0)


def test_used_token_is_ignored_for_top2(deepspeed):
    """DeepSpeed passes used_token to its top-1 gate only."""
    ds, ours = _pair(dict(k=2))
    x = torch.randn(26, H, generator=torch.Generator().manual_seed(1))
    used = torch.arange(26) % 2
    ref, got = _step(ds, x, seed=5, used_token=used), _step(ours, x, seed=5, used_token=used)
    _assert_same_step(ds, ours, ref, got)
    assert int(got["counts"].sum()) == 52


def test_fewer_tokens_than_min_capacity(deepspeed):
    """DeepSpeed's top-1 gate asserts T >= min_capacity; the drop-in routes them all (each
    expert has room for min_capacity), as DeepSpeed does without dropping."""
    ds, ours = _pair(dict(drop_tokens=False, min_capacity=0))  # DeepSpeed's assertion passes
    ours.gate = DeepSpeedGate(E)  # DeepSpeed's defaults: drop_tokens, min_capacity=4
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError, match="min_capacity"):
        _pair(dict())[0](x)
    ref, got = _step(ds, x, seed=5), _step(ours, x, seed=5)
    _assert_same_step(ds, ours, ref, got)
    assert int(ours.layer.last_stats.num_dropped) == 0


def test_triton_backend_matches_deepspeed(deepspeed):
    """The Triton grouped GEMM (CPU interpreter, float32) behind DeepSpeed's top-2 drops."""
    ds, ours = _pair(CASES["k2-no-sampling"], backend="triton")
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(1))
    _assert_same_step(ds, ours, _step(ds, x, seed=3), _step(ours, x, seed=3))
    assert int(ours.layer.last_stats.num_dropped) > 0


def test_residual_state_dict_has_deepspeed_keys(deepspeed):
    """Residual MoE's MLP and coefficient are saved under DeepSpeed's keys, and DeepSpeed's
    state dict loads strictly."""
    ds, ours = _pair(CASES["k1-residual"], seed=0)
    saved = ours.state_dict()
    assert saved.keys() == ds.state_dict().keys()
    assert {"mlp.0.weight", "mlp.2.weight", "coefficient.weight", "coefficient.bias"} <= saved.keys()
    fresh = MoE(H, mlp_expert(), num_experts=E, **CASES["k1-residual"])
    fresh.load_state_dict(ds.state_dict())
    x = torch.randn(10, H)
    torch.manual_seed(0)
    want = ds(x)[0]
    torch.manual_seed(0)
    torch.testing.assert_close(fresh(x)[0], want, atol=1e-5, rtol=1e-5)


class PRMoE(nn.Module):
    """DeepSpeed's PR-MoE shape: a pyramid of MoE layers (more experts deeper), residual,
    with one expert module passed to every layer (as DeepSpeed's own tests build them)."""

    def __init__(self, ds_moe_cls, layers: list[dict], seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        expert = mlp_expert()
        self.moes = nn.ModuleList([ds_moe_cls(H, expert, **kwargs) for kwargs in layers])
        _init_(self, seed)

    def forward(self, x, used_token=None):
        l_aux, counts = [], []
        for moe in self.moes:
            y, aux, count = moe(x, used_token)
            x = x + y
            l_aux.append(aux)
            counts.append(count)
        return x, sum(l_aux), torch.cat(counts)


def _model_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the dense weights (residual MLPs, coefficients) and routers, by role."""
    out = {}
    for i, moe in enumerate(model.moes):
        router = moe.layer.router.weight if isinstance(moe, MoE) else moe.deepspeed_moe.gate.wg.weight
        out[f"{i}.router"] = router.grad
        if moe.use_residual:
            out[f"{i}.coefficient"] = moe.coefficient.weight.grad
    out["mlp"] = model.moes[0].mlp[0].weight.grad
    return out


def test_pyramid_residual_model_matches_deepspeed(deepspeed):
    """replace_deepspeed_moe on a PR-MoE model (4 then 8 experts) keeps the shared residual
    MLP shared, and the model computes what DeepSpeed's does."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    layers = [dict(num_experts=4, use_residual=True, min_capacity=1),
              dict(num_experts=8, k=2, use_residual=True, capacity_factor=0.5, min_capacity=1)]
    ds_model, ours = PRMoE(DeepSpeedMoE, layers), PRMoE(DeepSpeedMoE, layers)
    assert replace_deepspeed_moe(ours) == 2
    assert ours.moes[0].mlp is ours.moes[1].mlp and [m.num_experts for m in ours.moes] == [4, 8]
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(1))
    ref, got = _step(ds_model, x, seed=4), _step(ours, x, seed=4)
    assert torch.equal(got["counts"], ref["counts"]) and torch.equal(got["rng_after"], ref["rng_after"])
    for key in ("out", "l_aux", "dx"):
        torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-5)
    ref_grads, got_grads = _model_grads(ds_model), _model_grads(ours)
    for key in ref_grads:
        torch.testing.assert_close(got_grads[key], ref_grads[key], atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")


# ---------------------------------------------------------------------------------------
# Arguments.


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(noisy_gate_policy="Gumbel"), r"noisy_gate_policy='Gumbel' is not one of DeepSpeed's \(None, 'None', "
                                       r"'Jitter', 'RSample'\)"),
    (dict(k=0), r"k=0 must be in \[1, num_experts=4\]"),
    (dict(k=5), r"k=5 must be in \[1, num_experts=4\].*lower k or add experts"),
    (dict(capacity_factor=-1.0), r"capacity_factor=-1.0 is negative"),
    (dict(min_capacity=-1), r"min_capacity=-1 is negative"),
])
def test_bad_gate_arguments_raise(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MoE(H, mlp_expert(), num_experts=E, **kwargs)


def test_deepspeed_rejects_the_same_noisy_gate_policy(deepspeed):
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    with pytest.raises(AssertionError, match="Unsupported noisy_gate_policy: Gumbel"):
        DeepSpeedMoE(H, mlp_expert(), num_experts=E, noisy_gate_policy="Gumbel")


def test_residual_needs_the_expert_module():
    with pytest.raises(ValueError, match=r"use_residual=True runs the expert module as the residual MLP.*pass the "
                                         r"expert module"):
        MoE(H, None, num_experts=E, use_residual=True, intermediate_size=I, activation="gelu")


@pytest.mark.parametrize("flag", [True, False])
def test_expert_tensor_parallelism(deepspeed, flag):
    """Without tensor parallelism the flag changes nothing in DeepSpeed and is accepted; under
    tensor parallelism the drop-in refuses either way, saying why (DeepSpeed shards the experts,
    or splits the duplicated tokens among the tensor-parallel ranks: ep_moe does neither, so its
    expert gradients would be too large by the tensor-parallel size)."""
    moe = MoE(H, mlp_expert(), num_experts=E, enable_expert_tensor_parallelism=flag)
    assert moe.enable_expert_tensor_parallelism == flag and moe(torch.randn(8, H))[0].shape == (8, H)
    moe._check_expert_tensor_parallelism(None)
    moe._check_expert_tensor_parallelism(types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 1))
    how = "shards each expert" if flag else "splits the tokens"
    with pytest.raises(ValueError, match=rf"does not run under tensor parallelism \(size 2 here, "
                                         rf"enable_expert_tensor_parallelism={flag}\): DeepSpeed {how}.*too large.*"
                                         r"DeepSpeed's own MoE layer.*ep_size"):
        moe._check_expert_tensor_parallelism(types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 2))


# ---------------------------------------------------------------------------------------
# EP=2 (gloo): a pyramid of EP sizes 1 and 2, every layer with DeepSpeed's own draws.


def _ep2_worker(rank, world_size):
    """DeepSpeed's PR-MoE model against its replacement on each rank's tokens (experts
    differ per rank at ep_size=2), in training and eval mode; the replacement once with the
    default dispatch (the all-to-all on gloo) and once with the all-gather."""
    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does its job
    deepspeed.init_distributed(dist_backend="gloo")
    layers = [dict(num_experts=2, ep_size=1, use_residual=True, min_capacity=1),  # defaults: drops, RTS
              dict(num_experts=4, ep_size=2, k=2, capacity_factor=0.5, min_capacity=1),  # sampling, drops
              dict(num_experts=4, ep_size=2, drop_tokens=False, noisy_gate_policy="RSample"),
              dict(num_experts=8, ep_size=2, k=3, capacity_factor=0.5, min_capacity=1)]
    models = []
    for _ in range(3):
        model = PRMoE(DeepSpeedMoE, layers)
        for moe in model.moes:
            moe.set_deepspeed_parallelism()
            _init_(moe.deepspeed_moe.experts, seed=10 + rank * moe.ep_size // 2)
        models.append(model)
    ds_model, ours, gathered = models
    replace_deepspeed_moe(ours)
    replace_deepspeed_moe(gathered, dispatch="all_gather")
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(rank))
    out = {"ds": _step(ds_model, x, seed=20 + rank), "ours": _step(ours, x, seed=20 + rank),
           "gathered": _step(gathered, x, seed=20 + rank)}
    out["ds_grads"], out["ours_grads"] = _model_grads(ds_model), _model_grads(ours)
    out["gathered_grads"] = _model_grads(gathered)
    out["dropped"] = [int(m.layer.last_stats.num_dropped) for m in ours.moes]
    out["dispatch"] = [(m.layer.dispatch, g.layer.dispatch) for m, g in zip(ours.moes, gathered.moes)]
    for key, model in (("ds_eval", ds_model), ("ours_eval", ours), ("gathered_eval", gathered)):
        torch.manual_seed(30)
        with torch.no_grad():
            out[key] = model.eval()(x)
    return out


@pytest.mark.distributed
def test_ep2_pyramid_matches_deepspeed(deepspeed):
    results = run_distributed(_ep2_worker, 2, timeout_s=120)
    assert results[0]["ds"]["counts"].shape == (2 + 4 + 4 + 8,)
    for res in results:
        assert res["dispatch"][1:] == [("all_to_all", "all_gather")] * 3  # the ep_size=2 layers
        ref = res["ds"]
        for ours in ("ours", "gathered"):
            got = res[ours]
            assert torch.equal(got["counts"], ref["counts"]) and torch.equal(got["rng_after"], ref["rng_after"])
            for key in ("out", "l_aux", "dx"):
                torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{ours} {key}: {m}")
            for key, want in res["ds_grads"].items():
                torch.testing.assert_close(res[f"{ours}_grads"][key], want, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{ours} {key}: {m}")
            for got_eval, ref_eval in zip(res[f"{ours}_eval"], res["ds_eval"]):
                torch.testing.assert_close(got_eval, ref_eval, atol=1e-5, rtol=1e-5)
        assert res["dropped"][1] > 0 and res["dropped"][3] > 0 and res["dropped"][2] == 0
