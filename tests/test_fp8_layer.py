"""MoEConfig(expert_precision="fp8"): the layer's experts on the FP8 grouped GEMMs
(``ep_moe.kernels.fp8``), in the Triton interpreter, float16.

- Output and gradients (x, router, expert weights and biases) against a float64 reference of
  the same quantization (:func:`_reference`: each slot through the recipe, the roundings to
  float16 where the kernels store; the token rows' e4m3 values in the up projection's dW), over top-1 and top-2, a capacity, biases, one Linear, a
  non-gated activation, experts without tokens, every token on one expert, one token, none.
- Against the unquantized float64 layer: within the recipe's bound, and off by more than a
  float16 layer would be (quantized, not silently float16).
- The weights' e4m3 copies: made once per optimizer step, not per call; again after a step,
  also where the values change without a version bump (FSDP2's all-gather); fp32 master
  weights under autocast quantized as they are, their gradients fp32.
- The config's and the construction's errors; a device without FP8 at the first call.
- EP=2 on gloo (all-to-all, all-gather with bounded rows and biases) against EP=1, the
  tokens on the wire in e4m3 (the up projection's dW reads the e4m3 rows at both sizes).
- The DeepSpeed drop-in's ``expert_precision``; the trainer's ``--set moe.expert_precision``.

The GPU side (bf16, against bf16 experts, CUDA graphs) is ``tests/gpu/test_fp8_layer_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_distributed
from ep_moe import MoEConfig, MoELayer
from ep_moe.ep.all_to_all import AllToAllDispatcher
from ep_moe.ep.fp8_wire import pack_fp8_rows, wire_width
from ep_moe.integrations.deepspeed import MoE
from ep_moe.kernels.e4m3 import quantize_rows_reference
from ep_moe.kernels.fp8 import fp8_supported
from ep_moe.routing import capacity_keep_mask, expert_capacity, route

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not fp8_supported(CPU)[0], reason="the FP8 kernels run in the Triton interpreter "
                                "here (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)")

H, I, E = 48, 40, 4  # multiples of no 32-wide block: masked tails in every pass
BASE = dict(hidden_size=H, intermediate_size=I, num_experts=E, aux_loss_coef=0.0, init_std=0.2,
            expert_precision="fp8")
SAME_QUANT_TOL = 2e-3
"""Relative Frobenius error against the float64 reference of the same quantization: fp32
accumulation, and the roundings to float16 of the gradients the reference does not mirror
(each expert's dW, the summed slots); measured up to 3.2e-4 here. A gradient that skipped a
quantization, or a scale, is off by 3e-2 and more (the bound below)."""
LAYER_BOUND = 1e-1
"""Relative Frobenius error of the FP8 layer (output and every gradient) against the
unquantized one, on these Gaussian weights and tokens: two GEMMs of the recipe's 3.5-4.5e-2
each, in a row; measured 3.1-6.9e-2 (output), up to 9.3e-2 (the router's gradient, through
the top-k weights' gradient, which carries the dX's quantization: 7.3e-2 in the cases below,
9.3e-2 with every token on one expert)."""
QUANTIZED_ABOVE = 1e-2
"""The FP8 output differs from the unquantized one by more than this: a float16 layer is
within 1e-3 of it."""


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    diff = (a - b).norm()
    return 0.0 if diff == 0 else (diff / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------
# The float64 reference: every slot on its own, through the recipe.


def _qdq(t: torch.Tensor) -> torch.Tensor:
    """``t`` quantized per row (its last dim) as the recipe does, and back, in float64."""
    values, scale = quantize_rows_reference(t)
    return values.double() * scale.double().unsqueeze(-1)


class _Round16(torch.autograd.Function):
    """Rounded to float16 both ways: where the kernels store a row (forward) or its gradient."""

    @staticmethod
    def forward(ctx, t):
        return t.half().double()

    @staticmethod
    def backward(ctx, grad):
        return grad.half().double()


class _FP8Linear(torch.autograd.Function):
    """``rw * (qdq(a) @ qdq(w)^T + b)`` for one row ``a`` [K] of an expert ``w`` [N, K], and
    the FP8 path's gradients: the row's ``dy`` quantized per row times ``w`` quantized per
    column (its dX copy); the row weight's gradient the dot of that with the row plus
    ``dy . b``; dW and db from ``rw * dy`` rounded to float16 (the dW operand's rows). The
    row in the backward: ``a``, or for a token row (``token``: the GEMM gathers it) its
    e4m3 values, dequantized to float16."""

    @staticmethod
    def forward(ctx, a, w, b, rw, token):
        ctx.save_for_backward(_qdq(a).half().double() if token else a, w, b, rw)
        out = _qdq(a) @ _qdq(w).T
        return rw * (out if b is None else out + b)

    @staticmethod
    def backward(ctx, dy):
        a, w, b, rw = ctx.saved_tensors
        product = _qdq(dy) @ _qdq(w.T).T
        weighted = (rw * dy).half().double()
        drw = product @ a + (0.0 if b is None else dy @ b)
        return rw * product, torch.outer(weighted, a), None if b is None else weighted, drw, None


class _Linear(torch.autograd.Function):
    """:class:`_FP8Linear` unquantized, in autograd's float64 (no roundings)."""

    @staticmethod
    def forward(ctx, a, w, b, rw, token):
        ctx.save_for_backward(a, w, b, rw)
        return rw * (a @ w.T if b is None else a @ w.T + b)

    @staticmethod
    def backward(ctx, dy):
        a, w, b, rw = ctx.saved_tensors
        product = dy @ w
        drw = product @ a + (0.0 if b is None else dy @ b)
        return rw * product, torch.outer(rw * dy, a), None if b is None else rw * dy, drw, None


def _activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = h.chunk(2)
        return F.silu(gate) * up
    return {"gelu": F.gelu, "relu": F.relu, "identity": lambda v: v}[activation](h)


def _params(layer: MoELayer) -> dict[str, torch.Tensor]:
    named = {"router": layer.router.weight, **dict(layer.experts.named_parameters())}
    return {name: t.detach().double().requires_grad_() for name, t in named.items()}


def _reference(layer: MoELayer, x: torch.Tensor, g: torch.Tensor, quantized: bool = True):
    """``layer``'s output on ``x`` and the gradients of ``sum(y * g)`` (x, then each
    parameter by name), in float64, each slot through ``_FP8Linear`` (``quantized``) or
    ``_Linear``, with float16 roundings where the FP8 kernels store rows (``quantized``)."""
    cfg = layer.config
    p = _params(layer)
    x64 = x.detach().double().requires_grad_()
    rounded = _Round16.apply if quantized else (lambda t: t)
    linear = _FP8Linear.apply if quantized else _Linear.apply
    router = route(x64, p["router"], top_k=cfg.top_k, score_func=cfg.score_func, norm_topk_prob=cfg.norm_topk_prob,
                   router_dtype=torch.float64)
    keep = torch.ones_like(router.topk_ids_TK, dtype=torch.bool)
    if cfg.capacity_factor is not None:
        capacity = expert_capacity(cfg.capacity_factor, x.shape[0], cfg.top_k, cfg.num_experts)
        keep = capacity_keep_mask(router.topk_ids_TK, router.topk_scores_TK, num_experts=cfg.num_experts,
                                  capacity=capacity, drop_policy=cfg.drop_policy)
    one = torch.ones((), dtype=torch.float64)
    rows = []
    for t in range(x.shape[0]):
        y_t = torch.zeros(cfg.hidden_size, dtype=torch.float64)
        for k in range(cfg.top_k):
            e = int(router.topk_ids_TK[t, k])
            if not keep[t, k]:
                continue
            a = rounded(x64[t])  # each slot's dX row is stored before the slots are summed
            if "gate_up" in p:
                h = rounded(linear(a, p["gate_up"][e], p["gate_up_bias"][e] if "gate_up_bias" in p else None, one,
                                   True))
                a = rounded(_activate(h, cfg.activation))
            y_t = y_t + rounded(linear(a, p["down"][e], p["down_bias"][e] if "down_bias" in p else None,
                                       router.topk_weights_TK[t, k], "gate_up" not in p))
        rows.append(y_t)
    y = torch.stack(rows) if rows else torch.zeros(0, cfg.hidden_size, dtype=torch.float64)
    if y.requires_grad:
        (y * g.double()).sum().backward()
    grads = {name: torch.zeros_like(t) if t.grad is None else t.grad for name, t in p.items()}
    return y.detach(), {"x": torch.zeros_like(x64) if x64.grad is None else x64.grad, **grads}, router.counts_E


def _layer_run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor):
    """The layer's output and gradients, as :func:`_reference` returns them."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = layer(x)
    (y * g).sum().backward()
    named = {"router": layer.router.weight, **dict(layer.experts.named_parameters())}
    grads = {name: torch.zeros_like(t) if t.grad is None else t.grad for name, t in named.items()}
    return y.detach(), {"x": x.grad, **grads}


SCENARIOS = {
    "top1": dict(top_k=1),
    "top2": dict(top_k=2),
    "top2_capacity": dict(top_k=2, capacity_factor=0.75),
    "top2_bias": dict(top_k=2, mlp_bias=True),
    "top1_gelu_bias_capacity": dict(top_k=1, activation="gelu", mlp_bias=True, capacity_factor=1.0),
    "one_linear_bias": dict(top_k=2, num_linears=1, activation="identity", intermediate_size=H, mlp_bias=True),
    "all_on_one_expert": dict(top_k=2),
    "one_token": dict(top_k=2),
    "no_tokens": dict(top_k=2),
}


def _scenario(name: str, **overrides):
    """(fp8 layer in float16, tokens, output gradient) of a scenario."""
    torch.manual_seed(list(SCENARIOS).index(name))
    layer = MoELayer(MoEConfig(**{**BASE, **SCENARIOS[name], **overrides})).half()
    tokens = {"one_token": 1, "no_tokens": 0}.get(name, 12)
    x = torch.randn(tokens, H).half()
    if layer.config.mlp_bias:
        with torch.no_grad():
            for name_, p in layer.experts.named_parameters():
                if name_.endswith("bias"):
                    p.normal_(0.0, 0.5)
    if name == "all_on_one_expert":  # every token's first choice expert 2, its second expert 0
        x = x.abs() + 0.1
        with torch.no_grad():
            scales = torch.tensor([-1.0, -1.5, 1.0, -2.0]) * 2 / H  # logits of a few units
            layer.router.weight.copy_(scales[:, None] * torch.rand(E, H).add(0.5))
    return layer, x, torch.randn(tokens, H).half()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fp8_layer_matches_float64_of_the_same_quantization(name):
    layer, x, g = _scenario(name)
    y, grads = _layer_run(layer, x, g)
    y_ref, grads_ref, counts = _reference(layer, x, g)
    assert y.dtype == torch.float16 and y.shape == x.shape
    assert all(t.dtype == torch.float16 for t in grads.values())
    if name == "all_on_one_expert":  # and two experts without tokens
        assert counts.tolist() == [12, 0, 12, 0]
    assert _rel_err(y, y_ref) < SAME_QUANT_TOL, f"output {_rel_err(y, y_ref):.2e}"
    for what, grad in grads.items():
        err = _rel_err(grad, grads_ref[what])
        assert err < SAME_QUANT_TOL, f"{what}: {err:.2e}"
    if name == "no_tokens":
        assert all((t == 0).all() for t in grads.values())


@pytest.mark.parametrize("name", ["top2", "top2_bias"])
def test_fp8_layer_is_quantized_and_within_the_bound_of_the_unquantized_one(name):
    layer, x, g = _scenario(name)
    y, grads = _layer_run(layer, x, g)
    y_ref, grads_ref, _ = _reference(layer, x, g, quantized=False)
    unquantized = MoELayer(MoEConfig(**{**BASE, **SCENARIOS[name], "expert_precision": "bf16", "backend": "triton"}))
    unquantized.half().load_state_dict(layer.state_dict())
    y_16, _ = _layer_run(unquantized, x, g)
    assert _rel_err(y_16, y_ref) < 1e-3  # the same layer without FP8: float16 roundings only
    assert QUANTIZED_ABOVE < _rel_err(y, y_ref) < LAYER_BOUND, f"output {_rel_err(y, y_ref):.2e}"
    for what, grad in grads.items():
        err = _rel_err(grad, grads_ref[what])
        assert err < LAYER_BOUND, f"{what}: {err:.2e}"


# ---------------------------------------------------------------------------------------
# The weights' e4m3 copies.


def _fresh_output(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """What a new layer with ``layer``'s current weights outputs (copies made anew)."""
    twin = MoELayer(layer.config).to(layer.experts.down.dtype)
    twin.load_state_dict(layer.state_dict())
    with torch.no_grad():
        return twin(x)


def test_weights_are_quantized_once_per_optimizer_step(quantizations):
    layer, x, g = _scenario("top2_bias")
    weights = (layer.experts.gate_up, layer.experts.down)

    def made() -> list[str]:
        return ["gate_up" if w is weights[0] else "down" for w in quantizations if any(w is p for p in weights)]

    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    for _ in range(2):  # two micro-batches of one step, then a forward alone: one quantization each
        (layer(x) * g).sum().backward()
    with torch.no_grad():
        before = layer(x)
    assert made() == ["gate_up", "down"]
    optimizer.step()
    with torch.no_grad():
        after = layer(x)
    assert made() == ["gate_up", "down"] * 2
    assert not torch.equal(after, before)
    assert torch.equal(after, _fresh_output(layer, x))  # quantized from the stepped weights

    # FSDP2 writes gathered values into its unsharded parameters keeping their version: the
    # next optimizer step (any torch.optim one) makes the copies again
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(layer.experts.down):
        layer.experts.down.mul_(-1)
    with torch.no_grad():
        assert torch.equal(layer(x), after) and len(made()) == 4  # no version bump, no step: kept
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1).step()
    with torch.no_grad():
        assert torch.equal(layer(x), _fresh_output(layer, x)) and len(made()) == 6


