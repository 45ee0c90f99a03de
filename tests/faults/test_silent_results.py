"""Wrong results without a word (issue 46, part 4): a ``route_fn`` whose expert ids fall
outside ``[0, num_experts)`` must not change other tokens' outputs (its bad slots count as
dropped; ``EP_MOE_DEBUG=1`` raises naming ``route_fn`` and the range), and EP ranks whose
replicated parameters (router, shared experts, expert bias) start different must hear so on
the first call instead of training apart for ever."""

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

import ep_moe.experts as experts_mod
from dist_utils import run_distributed
from ep_moe import MoELayer
from ep_moe.routing import count_ids
from layer_helpers import E, H, _config

pytestmark = pytest.mark.faults

T = 6


@pytest.fixture(autouse=True)
def _default_kernel_configs(monkeypatch):
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, num_rows, device: None)
    monkeypatch.delenv("EP_MOE_DEBUG", raising=False)


def _edited_route_fn(layer, bad_id=None, zero_weight=False, recount=False):
    """The layer's own routing with slot (0, 0) edited: its id set to ``bad_id``, or its weight
    to 0 (``zero_weight``: what a bad slot must amount to). ``recount``: counts_E recounted
    from the edited ids as a careless route_fn would (a bin past the experts dropped)."""

    def route_fn(x_TH):
        router, keep_TK = layer._route(x_TH)
        ids, weights = router.topk_ids_TK.clone(), router.topk_weights_TK.clone()
        if bad_id is not None:
            ids[0, 0] = bad_id
        if zero_weight:
            weights[0, 0] = 0.0
        counts = router.counts_E
        if recount:
            counts = count_ids(ids.flatten().clamp(0, E), E + 1)[:E]
        return dataclasses.replace(router, topk_ids_TK=ids, topk_weights_TK=weights, counts_E=counts), keep_TK

    return route_fn


CASES = {
    "dropless": dict(top_k=2),
    "dropless-triton": dict(top_k=2, backend="triton"),
    "capacity": dict(top_k=2, capacity_factor=2.0),
    "capacity-triton": dict(top_k=2, capacity_factor=2.0, backend="triton"),
    "shared": dict(top_k=3, num_shared_experts=1),
}


