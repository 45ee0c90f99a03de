"""MoELayer on one GPU in bfloat16: under torch.compile, and through its EP>1 code path.

``torch.compile`` must trace the layer (grouped GEMM custom ops, the gate as torch math, the
tuned configs looked up at trace time as constants) and match eager. The EP>1 path (per-rank routing, token permute,
the receiver's routing and slot sum, the per-token sum of returned rows, the pipeline) runs
here with no group, so no collective: it must match the EP=1 path on the same tokens.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ep_moe import MoEConfig, MoELayer, grouped_mm_experts
from ep_moe.ep.all_to_all import AllToAllDispatcher
from tolerance import rel_err, within

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fused_kernels(monkeypatch):
    """Every call here runs the Triton kernels, small ones too (torch._grouped_mm's small-call
    path: tests/gpu/test_grouped_mm_cuda.py)."""
    monkeypatch.setattr(grouped_mm_experts, "GROUPED_MM_MAX_ROWS", 0)

MAX_REL_ERR = 1e-3
"""Both sides run in bf16 on the same kernels and routing, so they differ only in summation
order: the worst measured on H200 is 2.9e-5; a wrong gradient is off by 1e-2 and more."""


def _layer(dtype: torch.dtype = torch.bfloat16, **overrides) -> MoELayer:
    torch.manual_seed(0)
    config = MoEConfig(**{**dict(hidden_size=360, intermediate_size=200, num_experts=8, top_k=2,
                                 init_std=0.05, backend="triton"), **overrides})
    return MoELayer(config, device="cuda", dtype=dtype)


def _forward_backward(forward, layer: MoELayer, x: torch.Tensor, dy: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = forward(x)
    y.backward(dy.to(y.dtype))  # (an fp32 output under autocast would take the gradient in fp32)
    return y.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]


def _compare(got, want) -> None:
    (y, dx, grads), (ref_y, ref_dx, ref_grads) = got, want
    pairs = {"output": (y, ref_y), "dx": (dx, ref_dx), **{f"grad {i}": g for i, g in enumerate(zip(grads, ref_grads))}}
    for what, (a, b) in pairs.items():
        err = rel_err(a, b)
        assert within(err, MAX_REL_ERR, what, __name__), f"{what}: relative error {err:.2e} >= {MAX_REL_ERR}"


def test_compiled_layer_matches_eager():
    layer = _layer()
    x = torch.randn(301, 360, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    eager = _forward_backward(layer, layer, x, dy)
    torch._dynamo.reset()
    compiled = _forward_backward(torch.compile(layer), layer, x, dy)
    _compare(compiled, eager)


@pytest.mark.parametrize("overrides", [dict(), dict(top_k=4, activation="gelu"), dict(capacity_factor=0.5),
                                       dict(num_shared_experts=1)],
                         ids=["top2", "top4_gelu", "capacity", "shared"])
def test_ep_code_path_matches_ep1_path(overrides):
    layer = _layer(**overrides)
    x = torch.randn(513, 360, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    local = _forward_backward(layer, layer, x, dy)
    layer.dispatcher = AllToAllDispatcher(layer.config, None, 0, 1, layer.num_local_experts)  # no group: no collective
    _compare(_forward_backward(layer, layer, x, dy), local)


def test_ep_code_path_matches_ep1_path_fp32_params_under_autocast():
    """fp32 parameters and input, forward under bf16 autocast: the EP path matches the EP=1
    path, and both return the autocast dtype (bf16), as ``nn.Linear`` does."""
    layer = _layer(dtype=torch.float32)
    x = torch.randn(513, 360, device="cuda")
    dy = torch.randn(513, 360, device="cuda", dtype=torch.bfloat16)

    def forward(x_in):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(x_in)

    local = _forward_backward(forward, layer, x, dy)
    layer.dispatcher = AllToAllDispatcher(layer.config, None, 0, 1, layer.num_local_experts)  # no group: no collective
    parallel = _forward_backward(forward, layer, x, dy)
    _compare(parallel, local)
    assert parallel[0].dtype == torch.bfloat16, f"EP path: output {parallel[0].dtype} under autocast"
    assert local[0].dtype == torch.bfloat16, f"EP=1 path: output {local[0].dtype} under autocast"


@pytest.mark.parametrize("path", ["ep1", "ep"])
def test_checkpointed_layer_matches_plain_and_frees_its_activations(path):
    """A non-reentrant activation checkpoint of the layer (EP=1 path, or the EP path with no
    group) gives the plain run's outputs and gradients, and between forward and backward
    holds far less memory (the expert pipeline's graph saves through its hooks)."""
    from torch.utils.checkpoint import checkpoint

    layer = _layer()
    if path == "ep":
        layer.dispatcher = AllToAllDispatcher(layer.config, None, 0, 1, layer.num_local_experts)  # no group: no collective
    x = torch.randn(4096, 360, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    held = {}

    def forward_holding(mode):
        def run(x_in):
            # no garbage collection inside the window: freeing an earlier test's leftovers there
            # (a reference cycle of an earlier test) would
            # shrink what the forward seems to hold
            gc.collect()
            gc.disable()
            try:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                y = layer(x_in) if mode == "plain" else checkpoint(layer, x_in, use_reentrant=False)
                torch.cuda.synchronize()
                held[mode] = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
            finally:
                gc.enable()
            return y
        return run

    plain = _forward_backward(forward_holding("plain"), layer, x, dy)
    checkpointed = _forward_backward(forward_holding("checkpoint"), layer, x, dy)
    _compare(checkpointed, plain)
    assert held["checkpoint"] < 0.5 * held["plain"], held


def test_small_forwards_without_autograd_replay_a_cuda_graph(monkeypatch):
    """ep_moe.forward_graphs on the GPU: a shape's third forward without autograd captures,
    later ones replay, matching the eager forward (output and stats) for bf16 parameters and
    fp32 ones under autocast, in inference mode, after an in-place update of the experts' and
    the shared experts' weights (under autocast, a graph that kept autocast's cached cast of a
    shared-expert weight would miss it), with an expert bias (its token counts once per call),
    without a host sync on replay, and the stats it hands out are not overwritten by the next
    replay."""
    from contextlib import nullcontext

    from ep_moe import forward_graphs

    captured = []
    capture = forward_graphs._capture
    monkeypatch.setattr(forward_graphs, "_capture", lambda *args: captured.append(args[1][0].shape) or capture(*args))
    for params in ("bf16", "fp32_autocast"):
        dtype = torch.bfloat16 if params == "bf16" else torch.float32
        layer = _layer(dtype, num_shared_experts=1, expert_bias=True)

        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16) if params == "fp32_autocast" else nullcontext()

        gen = torch.Generator(device="cuda").manual_seed(1)
        captured.clear()

        def check(x, what):
            with autocast():
                got = layer(x)
                got_stats = layer.last_stats
                want = layer._eager_forward(x)
            err = rel_err(got, want)
            assert within(err, MAX_REL_ERR, f"{params} {what}", __name__), f"{params} {what}: {err:.2e}"
            assert torch.equal(got_stats.tokens_per_expert, layer.last_stats.tokens_per_expert), f"{params} {what}"
            return got_stats

        with torch.no_grad():
            layer.eval()
            for tokens in (1, 37, 256):
                for call in range(4):
                    check(torch.randn(tokens, 360, device="cuda", dtype=dtype, generator=gen), f"T={tokens} call {call}")
            assert captured == [(1, 360), (37, 360), (256, 360)], f"{params}: captured {captured}"
            x = torch.randn(37, 360, device="cuda", dtype=dtype, generator=gen)
            layer.experts.down.mul_(0.5)  # in place: the graph reads the new values,
            layer.shared_experts.down.weight.mul_(0.5)  # of nn.Linear too (no autocast cast cached)
            stats = check(x, "after an in-place update")
            kept = stats.tokens_per_expert.clone()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with autocast():
                    layer(x.flip(0) * 3.0)  # a replay
            finally:
                torch.cuda.set_sync_debug_mode(0)
            check(x.flip(0) * 3.0, "another replay")
            assert torch.equal(stats.tokens_per_expert, kept), f"{params}: a replay overwrote stats handed out"
            layer.train()
            layer.reset_load_count()
            calls = 5
            for _ in range(calls):
                with autocast():
                    layer(x)
            assert torch.equal(layer._load_since_update, calls * layer.last_stats.tokens_per_expert), params
        with torch.inference_mode():
            layer.eval()
            for call in range(4):
                check(torch.randn(16, 360, device="cuda", dtype=dtype, generator=gen), f"inference mode call {call}")
        assert layer.forward_graphs.enabled and len(captured) == 5, f"{params}: captured {captured}"
