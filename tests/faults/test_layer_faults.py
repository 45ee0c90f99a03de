"""Fault injection for the layer's area: bad and edge-case input to ``MoEConfig``,
``MoELayer`` (its input and its state dicts), the grouped GEMM ops and the routing
functions. Every probe ends clean: the right result for a valid edge case (against the
float64 loop, :func:`layer_helpers.naive_moe`, or the float64 GEMM reference), or an error
whose message names the argument and the fix: ``ValueError`` / ``TypeError``, and for state
dicts the ``RuntimeError`` that ``load_state_dict`` collects its errors in."""

import numpy as np
import pytest
import torch

import ep_moe.experts as experts_mod
from ep_moe import KernelConfig, MoEConfig, MoELayer, grouped_gemm
from ep_moe.kernels.ops import grouped_gemm_slot_sum
from ep_moe.kernels.reference import grouped_gemm_reference
from ep_moe.layer import moe_aux_loss
from ep_moe.routing import build_routing_metadata, capacity_keep_mask, route
from layer_helpers import BASE, E, H, I, _config, assert_matches_naive

pytestmark = pytest.mark.faults

NAN, INF = float("nan"), float("inf")
BACKENDS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def _default_kernel_configs(monkeypatch):
    """Triton runs on the kernels' default configs (large blocks: fast in the interpreter),
    and no autotune cache is read."""
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, num_rows, device: None)
    monkeypatch.delenv("EP_MOE_DEBUG", raising=False)


def _ids(probes):
    return [p[0] for p in probes]


# --- MoEConfig ---------------------------------------------------------------------------

CONFIG_PROBES = [
    ("hidden_size=0", dict(hidden_size=0), ValueError, r"MoEConfig.hidden_size=0: must be a positive int"),
    ("hidden_size<0", dict(hidden_size=-16), ValueError, r"hidden_size=-16: must be a positive int"),
    ("hidden_size float", dict(hidden_size=16.0), ValueError, r"hidden_size=16.0: must be an int"),
    ("hidden_size str", dict(hidden_size="16"), ValueError, r"hidden_size='16': must be an int"),
    ("intermediate_size=0", dict(intermediate_size=0), ValueError, r"intermediate_size=0: must be a positive int"),
    ("num_experts=0", dict(num_experts=0), ValueError, r"num_experts=0: must be a positive int"),
    ("top_k=0", dict(top_k=0), ValueError, r"top_k=0: must be a positive int"),
    ("top_k>E", dict(top_k=E + 1), ValueError, rf"top_k={E + 1} exceeds num_experts={E}; lower top_k to at most"),
    ("top_k bool", dict(top_k=True), ValueError, r"top_k=True: must be an int"),
    ("activation", dict(activation="tanh"), ValueError, r"activation='tanh': use one of \('swiglu', 'gelu'"),
    ("score_func", dict(score_func=None), ValueError, r"score_func=None: use one of \('softmax', 'sigmoid'\)"),
    ("norm_topk_prob str", dict(norm_topk_prob="yes"), ValueError, r"norm_topk_prob='yes': must be True or False"),
    ("aux_loss_coef<0", dict(aux_loss_coef=-0.1), ValueError, r"aux_loss_coef=-0.1: must be >= 0 \(0 disables it\)"),
    ("aux_loss_coef nan", dict(aux_loss_coef=NAN), ValueError, r"aux_loss_coef=nan: must be a finite number"),
    ("z_loss_coef inf", dict(z_loss_coef=INF), ValueError, r"z_loss_coef=inf: must be a finite number"),
    ("bias_update_rate<0", dict(bias_update_rate=-1e-3), ValueError, r"bias_update_rate=-0.001: must be >= 0"),
    ("capacity_factor=0", dict(capacity_factor=0.0), ValueError,
     r"capacity_factor=0.0: must be > 0, or None for dropless routing"),
    ("capacity_factor<0", dict(capacity_factor=-1.0), ValueError, r"capacity_factor=-1.0: must be > 0, or None"),
    ("capacity_factor nan", dict(capacity_factor=NAN), ValueError,
     r"capacity_factor=nan: must be a finite number, or None"),
    ("drop_policy", dict(drop_policy="random"), ValueError, r"drop_policy='random': use one of \('probs', "),
    ("num_shared_experts<0", dict(num_shared_experts=-1), ValueError, r"num_shared_experts=-1: must be an int >= 0"),
    ("shared_intermediate_size=0", dict(num_shared_experts=1, shared_intermediate_size=0), ValueError,
     r"shared_intermediate_size=0: must be a positive int"),
    ("shared size without shared experts", dict(shared_intermediate_size=4), ValueError,
     r"shared_intermediate_size=4 is set but num_shared_experts=0; set num_shared_experts >= 1 or drop it"),
    ("router_dtype int", dict(router_dtype=torch.int64), ValueError,
     r"router_dtype=torch.int64: use a float dtype, normally torch.float32"),
    ("router_dtype str", dict(router_dtype="float32"), ValueError, r"router_dtype='float32': use a float dtype"),
    ("backend", dict(backend="cuda"), ValueError, r"backend='cuda': use one of \('auto', 'triton', 'torch'\)"),
    ("init_std=0", dict(init_std=0.0), ValueError, r"init_std=0.0: must be > 0"),
    ("ep_size=0", dict(ep_size=0), ValueError, r"ep_size=0: must be a positive int that divides num_experts"),
    ("ep_size does not divide", dict(ep_size=3), ValueError,
     rf"num_experts={E} is not divisible by ep_size=3; pick an EP size that divides num_experts"),
    ("dispatch", dict(dispatch="nccl"), ValueError, r"dispatch='nccl': use one of \('auto', 'all_to_all', "),
    ("all_gather_row_bound<0", dict(all_gather_row_bound=-1.0), ValueError,
     r"all_gather_row_bound=-1.0: must be > 0, or None for the worst case"),
    ("unknown field", dict(topk=2), TypeError,
     r"MoEConfig has no field 'topk'; did you mean 'top_k'\? its fields are hidden_size, "),
    ("removed field", dict(transport="nccl"), ValueError, r"MoEConfig.transport no longer exists: the transport"),
]


