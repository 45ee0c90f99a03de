"""MoELayer at EP=1: against a plain per-token float64 loop (naive_moe), capacity drops,
zero tokens, the Triton backend, state dicts (global expert ids, partial and assign
loads), init, the model helpers and the expert bias, activation-checkpoint recompute,
autocast, the meta device, errors. Config errors: test_config.py; EP=2/4 on gloo:
tests/ep/test_layer_ep.py."""

import re
import warnings

import pytest
import torch
from torch import nn

import ep_moe.experts as experts_mod
from ep_moe import MoELayer
from ep_moe.layer import expert_load, moe_aux_loss, update_expert_biases
from ep_moe.parallel import expert_param_names, is_expert_param, resolve_ep_group
from layer_helpers import ATOL, E, H, I, _config, assert_matches_naive

@pytest.fixture(autouse=True)
def _default_kernel_configs(monkeypatch):
    """Triton runs on the kernels' default configs (large blocks: fast in the interpreter),
    and no autotune cache is read."""
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, num_rows, device: None)


NUM_TOKENS = 16
LOCAL_CASES = [
    dict(top_k=1),
    dict(top_k=2),
    dict(top_k=3, activation="gelu"),
    dict(top_k=4, activation="relu", norm_topk_prob=False),
    dict(top_k=2, score_func="sigmoid", expert_bias=True),
    dict(top_k=2, expert_bias=True),  # softmax: chosen with the bias, weighted by the chosen logits' softmax
    dict(top_k=2, num_shared_experts=2, shared_intermediate_size=12),
    dict(top_k=2, capacity_factor=0.625, drop_policy="probs"),  # capacity ceil(2.5) = 3
    dict(top_k=3, capacity_factor=0.75, drop_policy="position"),  # ceil(4.5) = 5
    dict(top_k=2, capacity_factor=0.5, drop_policy="probs"),  # 0.5 * 16 * 2 / 8 = 2 exactly
    dict(top_k=1, capacity_factor=1.5, drop_policy="position"),  # 1.5 * 16 * 1 / 8 = 3 exactly
    dict(top_k=2, router_dtype=torch.float64, z_loss_coef=0.1),
]
"""Configs checked against the loop: each drop case keeps a known number of slots per
expert, two of them a whole number (where an off-by-one in the capacity shows)."""


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", LOCAL_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_ep1_matches_naive_loop(case, backend):
    """Output, losses, counts, drops and every gradient (x, router, experts, shared
    experts) against the float64 loop, on the reference and the Triton backend."""
    torch.manual_seed(0)
    cfg = _config(**case, backend=backend)
    layer = MoELayer(cfg)
    bias_E = None
    if cfg.expert_bias:
        bias_E = torch.randn(E) * 0.3
        layer.expert_bias.copy_(bias_E)
    x, g = torch.randn(2, NUM_TOKENS // 2, H), torch.randn(2, NUM_TOKENS // 2, H)
    dropped = assert_matches_naive(layer, x, g, bias_E)
    if cfg.capacity_factor is not None:
        assert dropped > 0  # the case must actually drop


def test_triton_backend_on_cpu_tensors_without_the_interpreter_says_so(monkeypatch):
    """On a GPU host without TRITON_INTERPRET, CPU tensors must not reach Triton's kernels
    (they would be compiled for the GPU and launched on host memory)."""
    import ep_moe.layer as layer_module

    layer = MoELayer(_config(top_k=2, backend="triton"))
    x = torch.randn(NUM_TOKENS, H)
    assert layer(x).shape == x.shape  # the interpreter runs these tests
    monkeypatch.setattr(layer_module, "_TRITON_ON_CPU", False)
    with pytest.raises(ValueError, match=r"backend='triton' runs on CUDA tensors .* x is on cpu"):
        layer(x)
    auto = MoELayer(_config(top_k=2, backend="auto"))
    assert auto(x).shape == x.shape  # auto takes the plain-PyTorch path on the CPU


def test_compiled_config_lookup_names_every_problem_field():
    """``torch.compile``'s trace hands the problem over as its fields by name: all of them."""
    import dataclasses

    from ep_moe.autotune.space import GemmProblem

    assert experts_mod._PROBLEM_FIELDS == tuple(f.name for f in dataclasses.fields(GemmProblem))


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_as_documented(policy):
    # Every token prefers expert 0; capacity ceil(1.0 * 8 * 1 / 8) = 1 keeps one token.
    cfg = _config(top_k=1, capacity_factor=1.0, drop_policy=policy)
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.rand(8, H) + 0.1
    x[5] += 1.0  # token 5 has the highest score for expert 0
    y = layer(x)
    kept = 5 if policy == "probs" else 0
    assert int(layer.last_stats.num_dropped) == 7
    assert layer.last_stats.tokens_per_expert.tolist() == [8] + [0] * (E - 1)
    assert (y[torch.arange(8) != kept] == 0).all() and (y[kept] != 0).any()


def test_stats_are_each_calls_own_when_a_caller_adds_into_them():
    # dropless, no z loss: the zeros a caller may sum into must not be shared between layers
    # or calls (a cache of them once aliased every layer's and doubled such sums)
    layers = [MoELayer(_config(top_k=2, z_loss_coef=0.0)) for _ in range(2)]
    x = torch.randn(4, H)
    for layer in layers:
        layer(x)
    dropped, z_loss = layers[0].last_stats.num_dropped, layers[0].last_stats.z_loss
    for layer in layers[1:]:
        dropped += layer.last_stats.num_dropped + 3
        z_loss += layer.last_stats.z_loss + 1.0
    assert int(dropped) == 3 and float(z_loss) == 1.0
    assert int(layers[1].last_stats.num_dropped) == 0 and float(layers[1].last_stats.z_loss) == 0
    layers[0](x)
    assert int(layers[0].last_stats.num_dropped) == 0 and float(layers[0].last_stats.z_loss) == 0


def test_slots_per_token_needs_rows_placed_at_every_slot():
    layer = MoELayer(_config(top_k=2))
    x, counts = torch.randn(3, H), torch.tensor([6] + [0] * (E - 1))
    rows = torch.arange(6)
    with pytest.raises(ValueError, match="pass it with scatter_index"):
        layer.experts(x, counts, gather_index=rows // 2, slots_per_token=2)
    summed = layer.experts(x, counts, gather_index=rows // 2, scatter_index=rows, slots_per_token=2)
    torch.testing.assert_close(summed, layer.experts(x, counts, gather_index=rows // 2,
                                                     scatter_index=rows).view(3, 2, H).sum(1))


def test_zero_tokens():
    layer = MoELayer(_config(top_k=2))
    x = torch.randn(0, 4, H, requires_grad=True)
    y = layer(x)
    (y.sum() + moe_aux_loss(layer)).backward()
    assert y.shape == (0, 4, H) and x.grad.shape == x.shape
    assert layer.last_stats.tokens_per_expert.tolist() == [0] * E
    assert layer.last_stats.aux_loss.item() == 0


def test_triton_backend_matches_reference(monkeypatch):
    calls = []

    def fake_configs(problem, num_rows, device):
        calls.append((problem.projection, num_rows))
        return None

    monkeypatch.setattr(experts_mod, "_kernel_configs", fake_configs)
    torch.manual_seed(1)
    ref = MoELayer(_config(top_k=2))
    tri = MoELayer(_config(top_k=2, backend="triton"))
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(6, H)
    torch.testing.assert_close(tri(x), ref(x), atol=ATOL, rtol=1e-5)
    assert calls == [("gate_up", 12), ("down", 12)]


def test_gemm_problems():
    problems = MoELayer(_config(top_k=3)).gemm_problems()
    assert [(p.projection, p.n, p.k, p.num_local_experts, p.top_k, p.dtype) for p in problems] == [
        ("gate_up", 2 * I, H, E, 3, "float32"), ("down", H, I, E, 3, "float32")]
    gelu = MoELayer(_config(top_k=1, activation="gelu")).gemm_problems()
    assert gelu[0].n == I


def test_warmup_collects_each_layers_problems_once():
    """What ``ep_moe.autotune.warmup(model)`` tunes: every MoE layer's two GEMMs, once each
    (a submodule with a ``gemm_problems`` of another signature broke the trainer's warmup)."""
    from ep_moe.autotune.coordinate import collect_problems

    model = nn.Sequential(MoELayer(_config(top_k=3)), MoELayer(_config(top_k=3)), MoELayer(_config(top_k=2)))
    problems = collect_problems(model)
    assert [(p.projection, p.top_k) for p in problems] == [("gate_up", 3), ("down", 3), ("gate_up", 2), ("down", 2)]


def test_state_dict_uses_global_expert_ids_and_round_trips():
    torch.manual_seed(2)
    layer = MoELayer(_config(top_k=2))
    sd = layer.state_dict()
    assert "experts.gate_up" not in sd and sd["experts.gate_up.7"].shape == (2 * I, H)
    assert sd["experts.down.3"].shape == (H, I)
    other = MoELayer(_config(top_k=2))
    other.load_state_dict(sd)
    x = torch.randn(5, H)
    torch.testing.assert_close(other(x), layer(x))
    del sd["experts.down.3"]
    with pytest.raises(RuntimeError, match=re.escape("experts.down.3")):
        other.load_state_dict(sd)


@pytest.mark.parametrize("cast", ["to_bfloat16", "half"])
def test_expert_bias_stays_in_router_dtype_when_the_layer_is_cast(cast):
    """.to(bf16) / .half() cast weights and activations, not the balancing bias: its small
    steps would round away (and the load counts tie) in half precision."""
    torch.manual_seed(5)
    layer = MoELayer(_config(top_k=2, expert_bias=True, bias_update_rate=1e-3))
    layer.expert_bias.fill_(0.75)
    names = [name for name, _ in layer.named_buffers()]
    layer = layer.to(torch.bfloat16) if cast == "to_bfloat16" else layer.half()
    assert layer.expert_bias.dtype == torch.float32 and layer.router.weight.dtype != torch.float32
    assert [name for name, _ in layer.named_buffers()] == names
    layer.train()
    layer(torch.randn(64, H).to(layer.router.weight.dtype))
    before = layer.expert_bias.clone()
    layer.update_expert_bias()
    step = layer.expert_bias - before
    assert step.abs().max() == pytest.approx(1e-3, rel=1e-3) and (step != 0).any()


def test_assign_load_into_a_meta_layer_keeps_weights_and_expert_tags():
    """load_state_dict(assign=True), e.g. into a layer built on the meta device: the stacked
    experts are the loaded tensors (not moved to meta), and the new Parameters stay tagged
    as experts (sync_gradients, DDP's ignore list and the trainer's checkpoints rely on it)."""
    torch.manual_seed(2)
    layer = MoELayer(_config(top_k=2))
    for device in ("meta", "cpu"):
        other = MoELayer(_config(top_k=2), device=device)
        other.load_state_dict(layer.state_dict(), assign=True)
        assert expert_param_names(other) == expert_param_names(layer) == ["experts.gate_up", "experts.down"]
        assert all(p.device.type == "cpu" for p in other.parameters())
        x = torch.randn(5, H)
        torch.testing.assert_close(other(x), layer(x))


def test_init_is_seeded_and_experts_differ():
    torch.manual_seed(3)
    a = MoELayer(_config(top_k=2)).state_dict()
    torch.manual_seed(3)
    b = MoELayer(_config(top_k=2)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["experts.gate_up.0"], a["experts.gate_up.1"])


def test_model_helpers_and_expert_bias_update():
    torch.manual_seed(4)
    model = nn.Sequential(MoELayer(_config(top_k=2, expert_bias=True, bias_update_rate=0.1)),
                          MoELayer(_config(top_k=1)))
    assert moe_aux_loss(model).item() == 0 and expert_load(model).shape == (0, 0)
    x = torch.randn(10, H)
    model(x)
    stats = [m.last_stats for m in model]
    assert moe_aux_loss(model).item() == pytest.approx(sum((s.aux_loss + s.z_loss).item() for s in stats))
    load = expert_load(model)
    assert load.shape == (2, E) and load.sum(1).tolist() == [20, 10]
    update_expert_biases(model)
    counts = load[0].float()
    torch.testing.assert_close(model[0].expert_bias, 0.1 * torch.sign(counts.mean() - counts))
    assert model[0]._load_since_update.sum() == 0
    assert "expert_bias" in model[0].state_dict()
    assert expert_param_names(model) == ["0.experts.gate_up", "0.experts.down", "1.experts.gate_up",
                                         "1.experts.down"]
    assert is_expert_param(model[0].experts.down) and not is_expert_param(model[0].router.weight)


def test_partial_load_names_the_missing_experts():
    """A load without some experts reports them by their state_dict keys and keeps them."""
    layer = MoELayer(_config(top_k=2))
    before = layer.experts.gate_up.detach().clone()
    state = {k: v for k, v in layer.state_dict().items() if k not in ("experts.gate_up.3", "experts.down.5")}
    result = layer.load_state_dict(state, strict=False)
    assert result.missing_keys == ["experts.gate_up.3", "experts.down.5"]
    dense_only = {k: v for k, v in state.items() if not k.startswith("experts.")}
    result = layer.load_state_dict(dense_only, strict=False)
    assert result.missing_keys == [f"experts.{name}.{g}" for name in ("gate_up", "down") for g in range(E)]
    assert torch.equal(layer.experts.gate_up, before)


def test_load_reports_keys_of_no_expert_as_unexpected():
    """A key that names no expert of the layer (id past num_experts, or not the id's own
    spelling) is unexpected, not taken for another rank's expert and dropped."""
    layer = MoELayer(_config(top_k=2, num_experts=4))
    state = layer.state_dict()
    state.update({"experts.gate_up.99": state["experts.gate_up.0"], "experts.down.07": state["experts.down.0"]})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "experts.gate_up.99", '
                                           r'"experts.down.07"'):
        layer.load_state_dict(state)
    result = layer.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["experts.gate_up.99", "experts.down.07"] and result.missing_keys == []


@pytest.mark.parametrize("strict", [True, False])
def test_load_names_an_expert_of_the_wrong_shape(strict):
    layer = MoELayer(_config(top_k=2))
    before = layer.experts.gate_up.detach().clone()
    state = layer.state_dict()
    state["experts.gate_up.2"] = torch.zeros(3, H)
    with pytest.raises(RuntimeError, match=re.escape(f"size mismatch for experts.gate_up.2: copying a param with "
                                                     f"shape (3, {H}) from checkpoint, the shape in current model "
                                                     f"is ({2 * I}, {H})")):
        layer.load_state_dict(state, strict=strict)
    assert torch.equal(layer.experts.gate_up, before)
    state["experts.gate_up.2"] = [0.0]
    with pytest.raises(RuntimeError, match=r"expert weight experts.gate_up.2 is a list, not a tensor of shape"):
        layer.load_state_dict(state, strict=strict)


def test_layer_errors():
    layer = MoELayer(_config(top_k=2))
    with pytest.raises(ValueError, match=r"x has shape \(4, 12\) but the layer's hidden_size is 16; pass x as"):
        layer(torch.randn(4, 12))
    with pytest.raises(ValueError, match=r"x dtype torch.float64 does not match the layer's parameter dtype "
                                         r"torch.float32; cast x with x.to\(torch.float32\)$"):
        layer(torch.randn(4, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x dtype torch.int64 is not supported: the layer takes float32, float16 "
                                         r"or bfloat16 input .*; cast x with x.to\(torch.float32\)$"):
        layer(torch.ones(4, H, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor \[..., 16\], got list"):
        layer([[0.0] * H])
    with pytest.raises(ValueError, match=r"the layer computes in torch.float64, but its experts run in float32, "
                                         r"float16 or bfloat16; cast the layer \(layer.float\(\)\) and x"):
        MoELayer(_config(top_k=2), dtype=torch.float64)(torch.randn(4, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"ep_group has 1 ranks but MoEConfig.ep_size=2; pass a group of 2"):
        MoELayer(_config(top_k=2, ep_size=2))
    with pytest.raises(ValueError, match=r"ep_group must be None, a ProcessGroup or a 1-D DeviceMesh, got int"):
        resolve_ep_group(4)
    with pytest.raises(ValueError, match=r"update_expert_bias needs MoEConfig\(expert_bias=True\)"):
        layer.update_expert_bias()


def test_nonfinite_tokens_raise_only_in_debug_mode(monkeypatch):
    """EP_MOE_DEBUG=1: a NaN or inf token raises at the layer, counted; without it the
    layer adds no check (no host sync) and routes them as before."""
    layer = MoELayer(_config(top_k=2))
    x = torch.randn(2, 5, H)
    x[0, 1, 3], x[1, 4, 0], x[1, 4, 1] = float("nan"), float("inf"), float("-inf")
    monkeypatch.delenv("EP_MOE_DEBUG", raising=False)
    y = layer(x)
    assert y[0, 0].isfinite().all() and not y[0, 1].isfinite().all()
    monkeypatch.setenv("EP_MOE_DEBUG", "1")
    with pytest.raises(ValueError, match=r"x has 2 of 10 tokens with NaN or inf values \(EP_MOE_DEBUG is set\)"):
        layer(x)
    layer(torch.randn(2, 5, H))  # finite tokens pass


@pytest.mark.parametrize("reentrant", [True, False])
def test_recomputed_forward_counts_the_load_once(reentrant):
    """A checkpoint that recomputes the layer in the backward does not count its tokens
    again for the expert-bias update (nor replace what the forward reported)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(4)
    layer = MoELayer(_config(top_k=2, expert_bias=True))
    x = torch.randn(12, H, requires_grad=True)
    y = checkpoint(lambda t: layer(t).square(), x, use_reentrant=reentrant)  # square saves y: a full recompute
    stats = layer.last_stats
    y.sum().backward()
    assert layer.last_stats is stats
    assert torch.equal(layer._load_since_update, stats.tokens_per_expert)


def test_aux_loss_without_autograd_warns_when_training():
    """A reentrant checkpoint's first forward runs under no_grad: its aux loss would not
    train the router, and moe_aux_loss says so; eval runs and no_grad callers stay quiet."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    layer = MoELayer(_config(top_k=2))
    x = torch.randn(10, H, requires_grad=True)
    y = checkpoint(layer, x, use_reentrant=True)
    with pytest.warns(UserWarning, match="use_reentrant=False"):
        loss = y.sum() + moe_aux_loss(layer)
    loss.backward()
    assert layer.router.weight.grad is not None  # the task loss still reaches it
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint(layer, x, use_reentrant=False).sum() + moe_aux_loss(layer)  # differentiable: quiet
        with torch.no_grad():
            layer(x)
            moe_aux_loss(layer)  # logging under no_grad
        layer.eval()
        with torch.no_grad():
            layer(x)
        moe_aux_loss(layer)  # an eval run


def test_autocast_runs_experts_in_the_autocast_dtype():
    torch.manual_seed(3)
    layer = MoELayer(_config(top_k=2))
    x = torch.randn(10, H, requires_grad=True)
    y_ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {p.dtype for p in layer.gemm_problems()} == {"bfloat16"}
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == y_ref.shape
    assert ((y.float() - y_ref).norm() / y_ref.norm()).item() < 2e-2
    y.float().sum().backward()
    assert layer.experts.gate_up.grad.dtype == torch.float32
    assert layer.router.weight.grad is not None and x.grad.dtype == torch.float32


def test_builds_on_the_meta_device():
    with torch.device("meta"):
        layer = MoELayer(_config(top_k=2))
    assert layer.experts.gate_up.is_meta