def test_fp32_master_weights_under_autocast_are_quantized_as_they_are(quantizations):
    layer, x, g = _scenario("top2")
    layer.float()
    x32 = x.float()
    with torch.autocast("cpu", dtype=torch.float16):
        y = layer(x32)
        y_again = layer(x32)
    assert y.dtype == torch.float16 and torch.equal(y, y_again)
    (y.float() * g.float()).sum().backward()
    assert [w.dtype for w in quantizations] == [torch.float32, torch.float32]  # the parameters, not casts
    assert {id(w) for w in quantizations} == {id(layer.experts.gate_up), id(layer.experts.down)}
    assert layer.experts.gate_up.grad.dtype == layer.experts.down.grad.dtype == torch.float32
    half = MoELayer(layer.config).half()
    half.load_state_dict(layer.state_dict())
    y_half, grads_half = _layer_run(half, x, g)
    # the fp32 weights hold float16 values here: the same copies as the float16 layer's
    assert _rel_err(y, y_half) < SAME_QUANT_TOL
    assert _rel_err(layer.experts.down.grad, grads_half["down"]) < SAME_QUANT_TOL


def test_ep_code_path_with_fp32_master_weights_under_autocast_matches_ep1_path(monkeypatch):
    """The EP path with no group (the expert pipeline: the weights' stand-ins cast to the
    compute dtype, their dW deferred through the cast; the copies still the parameters'; the
    rows through the e4m3 wire format), fp32 master weights under float16 autocast, against
    the EP=1 path."""
    layer, x, g = _scenario("top2_bias")
    layer.float()

    def run():
        layer.zero_grad(set_to_none=True)
        x32 = x.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            y = layer(x32)
        (y.float() * g.float()).sum().backward()
        return {"y": y.detach(), "x": x32.grad, **{name: p.grad for name, p in layer.named_parameters()}}

    local = run()
    layer.dispatcher = AllToAllDispatcher(layer.config, None, 0, 1, layer.num_local_experts)  # no collective
    sent = []

    def spy(*args, **kwargs):
        sent.append(pack_fp8_rows(*args, **kwargs))
        return sent[-1]

    monkeypatch.setattr("ep_moe.ep.all_to_all.pack_fp8_rows", spy)
    ep = run()
    assert [(t.shape, t.dtype) for t in sent] == [((x.shape[0], wire_width(H)), torch.uint8)]  # the tokens in e4m3
    for what, want in local.items():
        assert ep[what].dtype == want.dtype == (torch.float16 if what == "y" else torch.float32), what
        assert _rel_err(ep[what], want) < SAME_QUANT_TOL, f"{what}: {_rel_err(ep[what], want):.2e}"