@pytest.mark.parametrize("name,overrides,error,pattern", CONFIG_PROBES, ids=_ids(CONFIG_PROBES))
def test_config_rejects(name, overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        MoEConfig(**{**BASE, "top_k": 2, **overrides})


def test_config_takes_keywords_only():
    with pytest.raises(TypeError, match=r"MoEConfig takes keyword arguments only, got 4 positional; write "
                                        r"MoEConfig\(hidden_size=\.\.\., "):
        MoEConfig(H, I, E, 2)


def test_config_names_a_missing_field():
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'top_k'"):
        MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E)


# --- MoELayer: bad input -----------------------------------------------------------------

DTYPE_FIX = r"cast x with x.to\(torch.float32\)"
INPUT_PROBES = [
    ("list", lambda: [[0.0] * H], TypeError,
     r"x must be a torch.Tensor \[\.\.\., 16\], got list; convert it with torch.as_tensor"),
    ("numpy", lambda: np.zeros((2, H), dtype=np.float32), TypeError, r"x must be a torch.Tensor .*got ndarray"),
    ("0-dim", lambda: torch.tensor(1.0), ValueError,
     r"x has shape \(\) but the layer's hidden_size is 16; pass x as \[\.\.\., 16\]"),
    ("narrow", lambda: torch.randn(4, 12), ValueError, r"x has shape \(4, 12\) but the layer's hidden_size is 16"),
    ("tokens last", lambda: torch.randn(H, 4), ValueError, r"x has shape \(16, 4\) .*pass x as \[\.\.\., 16\]"),
    ("int64", lambda: torch.ones(4, H, dtype=torch.int64), ValueError,
     rf"x dtype torch.int64 is not supported: the layer takes float32, float16 or bfloat16 input .*; {DTYPE_FIX}$"),
    ("bool", lambda: torch.ones(4, H, dtype=torch.bool), ValueError,
     rf"x dtype torch.bool is not supported.*{DTYPE_FIX}"),
    ("complex64", lambda: torch.ones(4, H, dtype=torch.complex64), ValueError,
     rf"x dtype torch.complex64 is not supported.*{DTYPE_FIX}"),
    ("float64", lambda: torch.randn(4, H, dtype=torch.float64), ValueError,
     rf"x dtype torch.float64 does not match the layer's parameter dtype torch.float32; {DTYPE_FIX}$"),
    ("float16", lambda: torch.randn(4, H, dtype=torch.float16), ValueError,
     rf"x dtype torch.float16 does not match .*; {DTYPE_FIX} or the layer with layer.to\(torch.float16\)$"),
    ("meta device", lambda: torch.randn(4, H, device="meta"), ValueError,
     r"x is on meta but the layer is on cpu; move one of them"),
]


@pytest.mark.parametrize("name,make_x,error,pattern", INPUT_PROBES, ids=_ids(INPUT_PROBES))
def test_layer_rejects_input(name, make_x, error, pattern):
    layer = MoELayer(_config(top_k=2))
    with pytest.raises(error, match=pattern):
        layer(make_x())


def test_layer_rejects_integer_input_under_autocast():
    """Token ids passed for embeddings are refused under autocast too (not cast to bf16)."""
    layer = MoELayer(_config(top_k=2))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"x dtype torch.int64 is not"):
        layer(torch.ones(4, H, dtype=torch.int64))


def test_float64_layer_names_the_expert_dtypes():
    layer = MoELayer(_config(top_k=2), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the layer computes in torch.float64, but its experts run in float32, "
                                         r"float16 or bfloat16; cast the layer \(layer.float\(\)\) and x"):
        layer(torch.randn(4, H, dtype=torch.float64))


