"""The expert pipeline on one process (no group): values and every gradient equal the
direct computation, graphs are freed, no graph is kept under no_grad, the experts run with
autocast off, and an exchange that changes the rows' dtype is refused."""

import pytest
import torch

from ep_moe.ep.all_to_all import NcclExchange, SplitSizes
from ep_moe.ep.base import PendingExchange
from ep_moe.kernels.arrival import Landing
from ep_moe.ep import pipeline
from ep_moe.ep.pipeline import expert_pipeline
from ep_moe.routing import build_routing_metadata

TOP_K = 2


def _expert_fn(rows_SH, weights_SK, local, gate_up, down):
    """A stand-in for the local experts: each row's K slots through
    (rows @ gate_up^T).tanh() @ down^T, weighted, summed per row."""
    h = (rows_SH[local.token_index_R] @ gate_up.T).tanh() @ down.T
    h = h * weights_SK.flatten()[local.slot_index_R, None]
    return torch.zeros(rows_SH.shape[0], h.shape[1], dtype=h.dtype, device=h.device).index_add(
        0, local.token_index_R, h)


def _routing(num_rows: int, seed: int, device: torch.device = torch.device("cpu")):
    """Routing of ``num_rows`` arrived rows (as tokens) to 3 local experts, K slots each."""
    ids = torch.randint(0, 3, (num_rows, TOP_K), generator=torch.Generator().manual_seed(seed))
    return build_routing_metadata(ids.to(device), 3)


def _arrived(weights):
    """What a dispatch without a group delivers of the sent top-k weights: the same values."""
    return weights.detach()


def _local(num_rows: int):
    """Exchanges without a group: the rows stay where they are."""
    return NcclExchange(None, SplitSizes(send=[num_rows], recv=[num_rows]))


class _Delivering(NcclExchange):
    """An exchange without a group that, like a real one, delivers new tensors."""

    def __init__(self) -> None:
        super().__init__(None, SplitSizes(send=[0], recv=[0]))

    def dispatch(self, x, kind):
        return PendingExchange(x.clone())

    def combine(self, x, kind):
        return PendingExchange(x.clone())


class _Counting(_Delivering):
    """Counts the forward's row dispatches."""

    dispatches = 0

    def dispatch(self, x, kind):
        self.dispatches += 1
        return super().dispatch(x, kind)


@pytest.mark.parametrize("num_rows", [5, 0], ids=["rows", "empty"])
@pytest.mark.parametrize("caller_dispatches", [False, True])
def test_matches_direct_computation_and_gradients(caller_dispatches, num_rows):
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen, requires_grad=True)
    rows = torch.randn(num_rows, 4, generator=gen, requires_grad=True)
    weights = torch.rand(num_rows, TOP_K, generator=gen, requires_grad=True)
    local = _routing(num_rows, 0)
    exchange = _Counting()
    dispatched = exchange.dispatch(rows.detach(), "rows") if caller_dispatches else None
    out = expert_pipeline(_expert_fn, local, exchange, (gate_up, down), rows, weights, _arrived(weights),
                          dispatched=dispatched)
    assert exchange.dispatches == 1  # the caller's dispatch is used, not repeated
    grad_out = torch.randn_like(out)
    leaves = [gate_up, down, rows, weights]
    got = torch.autograd.grad(out, leaves, grad_out)

    want_out = _expert_fn(rows, weights, local, gate_up, down)
    want = torch.autograd.grad(want_out, leaves, grad_out, allow_unused=True)
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b)


def test_arrived_weights_must_be_data():
    gate_up, down = torch.randn(6, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    weights = torch.rand(3, TOP_K, requires_grad=True)
    with pytest.raises(ValueError, match="arrived_weights are data"):
        expert_pipeline(_expert_fn, _routing(3, 0), _local(3), (gate_up, down), torch.randn(3, 4), weights, weights)


def test_no_graph_under_no_grad():
    gate_up, down = torch.randn(6, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    with torch.no_grad():
        weights = torch.rand(3, TOP_K)
        out = expert_pipeline(_expert_fn, _routing(3, 0), _local(3), (gate_up, down), torch.randn(3, 4), weights,
                              _arrived(weights))
    assert out.grad_fn is None and not out.requires_grad


def test_frozen_inputs_get_no_gradient_and_a_second_backward_is_refused():
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen)  # frozen
    rows = torch.randn(5, 4, generator=gen, requires_grad=True)
    weights = torch.rand(5, TOP_K, generator=gen)  # e.g. a frozen router
    out = expert_pipeline(_expert_fn, _routing(5, 0), _local(5), (gate_up, down), rows, weights, _arrived(weights))
    out.sum().backward(retain_graph=True)
    assert gate_up.grad is not None and rows.grad is not None and down.grad is None
    want = torch.autograd.grad(_expert_fn(rows, weights, _routing(5, 0), gate_up, down).sum(), gate_up)[0]
    torch.testing.assert_close(gate_up.grad, want)
    with pytest.raises(RuntimeError, match="second backward"):
        out.sum().backward()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64], ids=["fp32", "cast"])
