"""The small-call expert path (torch._grouped_mm, :mod:`ep_moe.grouped_mm_experts`) against a
float64 per-row reference: forward and every gradient, each output placement (scattered to
slots at EP=1, and summed per token there, summed per row of x at EP>1, expert order), gated and plain activations, one
Linear, biases; experts with no rows, all rows on one expert, one token, sizes no block
divides. Then when the layer takes it. CPU in float32 here (``torch._grouped_mm`` runs on the
CPU); the GPU's bf16 run is in tests/gpu/test_layer_cuda.py."""

import pytest
import torch
import torch.nn.functional as F

import ep_moe.experts as experts_mod
import ep_moe.grouped_mm_experts as small
from ep_moe import MoELayer
from ep_moe.experts import activate
from layer_helpers import _config, assert_matches_naive

H, I = 24, 40  # 16-byte fp32 rows, as torch._grouped_mm needs; no block size divides them
ROUTINGS = {  # (tokens, top_k, experts, expert weights): skewed, one hot expert, one token
    "ragged_with_empty": (13, 3, 6, [4.0, 0.0, 1.0, 0.5, 0.0, 2.0]),
    "all_on_one": (9, 1, 4, [0.0, 0.0, 1.0, 0.0]),
    "one_token": (1, 2, 5, [1.0] * 5),
}


def routing(tokens, top_k, num_experts, popularity, seed=0):
    """Sorted routed rows: (slot of each row, rows per expert)."""
    gen = torch.Generator().manual_seed(seed)
    ids_TK = torch.multinomial(torch.tensor(popularity).expand(tokens, -1), top_k, generator=gen)  # distinct
    slot_index_R = torch.argsort(ids_TK.flatten(), stable=True)
    return slot_index_R, torch.bincount(ids_TK.flatten(), minlength=num_experts)