NONFINITE_PROBES = [
    ("one nan", [(0, 3, NAN)], 1),
    ("inf and -inf in one token", [(2, 0, INF), (2, 5, -INF)], 1),
    ("three tokens", [(0, 0, NAN), (4, 1, INF), (6, 15, -INF)], 3),
    ("every token", [(t, 0, NAN) for t in range(8)], 8),
]


@pytest.mark.parametrize("name,cells,count", NONFINITE_PROBES, ids=_ids(NONFINITE_PROBES))
def test_debug_mode_counts_nonfinite_tokens(name, cells, count, monkeypatch):
    layer = MoELayer(_config(top_k=2))
    x = torch.randn(8, H)
    for t, h, value in cells:
        x[t, h] = value
    monkeypatch.setenv("EP_MOE_DEBUG", "1")
    with pytest.raises(ValueError, match=rf"x has {count} of 8 tokens with NaN or inf values \(EP_MOE_DEBUG"):
        layer(x)


@pytest.mark.parametrize("debug", [None, "0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nonfinite_token_stays_in_its_row_without_debug_mode(backend, debug, monkeypatch):
    """Without EP_MOE_DEBUG (unset or 0) the layer checks nothing (no host sync): a NaN
    token's output is NaN, every other token's output is the one it has without it."""
    if debug is not None:
        monkeypatch.setenv("EP_MOE_DEBUG", debug)
    torch.manual_seed(0)
    layer = MoELayer(_config(top_k=2, backend=backend))
    x = torch.randn(9, H)
    clean = layer(x)
    x[4, 2] = NAN
    y = layer(x)
    assert not y[4].isfinite().any()
    rest = torch.arange(9) != 4
    torch.testing.assert_close(y[rest], clean[rest])


# --- MoELayer: valid edge cases, against the float64 loop --------------------------------

def _one_expert_layer(cfg):
    """A layer whose router sends every positive token to expert 0 first (then expert 1)."""
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
        layer.router.weight[1] = 0.5
    return layer


EDGE_PROBES = [
    ("one token", dict(top_k=2), lambda: torch.randn(1, H)),
    ("1-D token", dict(top_k=2), lambda: torch.randn(H)),
    ("4-D batch", dict(top_k=2), lambda: torch.randn(2, 1, 3, H)),
    ("top_k == num_experts", dict(top_k=E), lambda: torch.randn(5, H)),
    ("one expert", dict(top_k=1, num_experts=1), lambda: torch.randn(6, H)),
    ("sizes of no block", dict(hidden_size=20, intermediate_size=12, num_experts=3, top_k=2, activation="gelu"),
     lambda: torch.randn(7, 20)),
    ("transposed x", dict(top_k=2), lambda: torch.randn(H, 6).t()),
    ("every other token", dict(top_k=2), lambda: torch.randn(12, H)[::2]),
    ("one token repeated (stride 0)", dict(top_k=3), lambda: torch.randn(1, H).expand(5, H)),
    ("capacity keeps one slot", dict(top_k=2, capacity_factor=1e-3), lambda: torch.randn(8, H)),
    ("capacity past every slot", dict(top_k=2, capacity_factor=100.0), lambda: torch.randn(8, H)),
    ("sigmoid, no renormalisation", dict(top_k=3, score_func="sigmoid", norm_topk_prob=False),
     lambda: torch.randn(6, H)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,overrides,make_x", EDGE_PROBES, ids=_ids(EDGE_PROBES))
def test_layer_edge_case_matches_loop(name, overrides, make_x, backend):
    torch.manual_seed(1)
    layer = MoELayer(_config(**overrides, backend=backend))
    x = make_x()
    assert_matches_naive(layer, x, torch.randn(x.shape))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (1, 1.0)])
def test_every_token_on_one_expert_matches_loop(top_k, capacity_factor, backend):
    torch.manual_seed(2)
    layer = _one_expert_layer(_config(top_k=top_k, capacity_factor=capacity_factor, backend=backend))
    x = torch.rand(10, H) + 0.1
    dropped = assert_matches_naive(layer, x, torch.randn(10, H))
    assert layer.last_stats.tokens_per_expert[0] == 10
    assert dropped == (0 if capacity_factor is None else 8)  # capacity ceil(10 / 8) = 2 of expert 0's 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_bias_that_picks_one_expert_matches_loop(backend):
    torch.manual_seed(3)
    layer = MoELayer(_config(top_k=2, expert_bias=True, backend=backend))
    bias_E = torch.zeros(E)
    bias_E[6] = 5.0
    layer.expert_bias.copy_(bias_E)
    assert_matches_naive(layer, torch.randn(7, H), torch.randn(7, H), bias_E)
    assert layer.last_stats.tokens_per_expert[6] == 7


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_layer_matches_loop(backend):
    torch.manual_seed(4)
    layer = MoELayer(_config(top_k=2, backend=backend), dtype=torch.float16)
    x = torch.randn(6, H).half()
    assert_matches_naive(layer, x, torch.randn(6, H).half(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, H), (2, 0, H)])
def test_zero_tokens(shape, backend):
    layer = MoELayer(_config(top_k=2, backend=backend, num_shared_experts=1))
    x = torch.randn(shape, requires_grad=True)
    y = layer(x)
    (y.sum() + moe_aux_loss(layer)).backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert layer.last_stats.tokens_per_expert.tolist() == [0] * E and int(layer.last_stats.num_dropped) == 0
    assert layer.last_stats.aux_loss.item() == 0 and layer.last_stats.z_loss.item() == 0
    assert layer.experts.gate_up.grad is None or not layer.experts.gate_up.grad.any()


# --- MoELayer: state dicts ---------------------------------------------------------------

def _layer_and_state(**overrides):
    torch.manual_seed(5)
    layer = MoELayer(_config(top_k=2, **overrides))
    return layer, layer.state_dict()


@pytest.mark.parametrize("key", ["experts.gate_up.99", "experts.down.8", "experts.gate_up.07", "experts.down.-1",
                                 "experts.gate_up.first", "experts.gate_up.1.weight"])
def test_load_reports_a_key_of_no_expert(key):
    layer, state = _layer_and_state()
    state[key] = state["experts.gate_up.0"]
    with pytest.raises(RuntimeError, match=rf'Unexpected key\(s\) in state_dict: "{key}"'):
        layer.load_state_dict(state)
    assert layer.load_state_dict(state, strict=False).unexpected_keys == [key]


def test_load_of_a_bigger_layers_state_reports_its_extra_experts():
    _, state = _layer_and_state(num_experts=2 * E)
    del state["router.weight"]  # [2E, H]: a size mismatch of its own
    layer = MoELayer(_config(top_k=2))
    result = layer.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [f"experts.{n}.{g}" for n in ("gate_up", "down") for g in range(E, 2 * E)]
    assert result.missing_keys == ["router.weight"]
    assert torch.equal(layer.state_dict()["experts.down.3"], state["experts.down.3"])


BAD_EXPERT_PROBES = [
    ("one expert narrow", {"experts.gate_up.2": torch.zeros(3, H)},
     [rf"size mismatch for experts.gate_up.2: copying a param with shape \(3, {H}\) from checkpoint, the shape in "
      rf"current model is \({2 * I}, {H}\)"]),
    ("every down transposed", {f"experts.down.{g}": torch.zeros(I, H) for g in range(E)},
     [rf"size mismatch for experts.down.{g}: copying a param with shape \({I}, {H}\)" for g in (0, E - 1)]),
    ("gelu layout into swiglu", {"experts.gate_up.5": torch.zeros(I, H)},
     [r"experts.gate_up.5: .*shape in current model is \(16, 16\); load a checkpoint of a layer with the same "
      r"hidden_size, intermediate_size and activation"]),
    ("extra dim", {"experts.down.1": torch.zeros(1, H, I)}, [rf"experts.down.1: copying a param with shape "
                                                              rf"\(1, {H}, {I}\)"]),
    ("a list", {"experts.down.4": [0.0]}, [r"expert weight experts.down.4 is a list, not a tensor of shape \(16, 8\)"]),
    ("None", {"experts.gate_up.0": None}, [r"expert weight experts.gate_up.0 is a NoneType"]),
]


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("name,bad,patterns", BAD_EXPERT_PROBES, ids=_ids(BAD_EXPERT_PROBES))
def test_load_names_a_bad_expert_and_keeps_its_weights(name, bad, patterns, strict):
    layer, state = _layer_and_state()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError) as err:
        layer.load_state_dict({**state, **bad}, strict=strict)
    for pattern in patterns:
        assert err.match(pattern)
    after = layer.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in bad)