# ---------------------------------------------------------------------------------------
# Errors.


def _no_interpreter(monkeypatch, cuda_capability=None):
    """No Triton interpreter; a GPU of ``cuda_capability`` (None: no GPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_capability is not None)
    if cuda_capability is not None:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cuda_capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")


def test_config_and_construction_errors_name_the_fix(monkeypatch):
    small = dict(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=r"MoEConfig.expert_precision='fp4': use one of \('bf16', 'fp8'\)"):
        MoEConfig(**small, expert_precision="fp4")
    with pytest.raises(ValueError, match="backend='torch' is the plain-PyTorch path; pass backend='auto'"):
        MoEConfig(**small, expert_precision="fp8", backend="torch")
    with pytest.raises(ValueError, match="dispatch='all_gather_copy_engine'.*use dispatch='all_gather'"):
        MoEConfig(**small, expert_precision="fp8", dispatch="all_gather_copy_engine")
    fp8 = MoEConfig(**small, expert_precision="fp8")
    with pytest.raises(ValueError, match="expert module Sequential runs as is.*expert_precision='bf16'"):
        MoELayer(fp8, expert_module=nn.Sequential(nn.Linear(16, 16), nn.Tanh()))
    MoELayer(fp8, device="meta")  # deferred init: checked at the first call on a device
    with monkeypatch.context() as patched:
        _no_interpreter(patched)
        with pytest.raises(ValueError, match="FP8 experts run on CUDA GPUs with FP8 tensor cores, not on cpu.*"
                                             "TRITON_INTERPRET=1.*or use expert_precision='bf16'"):
            MoELayer(fp8)
    with monkeypatch.context() as patched:  # built on the CPU for a GPU: the GPU it will run on decides
        _no_interpreter(patched, cuda_capability=(8, 0))
        with pytest.raises(ValueError, match=r"NVIDIA A100 \(compute capability 8.0\) has no FP8 tensor cores"):
            MoELayer(fp8)
    with monkeypatch.context() as patched:
        _no_interpreter(patched, cuda_capability=(9, 0))
        MoELayer(fp8)
    layer = MoELayer(fp8)  # the interpreter was on; at the call it is off
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"FP8 experts \(expert_precision='fp8'\): FP8 experts run on CUDA GPUs"):
        layer(torch.randn(3, 16))


# ---------------------------------------------------------------------------------------
# EP=2 on gloo against EP=1.

EP_CASES = {"all_to_all": dict(top_k=2, dispatch="all_to_all"),
            "all_gather_bias": dict(top_k=2, dispatch="all_gather", mlp_bias=True)}


def _ep_case(name: str, world_size: int):
    """(layer config, the EP=1 state dict, per-rank tokens and output gradients)."""
    torch.manual_seed(5 + list(EP_CASES).index(name))
    config = MoEConfig(**{**BASE, **EP_CASES[name]})
    state = MoELayer(config).half().state_dict()
    for key, value in state.items():
        if "bias" in key:
            state[key] = torch.randn_like(value) * 0.5
    inputs = [torch.randn(6, H).half() for _ in range(world_size)]
    return config, state, inputs, [torch.randn(6, H).half() for _ in range(world_size)]


def _expert_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Each expert tensor's gradient per global expert id."""
    grads = {}
    for name, p in layer.experts.named_parameters():
        for j, e in enumerate(layer.experts.global_ids()):
            grads[f"{name}.{e}"] = p.grad[j].clone()
    return grads


