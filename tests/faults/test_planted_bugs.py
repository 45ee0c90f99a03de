"""Tests that would have let real bugs through (issue 46, part 5), each shown to fail with the
bug planted (the planted change is named in each test's docstring):

- the forward graphs' cache key, checked field by field (dtype, autocast, mode, layout,
  addresses): a same-shape call in any other state must not replay a graph;
- values where floor and ceil differ (the all-gather's row bound at 1.25 x 3 tokens x top-3);
- gradients that were never compared (the top-k weights w.r.t. the router logits, the
  losses, the slot sum's weights);
- groups that coincide with the world (EP=2 x DP=2 at world 4: the trainer's gradient
  clipping, the debug checks' all-reduce, the first call's config agreement).
"""

import contextlib
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ep_moe.experts as experts_mod
import ep_moe.forward_graphs as fg
from dist_utils import run_distributed
from ep_moe import MoELayer
from ep_moe.ep.all_gather import gathered_routing, row_bound
from ep_moe.routing import combine_slots, route
from layer_helpers import E, H, _config
from test_forward_graphs import fake_graph_runtime
from test_train_clip import CLIP_FRACTION, VOCAB, _clipped
from test_train_clip import _model as _clip_model

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _default_kernel_configs(monkeypatch):
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, num_rows, device: None)
    monkeypatch.delenv("EP_MOE_DEBUG", raising=False)


# --- the forward graphs' key ---------------------------------------------------------------


class _Replay:
    """A stand-in for a CUDA graph: counts its replays (which rerun nothing: what comes out is
    the capture's output, as a real replay of a stale graph would hand out)."""

    count = 0

    def replay(self):
        _Replay.count += 1


@pytest.fixture
def graphs(monkeypatch):
    """A layer's ForwardGraphs with the capture, streams and events faked; returns
    ``call(layer, x) -> (y, replayed)``."""

    def fake_capture(owner, xs, eager, pool):
        x_in = tuple(t.clone() for t in xs)
        return fg._Graph(_Replay(), x_in, eager(*x_in).clone(), owner.call_outputs())

    fake_graph_runtime(monkeypatch, fake_capture)

    def call(layer, x):
        before = _Replay.count
        with torch.no_grad():
            y = layer.forward_graphs(layer, x, layer._eager_forward)
        return y, _Replay.count > before

    return call


@contextlib.contextmanager
def _cuda_autocast(enabled, dtype):
    """CUDA autocast's state as the key reads it (settable without a GPU)."""
    saved = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", saved[0])
        torch.set_autocast_dtype("cuda", saved[1])


def _captured(call, layer, x, context=contextlib.nullcontext):
    """``x``'s shape called until its graph replays."""
    for _ in range(fg.CAPTURE_AFTER_CALLS + 1):
        with context():
            call(layer, x)
    with context():
        assert call(layer, x)[1], "the graph of this shape replays"


def test_a_same_shape_input_of_another_dtype_never_replays(graphs):
    """Planted: the key without ``t.dtype`` (forward_graphs.py, ForwardGraphs.__call__):
    the float16 input replays the float32 graph, copied into its input, and returns the
    float32 graph's output instead of the layer's dtype error."""
    layer = MoELayer(_config(top_k=2, backend="triton"))
    x = torch.randn(3, H)
    _captured(graphs, layer, x)
    with pytest.raises(ValueError, match=r"x dtype torch.float16 does not match the layer's parameter dtype"):
        graphs(layer, x.half())
    assert graphs(layer, x)[1]  # the float32 graph still replays for float32