def test_load_names_missing_experts_and_keeps_them():
    layer, state = _layer_and_state()
    before = layer.experts.down.detach().clone()
    del state["experts.down.3"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "experts.down.3"'):
        layer.load_state_dict(state)
    assert layer.load_state_dict(state, strict=False).missing_keys == ["experts.down.3"]
    assert torch.equal(layer.experts.down[3], before[3])


def test_load_converts_float16_experts():
    layer, state = _layer_and_state()
    half = {k: v.half() for k, v in state.items()}
    layer.load_state_dict(half)
    assert layer.experts.gate_up.dtype == torch.float32
    torch.testing.assert_close(layer.state_dict()["experts.gate_up.4"], half["experts.gate_up.4"].float())


def test_load_takes_stacked_experts():
    """``experts.gate_up`` / ``experts.down`` as one [E, ...] tensor each load as they are."""
    layer, state = _layer_and_state()
    stacked = {k: v for k, v in state.items() if not k.startswith("experts.")}
    stacked["experts.gate_up"] = torch.stack([state[f"experts.gate_up.{g}"] for g in range(E)])
    stacked["experts.down"] = torch.stack([state[f"experts.down.{g}"] for g in range(E)])
    other = MoELayer(_config(top_k=2))
    other.load_state_dict(stacked)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())


