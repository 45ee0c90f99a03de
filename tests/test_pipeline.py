"""The chunked expert pipeline on one process (no group): values and every gradient equal
the unchunked computation, graphs are freed, and no graph is kept under no_grad."""

import pytest
import torch

from ep_moe.dispatch import NcclExchange, PendingExchange, SplitSizes
from ep_moe.pipeline import ChunkPlan, OwnRows, expert_pipeline
from ep_moe.routing import build_routing_metadata

TOP_K = 2


def _expert_fn(rows_SH, weights_SK, plan, gate_up, down):
    """A stand-in for the local experts: each row's K slots through
    (rows @ gate_up^T).tanh() @ down^T, weighted, summed per row."""
    local = plan.local
    h = (rows_SH[local.token_index_R] @ gate_up.T).tanh() @ down.T
    h = h * weights_SK.flatten()[local.slot_index_R, None]
    return torch.zeros(rows_SH.shape[0], h.shape[1]).index_add(0, local.token_index_R, h)


def _plan(num_rows: int, seed: int, device: torch.device = torch.device("cpu")) -> ChunkPlan:
    ids = torch.randint(0, 3, (num_rows, TOP_K), generator=torch.Generator().manual_seed(seed))
    return ChunkPlan(SplitSizes(send=[num_rows], recv=[num_rows]), build_routing_metadata(ids.to(device), 3))


def _arrived(weights):
    """What a dispatch without a group delivers of the sent top-k weights: the same values."""
    return [w.detach() for w in weights]


def _local(plans):
    """Exchanges without a group: the rows stay where they are."""
    return NcclExchange(None, [plan.splits for plan in plans])


@pytest.mark.parametrize("caller_dispatches", [False, True])
def test_chunks_match_direct_computation_and_gradients(caller_dispatches):
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen, requires_grad=True)
    sizes = [5, 0, 3]  # an empty chunk in the middle
    rows = [torch.randn(n, 4, generator=gen, requires_grad=True) for n in sizes]
    weights = [torch.rand(n, TOP_K, generator=gen, requires_grad=True) for n in sizes]
    plans = [_plan(n, seed) for seed, n in enumerate(sizes)]
    exchange = _Counting(None, [plan.splits for plan in plans])
    dispatched = [exchange.dispatch(r.detach(), c, "rows") for c, r in enumerate(rows)] if caller_dispatches else None
    outs = expert_pipeline(_expert_fn, plans, exchange, gate_up, down, rows, weights, _arrived(weights),
                           dispatched=dispatched)
    assert exchange.dispatches == len(sizes)  # the caller's dispatches are used, none repeated
    grads_out = [torch.randn_like(o) for o in outs]
    leaves = [gate_up, down, *rows, *weights]
    got = torch.autograd.grad(outs, leaves, grads_out)

    want_outs = [_expert_fn(r, w, p, gate_up, down) for r, w, p in zip(rows, weights, plans)]
    want = torch.autograd.grad(want_outs, leaves, grads_out)
    for a, b in zip(outs, want_outs):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


class _Delivering(NcclExchange):
    """An exchange without a group that, like a real one, delivers new tensors."""

    def dispatch(self, x, chunk, kind):
        return PendingExchange(x.clone())

    def combine(self, x, chunk, kind):
        return PendingExchange(x.clone())


class _Counting(_Delivering):
    """Counts the forward's row dispatches."""

    dispatches = 0

    def dispatch(self, x, chunk, kind):
        self.dispatches += 1
        return super().dispatch(x, chunk, kind)


def test_dispatches_one_per_chunk():
    plans = [_plan(3, 0)]
    weights = [torch.rand(3, TOP_K)]
    with pytest.raises(ValueError, match="2 dispatches for 1 chunks"):
        expert_pipeline(_expert_fn, plans, _local(plans), torch.randn(6, 4), torch.randn(4, 6),
                        [torch.randn(3, 4)], weights, weights, dispatched=[None, None])