@pytest.mark.parametrize("change", ["autocast dtype", "autocast on", "autocast off"])
def test_a_call_under_another_autocast_state_never_replays(graphs, change):
    """Planted: the key without ``torch.get_autocast_dtype("cuda")`` (or without
    ``is_autocast_enabled``): a graph captured under fp16 autocast replays under bf16."""
    layer = MoELayer(_config(top_k=2, backend="triton"))
    x = torch.randn(3, H)
    first, then = {"autocast dtype": ((True, torch.float16), (True, torch.bfloat16)),
                   "autocast on": ((False, torch.float16), (True, torch.float16)),
                   "autocast off": ((True, torch.bfloat16), (False, torch.bfloat16))}[change]
    _captured(graphs, layer, x, lambda: _cuda_autocast(*first))
    with _cuda_autocast(*then):
        assert not graphs(layer, x)[1]


@pytest.mark.parametrize("change", ["training", "inference mode", "strides", "moved parameter", "moved buffer"])
def test_every_other_field_of_the_key_keeps_its_graph_apart(graphs, change):
    """Planted: any field dropped from the key (``owner.training``, inference mode, strides,
    the addresses) replays a graph captured in another state."""
    layer = MoELayer(_config(top_k=2, backend="triton", expert_bias=True))
    layer.eval()
    x = torch.randn(4, 6)[:, :4].repeat(1, 4)  # contiguous [4, 16]
    _captured(graphs, layer, x)
    context = contextlib.nullcontext()
    if change == "training":
        layer.train()
    elif change == "inference mode":
        context = torch.inference_mode()
    elif change == "strides":
        x = x.t().contiguous().t()  # same shape, column-major
    elif change == "moved parameter":
        layer.experts.down.data = layer.experts.down.data.clone()
    else:
        layer.expert_bias = layer.expert_bias.clone()
    with context:
        assert not graphs(layer, x)[1]


def test_the_experts_problems_cache_is_per_dtype(monkeypatch):
    """Planted: ``StackedExpertsMath.kernel_configs`` caching the problems under one key
    whatever ``like.dtype``: a bf16 call after an fp16 one tunes the fp16 problems."""
    seen = []
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, rows, device: seen.append(problem.dtype))
    layer = MoELayer(_config(top_k=2))
    for dtype in (torch.float16, torch.bfloat16, torch.float16, torch.float32):
        seen.clear()
        layer.experts.kernel_configs("triton", 64, torch.empty(1, dtype=dtype))
        assert seen == [str(dtype).removeprefix("torch.")] * 2


# --- floor against ceil ---------------------------------------------------------------------


def test_a_fractional_row_bound_rounds_up():
    """Planted: ``int(bound * T * K)`` in ``row_bound``: 11 rows where 1.25 x 3 x 3 = 11.25
    needs 12 (the whole numbers of the other tests round alike either way)."""
    assert row_bound(1.25, num_tokens=3, top_k=3, ep_size=2, num_local=4) == 12
    assert row_bound(0.1, num_tokens=1, top_k=1, ep_size=2, num_local=4) == 1  # never 0 rows
    assert row_bound(1.25, num_tokens=3, top_k=3, ep_size=1, num_local=2) == 6  # the worst case, smaller


def test_a_fractional_row_bound_drops_only_past_the_rounded_up_bound():
    """18 slots of 2 ranks x 3 tokens x top-3, all on this rank's experts, a bound of 12."""
    ids = torch.tensor([[0, 1, 2], [1, 2, 3], [3, 0, 1]] * 2)
    slots, dropped = gathered_routing(ids, 0, 4, row_bound(1.25, 3, 3, 2, 4), num_sources=2)
    assert int(dropped) == 6 and int(slots.counts_E.sum()) == 12


def _bound_worker(rank, world_size):
    torch.manual_seed(0)
    cfg = _config(top_k=3, dispatch="all_gather", all_gather_row_bound=1.25)
    layer = MoELayer(cfg, dist.group.WORLD)
    with torch.no_grad():  # every token picks rank 0's experts (0..3)
        layer.router.weight.abs_()
        layer.router.weight[E // 2:] *= -1
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(rank)).abs() + 0.1
    y = layer(x)
    y.sum().backward()
    return {"dropped": int(layer.last_stats.num_dropped), "finite": bool(torch.isfinite(y).all())}