def test_assign_load_into_a_meta_layer_reports_a_missing_expert():
    """A meta layer has no weights to keep for a missing expert: that expert and its
    stacked parameter are reported missing (not a device error from torch.stack)."""
    _, state = _layer_and_state()
    del state["experts.down.1"]
    layer = MoELayer(_config(top_k=2), device="meta")
    result = layer.load_state_dict(state, assign=True, strict=False)
    assert result.missing_keys == ["experts.down.1", "experts.down"]
    assert layer.experts.gate_up.device.type == "cpu" and layer.experts.down.is_meta


def test_load_of_a_wrong_router_names_it():
    layer, state = _layer_and_state()
    state["router.weight"] = torch.zeros(E + 1, H)
    with pytest.raises(RuntimeError, match=r"size mismatch for router.weight"):
        layer.load_state_dict(state)


# --- grouped GEMM: bad arguments ---------------------------------------------------------

def _gemm_args(**over):
    args = dict(x=torch.randn(6, 8), w=torch.randn(2, 4, 8), m_sizes=torch.tensor([2, 4], dtype=torch.int32))
    return {**args, **over}


GEMM_PROBES = [
    ("x numpy", dict(x=np.zeros((6, 8), np.float32)), {}, TypeError,
     r"x must be a torch.Tensor, got ndarray; convert it with torch.as_tensor"),
    ("w list", dict(w=[[[0.0] * 8] * 4] * 2), {}, TypeError, r"w must be a torch.Tensor, got list"),
    ("m_sizes list", dict(m_sizes=[2, 4]), {}, TypeError, r"m_sizes must be a torch.Tensor, got list"),
    ("x 1-D", dict(x=torch.randn(8)), {}, ValueError, r"x must be 2-D \[rows, K\], got shape \(8,\)"),
    ("x 3-D", dict(x=torch.randn(6, 8, 1)), {}, ValueError, r"x must be 2-D"),
    ("w 2-D", dict(w=torch.randn(4, 8)), {}, ValueError, r"w must be 3-D \[E, N, K\], got shape \(4, 8\)"),
    ("w [E, K, N]", dict(w=torch.randn(2, 8, 4)), {}, ValueError,
     r"x has K=8 columns but w is \[E, N, K\] with K=4; pass w as \[E, N, K\] \(out_features before in_features\)"),
    ("x int32", dict(x=torch.ones(6, 8, dtype=torch.int32)), {}, ValueError,
     r"x dtype torch.int32 is not supported; use float16, bfloat16 or float32"),
    ("x float64", dict(x=torch.randn(6, 8, dtype=torch.float64), w=torch.randn(2, 4, 8, dtype=torch.float64)), {},
     ValueError, r"x dtype torch.float64 is not supported"),
    ("w float16", dict(w=torch.randn(2, 4, 8).half()), {}, ValueError,
     r"w dtype torch.float16 does not match x dtype torch.float32; cast one of them"),
    ("w on meta", dict(w=torch.randn(2, 4, 8, device="meta")), {}, ValueError,
     r"w is on meta but x is on cpu; move both to one device"),
    ("m_sizes on meta", dict(m_sizes=torch.tensor([2, 4], device="meta")), {}, ValueError,
     r"m_sizes is on meta but x is on cpu; keep the counts on x's device"),
    ("m_sizes per row", dict(m_sizes=torch.ones(6, dtype=torch.int32)), {}, ValueError,
     r"m_sizes must be 1-D with one count per expert \(2\), got shape \(6,\)"),
    ("m_sizes float", dict(m_sizes=torch.tensor([2.0, 4.0])), {}, ValueError,
     r"m_sizes must be int32 or int64, got torch.float32; convert with .to\(torch.int32\)"),
    ("m_sizes negative", dict(m_sizes=torch.tensor([7, -1])), {}, ValueError,
     r"m_sizes has negative counts; pass each expert's number of rows"),
    ("m_sizes short", dict(m_sizes=torch.tensor([2, 3])), {}, ValueError,
     r"m_sizes sums to 5 but there are 6 routed rows \(rows of x\); counts must cover every row exactly once"),
    ("m_sizes long", dict(m_sizes=torch.tensor([3, 4])), {}, ValueError, r"m_sizes sums to 7 but there are 6"),
    ("gather list", {}, dict(gather_index=[0, 1, 2, 3, 4, 5]), TypeError, r"gather_index must be a torch.Tensor"),
    ("gather 2-D", {}, dict(gather_index=torch.zeros(6, 1, dtype=torch.int64)), ValueError,
     r"gather_index must be 1-D"),
    ("gather float", {}, dict(gather_index=torch.zeros(6)), ValueError,
     r"gather_index must be int32 or int64, got torch.float32; convert with .to\(torch.int32\)"),
    ("gather past x", {}, dict(gather_index=torch.tensor([0, 1, 2, 3, 4, 6])), ValueError,
     r"gather_index has entries outside \[0, 6\) \(the rows of x\); index rows of x only"),
    ("gather negative", {}, dict(gather_index=torch.tensor([0, 1, 2, 3, 4, -1])), ValueError,
     r"gather_index has entries outside \[0, 6\)"),
    ("gather on meta", {}, dict(gather_index=torch.zeros(6, dtype=torch.int64, device="meta")), ValueError,
     r"gather_index is on meta but x is on cpu; move it with .to\(x.device\)"),
    ("scatter short", {}, dict(scatter_index=torch.arange(5)), ValueError,
     r"scatter_index must be 1-D with 6 entries \(one per routed row\)"),
    ("scatter repeats", {}, dict(scatter_index=torch.tensor([0, 1, 2, 3, 4, 4])), ValueError,
     r"scatter_index must be a permutation: every output row written exactly once"),
    ("scatter past rows", {}, dict(scatter_index=torch.tensor([0, 1, 2, 3, 4, 6])), ValueError,
     r"scatter_index has entries outside \[0, 6\); pass a permutation of the 6 output rows"),
    ("row_weights short", {}, dict(row_weights=torch.rand(5)), ValueError,
     r"row_weights must be 1-D with 6 entries \(one per output row\), got shape \(5,\)"),
    ("row_weights [M, 1]", {}, dict(row_weights=torch.rand(6, 1)), ValueError, r"row_weights must be 1-D"),
    ("row_weights int", {}, dict(row_weights=torch.ones(6, dtype=torch.int64)), ValueError,
     r"row_weights must be a float tensor, got torch.int64; convert with .float\(\)"),
    ("row_weights on meta", {}, dict(row_weights=torch.rand(6, device="meta")), ValueError,
     r"row_weights is on meta but the rows are on cpu; move it to their device"),
    ("bounded with scatter", {}, dict(scatter_index=torch.arange(6), bounded_rows=True), ValueError,
     r"bounded_rows=True does not take a scatter_index .*; sum the rows with row_of_slot instead"),
    ("backend", {}, dict(backend="cuda"), ValueError, r"backend='cuda': use 'auto', 'triton' or 'torch'"),
    ("configs a KernelConfig", {}, dict(configs=KernelConfig()), ValueError,
     r"configs must be a GemmConfigs .* got KernelConfig; wrap one config c as GemmConfigs\(forward=c, dx=c, dw=c\)"),
    ("unique_gather broken", {}, dict(gather_index=torch.tensor([0, 0, 1, 2, 3, 4]), unique_gather=True), ValueError,
     r"unique_gather=True but gather_index reads some rows of x more than once; pass unique_gather=False"),
]