def test_weight_grads_of_grouped_gemm_experts_come_last_one_program_per_tile(monkeypatch, device, weight_dtype):
    """With grouped-GEMM experts (Triton: the GPU, or the interpreter) the backward queues
    both dW GEMMs, runs them after the row gradients left, launching one program per tile,
    and hands those buffers over uncopied (with weights cast to the rows' dtype, as
    autocast does, through the cast), and the gradients equal the direct computation."""
    from ep_moe.kernels import grouped_gemm as kernels
    from ep_moe.kernels import ops
    from ep_moe.experts import expert_mlp

    def gemm_experts(rows_SH, weights_SK, local, gate_up, down):
        h = expert_mlp(rows_SH, gate_up, down, local.counts_E, activation="relu",
                       gather_index=local.token_index_R, backend="triton",
                       row_weights=weights_SK.flatten().index_select(0, local.slot_index_R))
        return torch.zeros(rows_SH.shape[0], h.shape[1], device=device).index_add(0, local.token_index_R, h)

    seen, accumulated, dw_buffers = [], [], set()
    run, launch_dw = pipeline.DeferredWeightGrads.run, ops.launch_dw

    def spy_run(self):
        seen.append((len(self), kernels.launch_grid(device, 7)))
        run(self)

    def spy_launch_dw(*args, accumulate=False, **kwargs):
        accumulated.append(accumulate)
        dw_buffers.add(args[2].data_ptr())
        launch_dw(*args, accumulate=accumulate, **kwargs)

    monkeypatch.setattr(pipeline.DeferredWeightGrads, "run", spy_run)
    monkeypatch.setattr(ops, "launch_dw", spy_launch_dw)
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 16, 8, generator=gen).to(device, weight_dtype).requires_grad_()
    down = torch.randn(3, 8, 16, generator=gen).to(device, weight_dtype).requires_grad_()
    rows = torch.randn(7, 8, generator=gen).to(device).requires_grad_()
    weights = torch.rand(7, TOP_K, generator=gen).to(device).requires_grad_()
    local = _routing(7, 0, device)
    out = expert_pipeline(gemm_experts, local, _local(7), (gate_up, down), rows, weights, _arrived(weights))
    grad_out = torch.randn_like(out)
    leaves = [gate_up, down, rows, weights]
    got = torch.autograd.grad(out, leaves, grad_out)
    assert seen == [(2, ((7,), 1 << 30))]  # both GEMMs' dW, queued, run per tile
    assert accumulated == [False, False]
    if weight_dtype == torch.float32:
        assert {got[0].data_ptr(), got[1].data_ptr()} <= dw_buffers  # the kernel's output, not copies

    accumulated.clear()
    want_out = gemm_experts(rows, weights, local, gate_up, down)
    want = torch.autograd.grad(want_out, leaves, grad_out)
    assert accumulated == [False] * 2  # no queue: each GEMM its own dW
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_weights_changed_in_place_after_the_forward_are_caught():
    """Autograd's check of saved tensors' versions still covers the expert graph: a weight
    modified in place between forward and backward raises instead of giving wrong grads."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen, requires_grad=True)
    rows = torch.randn(5, 4, generator=gen, requires_grad=True)
    weights = torch.rand(5, 2, generator=gen, requires_grad=True)
    out = expert_pipeline(_expert_fn, _routing(5, 0), _local(5), (gate_up, down), rows, weights, _arrived(weights))
    with torch.no_grad():
        down.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_experts_run_with_autocast_off():
    """Under autocast the pipeline runs the expert function with it off, in the rows' dtype
    (weights cast to it): what the exchanges carry is the caller's choice, not autocast's.
    Outputs and gradients equal the computation without autocast."""
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(6, 4, generator=gen, requires_grad=True)
    down = torch.randn(4, 6, generator=gen, requires_grad=True)
    rows = torch.randn(5, 4, generator=gen, requires_grad=True)
    weights = torch.rand(5, TOP_K, generator=gen, requires_grad=True)
    local, seen = _routing(5, 0), []

    def experts(rows_SH, weights_SK, local, gate_up, down):
        seen.append((torch.is_autocast_enabled("cpu"), rows_SH.dtype, gate_up.dtype, down.dtype))
        return _expert_fn(rows_SH, weights_SK, local, gate_up, down)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = expert_pipeline(experts, local, _Delivering(), (gate_up, down), rows, weights, _arrived(weights))
    assert seen == [(False, torch.float32, torch.float32, torch.float32)] and out.dtype == torch.float32
    grad_out = torch.randn_like(out)
    leaves = [gate_up, down, rows, weights]
    got = torch.autograd.grad(out, leaves, grad_out)
    want_out = _expert_fn(rows, weights, local, gate_up, down)
    want = torch.autograd.grad(want_out, leaves, grad_out)
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


class _WidensCombine(_Delivering):
    """A combine that returns the rows in float32 (as CUDA autocast's ``sum`` did)."""

    def combine(self, x, kind):
        return PendingExchange(x.float())


class _WidensLandingGrads(_Delivering):
    """The backward's output gradients land source by source, in float32."""

    rows_dispatched = 0

    def dispatch(self, x, kind):
        self.rows_dispatched += kind == "rows"
        if kind == "rows" and self.rows_dispatched == 2:  # the backward's
            return PendingExchange(x.float(), landing=Landing(torch.ones(1, dtype=torch.int32), 0, 1))
        return super().dispatch(x, kind)


@pytest.mark.parametrize("exchange,pattern", [
    (_WidensCombine, r"_WidensCombine.combine returned torch.float32 rows for torch.float64 ones; an exchange must "
                     r"keep the rows' dtype"),
    (_WidensLandingGrads, r"output gradients arrive in torch.float32 for torch.float64 outputs; they must land in "
                          r"the outputs' dtype"),
])
def test_an_exchange_that_changes_the_rows_dtype_is_refused(exchange, pattern):
    """Rows that come back in another dtype would make the backward's gradients arrive in it,
    and autograd would cast landing gradients before they have landed: refused."""
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    down = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, TOP_K, generator=gen, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=pattern):
        out = expert_pipeline(_expert_fn, _routing(5, 0), exchange(), (gate_up, down), rows, weights,
                              _arrived(weights))
        out.sum().backward()