def reference(x, gate_up, down, activation, slot_index_R, m_sizes, top_k, gate_up_bias, down_bias, row_weights_R):
    """Each routed row alone, float64: rows in expert order, weighted."""
    expert_R = torch.repeat_interleave(torch.arange(m_sizes.shape[0]), m_sizes)
    rows = x[slot_index_R // top_k]
    if gate_up is not None:
        h = torch.einsum("rh,rfh->rf", rows, gate_up[expert_R])
        if gate_up_bias is not None:
            h = h + gate_up_bias[expert_R]
        rows = activate(h, activation, "torch")
    y = torch.einsum("ri,rhi->rh", rows, down[expert_R])
    if down_bias is not None:
        y = y + down_bias[expert_R]
    return y * row_weights_R[:, None]


VARIANTS = {  # (activation, two Linears, biases)
    "swiglu": ("swiglu", True, False),
    "gelu_bias": ("gelu", True, True),
    "one_linear_bias": ("identity", False, True),
}


_GROUPED_MM = torch._grouped_mm


class _UndefinedTail(torch.autograd.Function):
    """``torch._grouped_mm`` (2d x 3d) whose rows past the last offset, which it leaves
    undefined, are NaN: in its output and in its input's gradient."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        out = _GROUPED_MM(a, b, offs=offs)
        out[int(offs[-1]):] = float("nan")
        return out

    @staticmethod
    def backward(ctx, dout):
        a, b, offs = ctx.saved_tensors
        da = _GROUPED_MM(dout, b.transpose(-2, -1), offs=offs)
        da[int(offs[-1]):] = float("nan")
        return da, _GROUPED_MM(a.t(), dout, offs=offs), None


def _grouped_mm_with_undefined_tail(a, b, *, offs):
    return _UndefinedTail.apply(a, b, offs)


@pytest.mark.parametrize("placement", ["scatter", "scatter_sum", "sum_slots", "sum_slots_bounded", "expert_order"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(ROUTINGS))
def test_matches_float64_rows(case, variant, placement, monkeypatch):
    tokens, top_k, num_experts, popularity = ROUTINGS[case]
    activation, two_linears, biases = VARIANTS[variant]
    slot_index_R, m_sizes = routing(tokens, top_k, num_experts, popularity)
    if placement.startswith("sum_slots"):  # as at EP>1: this rank has the first experts only
        local = num_experts - 1
        counted = int(m_sizes[:local].sum())
        m_sizes, num_experts = m_sizes[:local], local
        # the all-to-all receives this rank's slots; the all-gathers' rows are a bound, every
        # slot here, whose tail (other ranks' slots) reads token 0
        slot_index_R = slot_index_R if placement == "sum_slots_bounded" else slot_index_R[:counted]
    bounded = placement == "sum_slots_bounded"
    if bounded:  # no row past the count may reach an output or a gradient
        monkeypatch.setattr(torch, "_grouped_mm", _grouped_mm_with_undefined_tail)
    num_rows = slot_index_R.shape[0]
    counted = int(m_sizes.sum())
    fan_in = 2 * I if activation == "swiglu" else I
    g = torch.Generator().manual_seed(1)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    x = leaf(tokens, H)
    gate_up = leaf(num_experts, fan_in, H, scale=H ** -0.5) if two_linears else None
    down = leaf(num_experts, H, I if two_linears else H, scale=I ** -0.5)
    gate_up_bias = leaf(num_experts, fan_in) if biases and two_linears else None
    down_bias = leaf(num_experts, H) if biases else None
    # scatter: weights by output row (the slot); otherwise by routed row
    scatter = placement.startswith("scatter")  # EP=1: every slot routed, rows placed at their slots
    row_weights = torch.rand(tokens * top_k if scatter else num_rows, generator=g).requires_grad_()
    leaves = [t for t in (x, gate_up, down, gate_up_bias, down_bias, row_weights) if t is not None]

    token_index_R = (slot_index_R // top_k) * (torch.arange(num_rows) < counted)

    def run():
        return small.grouped_mm_mlp(
            x, gate_up, down, m_sizes, lambda h: activate(h, activation, "torch"), slot_index_R=slot_index_R,
            token_index_R=token_index_R, top_k=top_k, gate_up_bias=gate_up_bias, down_bias=down_bias,
            row_weights=row_weights, scatter_index=slot_index_R if scatter else None,
            sum_slots="sum" in placement, bounded_rows=bounded)

    got = run()
    with torch.no_grad():  # gathers the tokens directly (no slot copies): the same values
        torch.testing.assert_close(run(), got.detach(), rtol=0, atol=0)

    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    named = dict(zip([n for n, t in zip(("x", "gate_up", "down", "gate_up_bias", "down_bias", "row_weights"),
                                        (x, gate_up, down, gate_up_bias, down_bias, row_weights)) if t is not None],
                     leaves64))
    weights_R = named["row_weights"][slot_index_R] if scatter else named["row_weights"][:counted]
    rows = reference(named["x"], named.get("gate_up"), named["down"], activation, slot_index_R[:counted], m_sizes,
                     top_k, named.get("gate_up_bias"), named.get("down_bias"), weights_R)
    if placement == "scatter":
        want = torch.zeros(tokens * top_k, H, dtype=torch.float64).index_copy(0, slot_index_R, rows)
    elif "sum" in placement:
        want = torch.zeros(tokens, H, dtype=torch.float64).index_add(0, slot_index_R[:counted] // top_k, rows)
    else:
        want = rows
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    dy = torch.randn(want.shape, generator=g)
    grads = torch.autograd.grad(got, leaves, dy)
    grads64 = torch.autograd.grad(want, leaves64, dy.double())
    for name, got_grad, want_grad in zip(named, grads, grads64):
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-5, msg=name)
    if case == "ragged_with_empty":  # experts with no rows: zero gradients, exactly
        empty = m_sizes == 0
        d_down = dict(zip(named, grads))["down"]
        assert empty.any() and torch.equal(d_down[empty], torch.zeros_like(d_down[empty]))


def test_the_layer_uses_it_only_where_it_applies(monkeypatch):
    """On the CPU the predicate says no (CUDA only); with it forced, the EP=1 layer takes the
    path for dropless routing (and matches the float64 loop) but not for dropping routing,
    whose rows have no slot permutation."""
    assert not small.use_grouped_mm(torch.randn(4, 8), (torch.randn(2, 8, 8),), 8, torch.arange(8))
    taken = []

    def forced(x, weights, num_rows, slot_index_R):
        taken.append(slot_index_R is not None)
        return slot_index_R is not None

    monkeypatch.setattr(experts_mod, "use_grouped_mm", forced)
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, num_rows, device: None)
    for case in (dict(top_k=2), dict(top_k=3, activation="gelu")):
        torch.manual_seed(0)
        layer = MoELayer(_config(**case, backend="triton", hidden_size=16, intermediate_size=8))
        x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
        assert_matches_naive(layer, x, g, None)
    assert taken and all(taken)
    taken.clear()
    torch.manual_seed(0)
    layer = MoELayer(_config(top_k=2, capacity_factor=0.625, backend="triton"))
    layer(torch.randn(16, 16))
    assert taken == [False]


def test_the_path_takes_only_what_grouped_mm_can_run(monkeypatch):
    """With the device test passed (as on a Hopper GPU), the predicate still refuses: more rows
    than the bound (twice it for a call autograd records), rows without slots, misaligned or
    non-dense weights."""
    monkeypatch.setattr(small, "_eager_bf16_where_it_runs", lambda x: True)
    x, w, slots = torch.randn(4, 16), torch.randn(2, 24, 16), torch.arange(8)
    assert small.use_grouped_mm(x, (w,), 8, slots)
    assert not small.use_grouped_mm(x, (w,), small.GROUPED_MM_MAX_ROWS + 1, slots)
    trained = w.clone().requires_grad_()  # a call autograd records: up to twice the rows
    assert small.use_grouped_mm(x, (trained,), 2 * small.GROUPED_MM_MAX_ROWS, slots)
    assert not small.use_grouped_mm(x, (trained,), 2 * small.GROUPED_MM_MAX_ROWS + 1, slots)
    with torch.no_grad():
        assert not small.use_grouped_mm(x, (trained,), small.GROUPED_MM_MAX_ROWS + 1, slots)
    assert not small.use_grouped_mm(x, (w,), 0, slots)
    assert not small.use_grouped_mm(x, (w,), 8, None)
    assert not small.use_grouped_mm(x, (torch.randn(2, 20, 16),), 8, slots)  # 20 * 2 bytes: misaligned
    # each expert's matrix transposed (transformers' GPT-OSS layout) is dense: torch._grouped_mm reads it
    assert small.use_grouped_mm(x, (w.transpose(1, 2).contiguous().transpose(1, 2),), 8, slots)
    assert not small.use_grouped_mm(x, (torch.randn(2, 24, 32)[:, :, ::2],), 8, slots)  # strided rows
    assert not small.use_grouped_mm(x, (torch.randn(4, 24, 16)[::2],), 8, slots)  # every other expert


def test_a_graph_warm_up_runs_the_fused_kernels(monkeypatch):
    """Inside ``fused_kernels_only`` (the eager warm-up before a forward graph's capture) a bf16
    CUDA call that would take the small path runs the kernels, as the capture will; after it,
    the small path again."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(small, "_grouped_mm_works", lambda device: True)
    x, w, slots = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(2, 24, 16, dtype=torch.bfloat16), torch.arange(8)
    assert small.use_grouped_mm(x, (w,), 8, slots)
    with small.fused_kernels_only():
        assert not small.use_grouped_mm(x, (w,), 8, slots)
    assert small.use_grouped_mm(x, (w,), 8, slots)


def test_threshold_and_probe():
    """The row bound is a whole number of rows; the probe answers once per device and says
    no where torch._grouped_mm is missing."""
    assert isinstance(small.GROUPED_MM_MAX_ROWS, int) and small.GROUPED_MM_MAX_ROWS > 0
    if not torch.cuda.is_available():
        pytest.skip("the probe runs on a CUDA device")
    assert small._grouped_mm_works(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