@pytest.mark.parametrize("name,over,kwargs,error,pattern", GEMM_PROBES, ids=_ids(GEMM_PROBES))
def test_grouped_gemm_rejects(name, over, kwargs, error, pattern):
    args = _gemm_args(**over)
    with pytest.raises(error, match=pattern):
        grouped_gemm(args["x"], args["w"], args["m_sizes"], **kwargs)


def _slot_sum_args(**over):
    gen = torch.Generator().manual_seed(6)
    meta = build_routing_metadata(torch.randint(0, 3, (5, 2), generator=gen), 3)
    args = dict(a=torch.randn(10, 8, generator=gen), w=torch.randn(3, 16, 8, generator=gen), m_sizes=meta.counts_E,
                row_weights=torch.rand(10, generator=gen), token_index=meta.token_index_R,
                row_of_slot=meta.row_of_slot_N, top_k=2)
    return {**args, **over}


SLOT_SUM_PROBES = [
    ("a float64", dict(a=torch.randn(10, 8, dtype=torch.float64)), ValueError,
     r"a dtype torch.float64 is not supported"),
    ("w [E, K, N]", dict(w=torch.randn(3, 8, 16)), ValueError, r"a has K=8 columns but w is \[E, N, K\] with K=16"),
    ("m_sizes short", dict(m_sizes=torch.tensor([4, 4])), ValueError, r"m_sizes must be 1-D with one count per expert"),
    ("m_sizes sum", dict(m_sizes=torch.tensor([4, 4, 4])), ValueError, r"m_sizes sums to 12 but there are 10 routed"),
    ("row_weights short", dict(row_weights=torch.rand(3)), ValueError,
     r"row_weights must be 1-D with 10 entries \(one per row of a\)"),
    ("token_index short", dict(token_index=torch.zeros(4, dtype=torch.int64)), ValueError,
     r"token_index must be 1-D with 10 entries"),
    ("token_index list", dict(token_index=list(range(10))), TypeError, r"token_index must be a torch.Tensor"),
    ("top_k 0", dict(top_k=0), ValueError, r"top_k must be a positive int \(slots per token\), got 0"),
    ("top_k tensor", dict(top_k=torch.tensor(2)), ValueError, r"top_k must be a positive int"),
    ("row_of_slot not per slot", dict(top_k=3), ValueError,
     r"row_of_slot must be 1-D with top_k=3 entries per token \(slot t\*K \+ k\), got shape \(10,\)"),
    ("row_of_slot float", dict(row_of_slot=torch.zeros(10)), ValueError, r"row_of_slot must be int32 or int64"),
    ("row_of_slot past a", dict(row_of_slot=torch.full((10,), 10)), ValueError,
     r"row_of_slot has entries outside \[-1, 10\) \(a routed row of a, or -1 for none\)"),
]