def _ep2_worker(rank, world_size):
    import torch.distributed as dist

    import ep_moe.ep.all_gather as all_gather
    import ep_moe.ep.all_to_all as all_to_all

    sent = []

    def spy(*args, **kwargs):  # the rows' messages: their shapes and dtypes
        message = pack_fp8_rows(*args, **kwargs)
        sent.append((tuple(message.shape), message.dtype))
        return message

    all_gather.pack_fp8_rows = all_to_all.pack_fp8_rows = spy
    out = {}
    for name in EP_CASES:
        config, state, inputs, grads = _ep_case(name, world_size)
        layer = MoELayer(config, dist.group.WORLD).half()
        layer.load_state_dict(state)
        x = inputs[rank].clone().requires_grad_()
        y = layer(x)
        (y * grads[rank]).sum().backward()
        out[name] = dict(y=y.detach(), dx=x.grad, grads=_expert_grads(layer), router=layer.router.weight.grad,
                         dispatch=layer.dispatch, wire=list(sent))
        sent.clear()
    return out


@pytest.mark.distributed
def test_fp8_ep2_on_gloo_matches_ep1():
    results = run_distributed(_ep2_worker, 2)
    for name in EP_CASES:
        config, state, inputs, grads = _ep_case(name, 2)
        layer = MoELayer(config).half()
        layer.load_state_dict(state)
        for rank, (x, g) in enumerate(zip(inputs, grads)):
            x = x.clone().requires_grad_()
            y = layer(x)
            (y * g).sum().backward()  # the EP group's gradients: every rank's tokens
            got = results[rank][name]
            assert got["dispatch"] == config.dispatch
            # the tokens traveled in e4m3 with their scales: one message of wire rows (the
            # all-to-all's quantized for each token's T*min(P, K) (token, rank) pairs, then cut)
            assert len(got["wire"]) == 1 and got["wire"][0][1] == torch.uint8, got["wire"]
            rows = x.shape[0] * (1 if config.dispatch == "all_gather" else min(2, config.top_k))
            assert got["wire"][0][0] == (rows, wire_width(H)) and wire_width(H) < 2 * H
            assert _rel_err(got["y"], y) < SAME_QUANT_TOL, f"{name} rank {rank} output"
            assert _rel_err(got["dx"], x.grad) < SAME_QUANT_TOL, f"{name} rank {rank} dx"
        want = {**_expert_grads(layer), "router": layer.router.weight.grad}
        got = {**results[0][name]["grads"], **results[1][name]["grads"],  # the router's: each rank's tokens
               "router": results[0][name]["router"].float() + results[1][name]["router"].float()}
        assert got.keys() == want.keys()
        for what, grad in want.items():
            assert _rel_err(got[what], grad) < SAME_QUANT_TOL, f"{name} {what}"