@pytest.mark.distributed
def test_a_fractional_row_bound_at_ep2():
    """The layer at EP=2: rank 0's experts take all 18 slots, 12 computed, 6 dropped."""
    results = run_distributed(_bound_worker, 2, timeout_s=60)
    assert [r["dropped"] for r in results] == [6, 0]
    assert all(r["finite"] for r in results)


# --- gradients never compared ------------------------------------------------------------


def _reference_weights(logits, ids, score_func, norm):
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    chosen = scores.gather(1, ids)
    return chosen / chosen.sum(-1, keepdim=True) if norm else chosen


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_topk_weight_gradients_match_float64_reference(score_func, norm, with_bias):
    """Planted: the renormalisation's denominator detached (``topk_weights_TK /
    (topk_weights_TK.sum(...).detach() + 1e-20)`` in routing.route) or the chosen logits'
    softmax taken of detached logits: the values stay right, the gradients do not."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, H, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(E, H, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(E, dtype=torch.float64, generator=gen) * 0.5 if with_bias else None
    kwargs = dict(top_k=3, score_func=score_func, norm_topk_prob=norm, expert_bias_E=bias,
                  router_dtype=torch.float64)
    out = route(x, w, **kwargs)
    want = _reference_weights(x @ w.T, out.topk_ids_TK, score_func, norm)
    torch.testing.assert_close(out.topk_weights_TK, want, rtol=1e-12, atol=1e-14)
    probe = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    got_grads = torch.autograd.grad((out.topk_weights_TK * probe).sum(), (x, w))
    want_grads = torch.autograd.grad((want * probe).sum(), (x, w))
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w: route(x, w, **kwargs).topk_weights_TK, (x, w))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_loss_gradients_match_float64_reference(score_func):
    """The aux and z losses' gradients w.r.t. the router weight (the aux loss's counts are
    constants; its probabilities carry the gradient)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, H, dtype=torch.float64, generator=gen)
    w = torch.randn(E, H, dtype=torch.float64, generator=gen, requires_grad=True)
    out = route(x, w, top_k=2, score_func=score_func, aux_loss_coef=0.3, z_loss_coef=0.02,
                router_dtype=torch.float64)
    logits = x @ w.T
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdim=True)
    fraction = out.counts_E.double() / (9 * 2)
    aux = 0.3 * E * (fraction * probs.mean(0)).sum()
    z = 0.02 * torch.logsumexp(logits, -1).square().mean()
    for got, ref in ((out.aux_loss, aux), (out.z_loss, z)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got, w, retain_graph=True)[0],
                                   torch.autograd.grad(ref, w, retain_graph=True)[0],
                                   rtol=1e-10, atol=1e-14)


def test_combine_slots_gradients_match_float64_reference():
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(12, H, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = torch.rand(12, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, w: combine_slots(y, 3, w), (y, weights))


# --- groups that coincide with the world ----------------------------------------------------


def _clip_world4_worker(rank, world_size):
    from ep_moe.parallel import build_ep_groups

    ep1, ep2 = build_ep_groups(1), build_ep_groups(2)  # DP=4; EP=2 x DP=2
    tokens_BL = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(100 + rank))
    norm1, _ = _clipped(_clip_model(None), None, ep1.edp_group, tokens_BL, clip=0.0)
    clip = CLIP_FRACTION * norm1
    norm1, grads1 = _clipped(_clip_model(None), None, ep1.edp_group, tokens_BL, clip)
    norm2, grads2 = _clipped(_clip_model(ep2.ep_group), ep2.ep_group, ep2.edp_group, tokens_BL, clip)
    worst = max((float((grads2[k] - grads1[k]).abs().max() / grads1[k].abs().max()), k) for k in grads2)
    return {"norm1": norm1, "norm2": norm2, "worst": worst}