@pytest.mark.parametrize("name,over,error,pattern", SLOT_SUM_PROBES, ids=_ids(SLOT_SUM_PROBES))
def test_grouped_gemm_slot_sum_rejects(name, over, error, pattern):
    args = _slot_sum_args(**over)
    with pytest.raises(error, match=pattern):
        grouped_gemm_slot_sum(*args.values())


# --- grouped GEMM: valid edge cases, against the float64 reference ------------------------

def _gemm_problem(m_sizes, n, k, gather=False):
    gen = torch.Generator().manual_seed(7)
    rows = sum(m_sizes)
    x = torch.randn(max(rows, 1) if gather else rows, k, generator=gen)
    w = torch.randn(len(m_sizes), n, k, generator=gen) / max(k, 1) ** 0.5
    gather_index = torch.randint(0, x.shape[0], (rows,), generator=gen) if gather else None
    return x, w, torch.tensor(m_sizes, dtype=torch.int64), gather_index


GEMM_EDGES = [
    ("no rows", ([0, 0, 0], 24, 20)),
    ("one row", ([0, 1], 24, 20)),
    ("every row on one expert", ([0, 23, 0], 40, 33)),
    ("sizes of no block", ([5, 0, 17, 3], 37, 45)),
    ("tiny K and N", ([2, 3], 5, 3)),
    ("no experts", ([], 8, 8)),
]


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("name,problem", GEMM_EDGES, ids=_ids(GEMM_EDGES))
def test_grouped_gemm_edge_case_matches_reference(name, problem, gather):
    x, w, m_sizes, gather_index = _gemm_problem(*problem, gather=gather)
    _check_gemm(x, w, m_sizes, gather_index)


def _check_gemm(x, w, m_sizes, gather_index=None, **kwargs):
    """Triton forward and gradients of x and w against the float64 reference."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = grouped_gemm(x, w, m_sizes, gather_index=gather_index, backend="triton", **kwargs)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = grouped_gemm_reference(x64, w64, m_sizes, gather_index=gather_index)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    if y.numel():
        dy = torch.randn(y.shape)
        got = torch.autograd.grad(y, (x, w), dy)
        want = torch.autograd.grad(ref, (x64, w64), dy.double())
        for g, r in zip(got, want):
            torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)


LAYOUT_PROBES = [
    ("transposed x", lambda x, w: (x.t().contiguous().t(), w)),
    ("every other row of x", lambda x, w: (torch.stack([x, x], 1).reshape(-1, x.shape[1])[::2], w)),
    ("transposed w", lambda x, w: (x, w.transpose(1, 2).contiguous().transpose(1, 2))),
    ("one expert's w for all (stride 0)", lambda x, w: (x, w[:1].expand_as(w))),
]


@pytest.mark.parametrize("name,relayout", LAYOUT_PROBES, ids=_ids(LAYOUT_PROBES))
def test_grouped_gemm_takes_any_layout(name, relayout):
    x, w, m_sizes, _ = _gemm_problem([4, 0, 5], 24, 20)
    x2, w2 = relayout(x, w)
    assert x2.is_contiguous() != x.is_contiguous() or w2.is_contiguous() != w.is_contiguous()
    _check_gemm(x2, w2, m_sizes)


def test_grouped_gemm_keeps_a_nan_row_to_itself():
    """A NaN in one routed row poisons that row's output only (no tile neighbour)."""
    x, w, m_sizes, _ = _gemm_problem([5, 6], 24, 20)
    x[3, 7] = NAN
    y = grouped_gemm(x, w, m_sizes, backend="triton")
    assert not y[3].isfinite().any() and y[torch.arange(11) != 3].isfinite().all()


def test_grouped_gemm_float16_and_float64_row_weights():
    x, w, m_sizes, _ = _gemm_problem([3, 4], 24, 20)
    rw = torch.rand(7, dtype=torch.float64)
    y = grouped_gemm(x.half(), w.half(), m_sizes, row_weights=rw, backend="triton")
    ref = grouped_gemm_reference(x.double(), w.double(), m_sizes, row_weights=rw)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_grouped_gemm_slot_sum_with_few_tokens(num_tokens):
    gen = torch.Generator().manual_seed(8)
    meta = build_routing_metadata(torch.randint(0, 3, (num_tokens, 2), generator=gen), 3)
    a, w = torch.randn(2 * num_tokens, 8, generator=gen), torch.randn(3, 16, 8, generator=gen)
    rw = torch.rand(2 * num_tokens, generator=gen)
    out = grouped_gemm_slot_sum(a, w, meta.counts_E, rw, meta.token_index_R, meta.row_of_slot_N, 2)
    rows = grouped_gemm_reference(a.double(), w.double(), meta.counts_E, row_weights=rw.double())
    want = torch.zeros(num_tokens, 16, dtype=torch.float64).index_add_(0, meta.token_index_R, rows)
    assert out.shape == (num_tokens, 16)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# --- routing functions -------------------------------------------------------------------