# ---------------------------------------------------------------------------------------
# The DeepSpeed drop-in and the trainer.


def test_deepspeed_drop_in_takes_expert_precision():
    torch.manual_seed(3)
    expert = nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H)).half()  # biases: DeepSpeed's usual expert
    fp8 = MoE(H, expert, num_experts=E, k=1, expert_precision="fp8")  # drop_tokens: a capacity
    plain = MoE(H, expert, num_experts=E, k=1, backend="triton")
    assert fp8.layer.config.expert_precision == "fp8" and plain.layer.config.expert_precision == "bf16"
    plain.load_state_dict(fp8.state_dict())
    x = torch.randn(2, 8, H).half()
    torch.manual_seed(4)  # the same random token selection (use_rts) for both
    out, l_aux, counts = fp8(x)
    torch.manual_seed(4)
    out_plain, l_aux_plain, counts_plain = plain(x)
    assert torch.equal(counts, counts_plain) and torch.equal(l_aux, l_aux_plain)
    assert QUANTIZED_ABOVE < _rel_err(out, out_plain) < LAYER_BOUND
    out.float().square().sum().backward()
    assert all(p.grad is not None for p in fp8.layer.experts.parameters())
    with pytest.raises(ValueError, match="MoEConfig.expert_precision='fp4'"):
        MoE(H, expert, num_experts=E, expert_precision="fp4")
    with pytest.raises(ValueError, match="expert module Sequential runs as is"):  # an expert ep_moe cannot read
        MoE(H, nn.Sequential(nn.Linear(H, H), nn.LayerNorm(H)).half(), num_experts=E, expert_precision="fp8")


def test_trainer_config_passes_expert_precision_to_moe_config():
    from ep_moe.train.config import parse_args

    assert parse_args([]).moe_config().expert_precision == "bf16"
    assert parse_args(["--set", "moe.expert_precision='fp8'"]).moe_config().expert_precision == "fp8"