@pytest.mark.distributed
def test_clipping_at_ep2_by_dp2_matches_dp4():
    """``ep_moe/train/trainer.py:clip_gradients`` at world 4, EP=2 x DP=2, against EP=1 x DP=4:
    the EP group is no longer the world. Planted: the expert norm all-reduced over the world
    (``dist.all_reduce(expert_sq)``): each expert counted twice, the norm ~2% too large.
    (The world-2 test, tests/test_train_clip.py, cannot tell the two groups apart.)"""
    for rank, r in enumerate(run_distributed(_clip_world4_worker, 4, timeout_s=180)):
        assert r["norm2"] == pytest.approx(r["norm1"], rel=1e-5), (
            f"rank {rank}: global grad norm at EP=2 x DP=2 {r['norm2']:.6g}, at DP=4 {r['norm1']:.6g}")
        diff, key = r["worst"]
        assert diff <= 1e-5, f"rank {rank}: clipped gradient {key} differs from DP=4 by {diff:.2e} (relative)"


def _groups_worker(rank, world_size):
    """EP=2 x DP=2: what the layer checks over its EP group stays within it."""
    import os

    from ep_moe.parallel import build_ep_groups

    groups = build_ep_groups(2)
    out = {}
    # the first call's config agreement: two EP groups (two pipeline stages, say) with layers
    # of different configs, each group agreeing within
    torch.manual_seed(0)
    layer = MoELayer(_config(top_k=2 if rank < 2 else 3), groups.ep_group)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(rank))
    try:
        layer(x)
        out["config"] = "ok"
    except ValueError as err:
        out["config"] = str(err)
    # the debug checks (EP_MOE_DEBUG): a NaN token on rank 0 stops its EP group ({0, 1}) only
    os.environ["EP_MOE_DEBUG"] = "1"
    bad = x.clone()
    if rank == 0:
        bad[1, 2] = float("nan")
    try:
        layer(bad)
        out["nan"] = "ok"
    except ValueError as err:
        out["nan"] = str(err)
    # an out-of-range route_fn id on rank 2 stops its EP group ({2, 3}) only
    def route_fn(x_TH):
        router, keep = layer._route(x_TH)
        ids = router.topk_ids_TK.clone()
        if rank == 2:
            ids[0, 0] = -1
        return dataclasses.replace(router, topk_ids_TK=ids), keep

    try:
        layer(x, route_fn=route_fn)
        out["route_fn"] = "ok"
    except ValueError as err:
        out["route_fn"] = str(err)
    return out


@pytest.fixture(scope="module")
def groups_results():
    return run_distributed(_groups_worker, 4, timeout_s=60)


@pytest.mark.distributed
def test_config_agreement_stays_within_the_ep_group(groups_results):
    """Planted: ``check_same_config`` over the world: the two groups' configs differ."""
    assert [r["config"] for r in groups_results] == ["ok"] * 4


@pytest.mark.distributed
def test_debug_checks_stay_within_the_ep_group(groups_results):
    """Planted: the debug checks' all-reduce over the world (``group=None``): rank 0's NaN
    (rank 2's bad id) stops the other EP group too."""
    nan = [r["nan"] for r in groups_results]
    assert nan[2:] == ["ok", "ok"]
    assert re.search(r"x has 1 of 4 tokens with NaN or inf values on this rank, 1 over the EP group", nan[0])
    assert re.search(r"x has 0 of 4 tokens with NaN or inf values on this rank, 1 over the EP group", nan[1])
    ids = [r["route_fn"] for r in groups_results]
    assert ids[:2] == ["ok", "ok"]
    assert re.search(r"route_fn returned 1 of 12 expert ids outside \[0, 8\) \(e\.g\. -1\) on this rank, "
                     r"1 over the EP group", ids[2])
    assert re.search(r"route_fn returned 0 of 12 expert ids outside \[0, 8\) on this rank, 1 over the EP group",
                     ids[3])