def _route_args(**over):
    gen = torch.Generator().manual_seed(9)
    args = dict(x_TH=torch.randn(6, H, generator=gen), weight_EH=torch.randn(E, H, generator=gen), top_k=2)
    return {**args, **over}


ROUTE_PROBES = [
    ("top_k > experts", dict(top_k=E + 1), rf"route: top_k={E + 1} must be in \[1, {E}\] \(weight_EH has {E} "
                                           r"experts\); lower top_k or add experts"),
    ("top_k 0", dict(top_k=0), r"route: top_k=0 must be in \[1, 8\]"),
    ("hidden mismatch", dict(weight_EH=torch.randn(E, H - 1)),
     r"route: x_TH \(6, 16\) and weight_EH \(8, 15\) must be \[T, H\] and \[E, H\] with the same H; pass the "
     r"tokens flattened to \[T, H\] and the router weight as \[num_experts, H\]"),
    ("x not flattened", dict(x_TH=torch.randn(2, 3, H)), r"route: x_TH \(2, 3, 16\) .*pass the tokens flattened"),
    ("weight 3-D", dict(weight_EH=torch.randn(1, E, H)), r"route: x_TH \(6, 16\) and weight_EH \(1, 8, 16\)"),
    ("expert bias per token", dict(expert_bias_E=torch.zeros(6, E)),
     r"route: expert_bias_E has shape \(6, 8\); pass one bias per expert, shape \(8,\)"),
    ("expert bias too short", dict(expert_bias_E=torch.zeros(E - 1)), r"expert_bias_E has shape \(7,\)"),
    ("router_dtype int", dict(router_dtype=torch.int32),
     r"route: router_dtype=torch.int32 must be a float dtype, normally torch.float32"),
    ("score_func", dict(score_func="tanh"), r"score_func='tanh': use 'softmax' or 'sigmoid'"),
]


@pytest.mark.parametrize("name,over,pattern", ROUTE_PROBES, ids=_ids(ROUTE_PROBES))
def test_route_rejects(name, over, pattern):
    with pytest.raises(ValueError, match=pattern):
        route(**_route_args(**over))


def test_capacity_keep_mask_rejects_an_unknown_policy():
    out = route(**_route_args())
    with pytest.raises(ValueError, match=r"drop_policy='random': use 'probs' or 'position'"):
        capacity_keep_mask(out.topk_ids_TK, out.topk_scores_TK, num_experts=E, capacity=1, drop_policy="random")


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_route_few_tokens(num_tokens):
    out = route(**_route_args(x_TH=torch.randn(num_tokens, H)), aux_loss_coef=1.0, z_loss_coef=1.0)
    assert out.topk_ids_TK.shape == (num_tokens, 2) and out.counts_E.sum() == 2 * num_tokens
    assert out.aux_loss.isfinite() and out.z_loss.isfinite()
    meta = build_routing_metadata(out.topk_ids_TK, E)
    assert meta.slot_index_R.shape == (2 * num_tokens,) and meta.counts_E.tolist() == out.counts_E.tolist()


def test_route_ties_pick_distinct_experts():
    """All-equal logits: each token still gets top_k distinct experts, with equal weights."""
    out = route(torch.zeros(5, H), torch.zeros(E, H), top_k=3)
    assert all(len(set(row)) == 3 for row in out.topk_ids_TK.tolist())
    torch.testing.assert_close(out.topk_weights_TK, torch.full((5, 3), 1 / 3))


def test_route_keeps_a_nan_token_to_itself():
    """A NaN token gets expert ids in range (so later gathers stay in bounds) and leaves the
    other tokens' choice and weights alone."""
    args = _route_args()
    clean = route(**args)
    args["x_TH"][2, 0] = NAN
    out = route(**args)
    assert ((out.topk_ids_TK >= 0) & (out.topk_ids_TK < E)).all()
    rest = torch.arange(6) != 2
    assert torch.equal(out.topk_ids_TK[rest], clean.topk_ids_TK[rest])
    torch.testing.assert_close(out.topk_weights_TK[rest], clean.topk_weights_TK[rest])


@pytest.mark.parametrize("capacity,kept", [(0, 0), (1, None), (100, 12)])
def test_capacity_keep_mask_bounds(capacity, kept):
    out = route(**_route_args())
    keep_TK = capacity_keep_mask(out.topk_ids_TK, out.topk_scores_TK, num_experts=E, capacity=capacity)
    per_expert = torch.bincount(out.topk_ids_TK[keep_TK], minlength=E)
    assert (per_expert <= capacity).all()
    assert int(keep_TK.sum()) == (int((out.counts_E > 0).sum()) if kept is None else kept)