@pytest.mark.parametrize("recount", [False, True])
@pytest.mark.parametrize("bad_id", [-1, E, -(2**40)])
@pytest.mark.parametrize("case", list(CASES))
def test_out_of_range_route_fn_ids_change_no_other_token(case, bad_id, recount):
    """The bad slot contributes nothing (as a slot of weight 0 would), every other token's
    output and every gradient is what the valid routing gives, and the slot counts as
    dropped."""
    torch.manual_seed(0)
    layer = MoELayer(_config(**CASES[case]))
    x = torch.randn(T, H)
    g = torch.randn(T, H)

    def run(route_fn):
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = layer(xg, route_fn=route_fn)
        (y * g).sum().backward()
        return y.detach(), xg.grad, layer.router.weight.grad.clone(), layer.experts.down.grad.clone()

    want = run(_edited_route_fn(layer, zero_weight=True))
    got = run(_edited_route_fn(layer, bad_id, recount=recount))
    for what, a, b in zip(["y", "dx", "router grad", "down grad"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)  # rows summed in another order
    assert int(layer.last_stats.num_dropped) == 1


def test_out_of_range_ids_with_debug_name_route_fn_and_the_range(monkeypatch):
    monkeypatch.setenv("EP_MOE_DEBUG", "1")
    layer = MoELayer(_config(top_k=2))
    x = torch.randn(T, H)
    for bad_id in (-1, E, 77):
        with pytest.raises(ValueError, match=rf"route_fn returned 1 of {T * 2} expert ids outside \[0, {E}\) "
                                             rf"\(e\.g\. {bad_id}\).*; return global expert ids in \[0, {E}\)"):
            layer(x, route_fn=_edited_route_fn(layer, bad_id))
    layer(x, route_fn=_edited_route_fn(layer))  # valid ids pass


ROUTE_FN_SHAPE_PROBES = [
    ("ids not [T, K]", lambda r: dict(topk_ids_TK=r.topk_ids_TK[:, :1]),
     r"route_fn returned topk_ids_TK of shape \(6, 1\); return \[T, top_k\] = \(6, 2\) global expert ids"),
    ("float ids", lambda r: dict(topk_ids_TK=r.topk_ids_TK.float()),
     r"route_fn returned topk_ids_TK of dtype torch.float32; return integer expert ids \(torch.int64\)"),
    ("weights not [T, K]", lambda r: dict(topk_weights_TK=r.topk_weights_TK.flatten()),
     r"route_fn returned topk_weights_TK of shape \(12,\); return one weight per slot, \(6, 2\)"),
    ("counts of E+1", lambda r: dict(counts_E=torch.zeros(E + 1, dtype=torch.int64)),
     rf"route_fn returned counts_E of shape \({E + 1},\); return the slots per expert, \({E},\)"),
]


@pytest.mark.parametrize("name,edit,pattern", ROUTE_FN_SHAPE_PROBES, ids=[p[0] for p in ROUTE_FN_SHAPE_PROBES])
def test_route_fn_output_of_the_wrong_shape_is_named(name, edit, pattern):
    layer = MoELayer(_config(top_k=2))

    def route_fn(x_TH):
        router, keep = layer._route(x_TH)
        return dataclasses.replace(router, **edit(router)), keep

    with pytest.raises(ValueError, match=pattern):
        layer(torch.randn(T, H), route_fn=route_fn)


def test_route_fn_keep_mask_of_the_wrong_shape_is_named():
    layer = MoELayer(_config(top_k=2))
    with pytest.raises(ValueError, match=r"route_fn returned a keep mask of shape \(6,\) torch.bool; return "
                                         r"None or a \(6, 2\) bool mask"):
        layer(torch.randn(T, H), route_fn=lambda x_TH: (layer._route(x_TH)[0], torch.ones(T, dtype=torch.bool)))


# --- EP=2 and EP=2 x DP=2 (gloo) ----------------------------------------------------------


def _route_fn_worker(rank, world_size, dispatch, debug):
    import os

    if debug:
        os.environ["EP_MOE_DEBUG"] = "1"
    torch.manual_seed(0)
    layer = MoELayer(_config(top_k=2, dispatch=dispatch), dist.group.WORLD)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    out = {}
    bad = E if rank == 0 else None  # only rank 0's route_fn goes wrong
    try:
        y = layer(x, route_fn=_edited_route_fn(layer, bad, zero_weight=bad is None))
        out["y"] = y.detach()
        out["dropped"] = int(layer.last_stats.num_dropped)
    except ValueError as err:
        out["error"] = str(err)
    out["want"] = layer(x, route_fn=_edited_route_fn(layer, zero_weight=True)).detach()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_out_of_range_route_fn_ids_at_ep2(dispatch):
    for rank, res in enumerate(run_distributed(_route_fn_worker, 2, dispatch, False, timeout_s=60)):
        torch.testing.assert_close(res["y"], res["want"], rtol=1e-5, atol=1e-6)
        assert res["dropped"] == (1 if rank == 0 else 0)


@pytest.mark.distributed
def test_out_of_range_route_fn_ids_at_ep2_with_debug_raise_on_every_rank():
    for rank, res in enumerate(run_distributed(_route_fn_worker, 2, "all_to_all", True, timeout_s=60)):
        assert re.search(rf"route_fn returned {1 - rank} of {T * 2} expert ids outside \[0, {E}\)"
                         r".* on this rank, 1 over the EP group", res["error"]), res["error"]


def _replica_worker(rank, world_size, case):
    from ep_moe.parallel import broadcast_replicated, build_ep_groups

    groups = build_ep_groups(2)
    ep_rank = dist.get_rank(groups.ep_group)
    overrides = dict(num_shared_experts=1, expert_bias=True) if case != "router" else {}
    # ranks {0, 1} and {2, 3} are two EP groups: equal within each, different between them
    # (what expert-data-parallel replicas look like before DDP): never an error
    torch.manual_seed(rank // 2 if case == "groups_differ" else 0)
    layer = MoELayer(_config(top_k=2, **overrides), groups.ep_group)
    with torch.no_grad():
        if case == "router" and ep_rank == 1:
            layer.router.weight[3, 5] += 1e-6
        elif case == "shared" and ep_rank == 1:
            layer.shared_experts.down.weight.mul_(-1)
        elif case == "bias" and ep_rank == 0:
            layer.expert_bias[0] = 0.5
        elif case == "permuted" and ep_rank == 1:  # the same values in another order
            layer.router.weight.copy_(layer.router.weight.flip(0))
        elif case == "nan" and rank < 2:  # equal NaNs on both ranks of the group are equal
            layer.router.weight[0, 0] = float("nan")
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(rank))
    out = {}
    try:
        layer(x)
        out["ok"] = True
    except ValueError as err:
        out["error"] = str(err)
    if "error" in out:  # the helper the error names makes them equal; the next call runs
        broadcast_replicated(layer, groups.ep_group)
        layer(x)
        out["after_broadcast"] = True
    layer(x)  # checked once: a later call does not check again
    return out


REPLICA_ERRORS = {
    "router": r"\['router.weight'\]",
    "shared": r"\['shared_experts.down.weight'\]",
    "bias": r"\['expert_bias'\]",
    "permuted": r"\['router.weight'\]",
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["router", "shared", "bias", "permuted", "groups_differ", "nan"])
def test_replicated_parameters_that_differ_over_the_ep_group_are_named(case):
    results = run_distributed(_replica_worker, 4, case, timeout_s=60)
    if case not in REPLICA_ERRORS:
        assert all(res.get("ok") for res in results), results
        return
    for res in results:
        assert re.search(rf"MoELayer: the replicated parameters {REPLICA_ERRORS[case]} differ across the EP group "
                         r"\(ranks (\[0, 1\]|\[2, 3\]) of the world\) on its first call; give every rank the same "
                         r"values: seed every rank alike before building the model \(torch.manual_seed\), load "
                         r"the same checkpoint, or call ep_moe.parallel.broadcast_replicated\(model, ep_group\)",
                         res["error"]), res["error"]
        assert res["after_broadcast"]