def _sine_experts(rows_SH, weights_SK, plan, gate_up, down):
    """:func:`_expert_fn` after a sine, whose backward reads the rows themselves."""
    return _expert_fn(rows_SH.sin(), weights_SK, plan, gate_up, down)


def _plan_with_own_rows(num_rows: int, own_start: int, own_rows: int, seed: int) -> ChunkPlan:
    """A chunk whose rows [own_start, own_start + own_rows) are the rank's own (no group:
    send and arrival order are the same); their slots leave the arrived rows' routing."""
    ids = torch.randint(0, 3, (num_rows, TOP_K), generator=torch.Generator().manual_seed(seed))
    others = torch.ones(num_rows, TOP_K, dtype=torch.bool)
    others[own_start: own_start + own_rows] = False
    own = OwnRows(own_start, own_start, own_rows,
                  build_routing_metadata(ids[own_start: own_start + own_rows], 3))
    local = build_routing_metadata(ids, 3, others, num_kept=int(others.sum()))
    return ChunkPlan(SplitSizes(send=[num_rows], recv=[num_rows]), local, own)


def test_own_rows_run_ahead_and_match_direct_computation():
    """Own rows (the middle of a chunk, the whole of another) run from a copy of the send
    buffer: overwriting the send rows after the forward changes nothing, and outputs and
    gradients equal the direct computation over all rows."""
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen, requires_grad=True)
    sizes = [7, 3]
    plans = [_plan_with_own_rows(7, 2, 3, 0), _plan_with_own_rows(3, 0, 3, 1)]
    values = [torch.randn(n, 4, generator=gen) for n in sizes]
    rows = [v.clone().requires_grad_() for v in values]
    weights = [torch.rand(n, TOP_K, generator=gen, requires_grad=True) for n in sizes]
    sends = [r * 1 for r in rows]  # non-leaf send buffers, overwritten below
    outs = expert_pipeline(_sine_experts, plans, _Delivering(None, [p.splits for p in plans]), gate_up, down,
                           sends, weights, _arrived(weights))
    for s in sends:
        s.detach().zero_()  # as a restaged send buffer would be
    grads_out = [torch.randn_like(o) for o in outs]
    leaves = [gate_up, down, *rows, *weights]
    got = torch.autograd.grad(outs, leaves, grads_out)

    want_outs = [_sine_experts(r, w, _plan(n, seed), gate_up, down)  # same ids, no own rows
                 for seed, (r, w, n) in enumerate(zip(rows, weights, sizes))]
    want = torch.autograd.grad(want_outs, leaves, grads_out)
    for a, b in zip(outs, want_outs):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_arrived_weights_must_be_data():
    gate_up, down = torch.randn(6, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    weights = [torch.rand(3, TOP_K, requires_grad=True)]
    with pytest.raises(ValueError, match="arrived_weights are data"):
        expert_pipeline(_expert_fn, [_plan(3, 0)], _local([_plan(3, 0)]), gate_up, down,
                        [torch.randn(3, 4)], weights, weights)


def test_no_graph_under_no_grad():
    gate_up, down = torch.randn(6, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    with torch.no_grad():
        weights = [torch.rand(3, TOP_K)]
        (out,) = expert_pipeline(_expert_fn, [_plan(3, 0)], _local([_plan(3, 0)]), gate_up, down,
                                 [torch.randn(3, 4)], weights, _arrived(weights))
    assert out.grad_fn is None and not out.requires_grad


def test_frozen_inputs_get_no_gradient_and_a_second_backward_is_refused():
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen)  # frozen
    rows = [torch.randn(5, 4, generator=gen, requires_grad=True)]
    weights = [torch.rand(5, TOP_K, generator=gen)]  # e.g. a frozen router
    (out,) = expert_pipeline(_expert_fn, [_plan(5, 0)], _local([_plan(5, 0)]), gate_up, down, rows, weights,
                             _arrived(weights))
    out.sum().backward(retain_graph=True)
    assert gate_up.grad is not None and rows[0].grad is not None and down.grad is None
    want = torch.autograd.grad(_expert_fn(rows[0], weights[0], _plan(5, 0), gate_up, down).sum(), gate_up)[0]
    torch.testing.assert_close(gate_up.grad, want)
    with pytest.raises(RuntimeError, match="second backward"):
        out.sum().backward()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64], ids=["fp32", "cast"])
def test_weight_grads_of_grouped_gemm_experts_come_last_one_program_per_tile(monkeypatch, device, weight_dtype):
    """With grouped-GEMM experts (Triton: the GPU, or the interpreter) the backward queues
    both dW GEMMs of each chunk, runs them after the chunks' row gradients left, launching
    one program per tile, sums the chunks' dW inside the kernel (the later chunk
    accumulates; with weights cast to the rows' dtype, as autocast does, too: one cast for
    all chunks) and hands those buffers over uncopied, and the gradients equal the direct
    computation."""
    from ep_moe.kernels import grouped_gemm as kernels
    from ep_moe.kernels import ops
    from ep_moe.layer import expert_mlp

    def gemm_experts(rows_SH, weights_SK, plan, gate_up, down):
        local = plan.local
        h = expert_mlp(rows_SH, gate_up, down, local.counts_E, activation="relu",
                       gather_index=local.token_index_R, backend="triton",
                       row_weights=weights_SK.flatten().index_select(0, local.slot_index_R))
        return torch.zeros(rows_SH.shape[0], h.shape[1], device=device).index_add(0, local.token_index_R, h)

    seen, accumulated, dw_buffers = [], [], set()
    run, launch_dw = ops.DeferredWeightGrads.run, ops.launch_dw

    def spy_run(self):
        seen.append((len(self), kernels.launch_grid(device, 7)))
        run(self)

    def spy_launch_dw(*args, accumulate=False):
        accumulated.append(accumulate)
        dw_buffers.add(args[2].data_ptr())
        launch_dw(*args, accumulate=accumulate)

    monkeypatch.setattr(ops.DeferredWeightGrads, "run", spy_run)
    monkeypatch.setattr(ops, "launch_dw", spy_launch_dw)
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 16, 8, generator=gen).to(device, weight_dtype).requires_grad_()
    down = torch.randn(3, 8, 16, generator=gen).to(device, weight_dtype).requires_grad_()
    sizes = [5, 3]
    rows = [torch.randn(n, 8, generator=gen).to(device).requires_grad_() for n in sizes]
    weights = [torch.rand(n, TOP_K, generator=gen).to(device).requires_grad_() for n in sizes]
    plans = [_plan(n, seed, device) for seed, n in enumerate(sizes)]
    outs = expert_pipeline(gemm_experts, plans, _local(plans), gate_up, down, rows, weights, _arrived(weights))
    grads_out = [torch.randn_like(o) for o in outs]
    leaves = [gate_up, down, *rows, *weights]
    got = torch.autograd.grad(outs, leaves, grads_out)
    assert seen == [(4, ((7,), 1 << 30))]  # two GEMMs per chunk, queued, run per tile
    assert accumulated == [False, False, True, True]  # chunk 1 adds to chunk 0's dW
    if weight_dtype == torch.float32:
        assert {got[0].data_ptr(), got[1].data_ptr()} <= dw_buffers  # the kernel's sums, not copies

    accumulated.clear()
    want_outs = [gemm_experts(r, w, p, gate_up, down) for r, w, p in zip(rows, weights, plans)]
    want = torch.autograd.grad(want_outs, leaves, grads_out)
    assert accumulated == [False] * 4  # no queue: each GEMM its own dW
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_weights_changed_in_place_after_the_forward_are_caught():
    """Autograd's check of saved tensors' versions still covers the chunk graphs: a weight
    modified in place between forward and backward raises instead of giving wrong grads."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen, requires_grad=True)
    rows = [torch.randn(5, 4, generator=gen, requires_grad=True)]
    weights = [torch.rand(5, 2, generator=gen, requires_grad=True)]
    plans = [_plan(5, 0)]
    (out,) = expert_pipeline(_expert_fn, plans, _local(plans), gate_up, down, rows, weights, _arrived(weights))
    with torch.no_grad():
        down.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
