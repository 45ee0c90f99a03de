"""MoEConfig(expert_precision="fp8") on one GPU in bfloat16, on the FP8 tensor cores: the
layer against the same layer with bf16 experts (same weights, same routing), within the
recipe's bound and off by more than bf16's noise (quantized, not silently bf16), for bf16
parameters and fp32 master weights under autocast, at EP=1 and through the EP code path
(the expert pipeline, with no group), small calls included (they take no torch._grouped_mm);
the weights' e4m3 copies after an optimizer step, eagerly and in the CUDA graphs of small
forwards (a replay quantizes the weights as they are then).

The math against a float64 reference of the same quantization is checked on the CPU
(``tests/test_fp8_layer.py``, the Triton interpreter in float16).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from ep_moe import MoEConfig, MoELayer
from ep_moe.ep.all_to_all import AllToAllDispatcher
from ep_moe.ep.slot_rows import SLOT_ROWS_MAX_SLOTS
from ep_moe.kernels.fp8 import fp8_supported
from tolerance import rel_err, within

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.is_available() and not fp8_supported(torch.device("cuda"))[0],
                       reason="no FP8 tensor cores on this GPU (compute capability 8.9 or newer)"),
]

LAYER_BOUND = 1e-1
"""Relative Frobenius error of the FP8 layer (output and every gradient) against the same
layer with bf16 experts: the recipe's 3.5-4.5e-2 per GEMM, two in a row; on the CPU (float16
against float64) 3.1-6.9e-2 for the output and up to 9.3e-2 for the router's gradient."""
QUANTIZED_ABOVE = 1e-2
"""The FP8 output differs from the bf16 experts' by more than this (bf16's own noise is
about 4e-3)."""


def _pair(dtype: torch.dtype, **overrides) -> tuple[MoELayer, MoELayer]:
    """(FP8 layer, bf16 layer) with the same weights."""
    torch.manual_seed(0)
    config = {**dict(hidden_size=360, intermediate_size=200, num_experts=8, top_k=2, init_std=0.05), **overrides}
    fp8 = MoELayer(MoEConfig(**config, expert_precision="fp8"), device="cuda", dtype=dtype)
    plain = MoELayer(MoEConfig(**config, backend="triton"), device="cuda", dtype=dtype)
    if fp8.config.mlp_bias:
        with torch.no_grad():
            fp8.experts.gate_up_bias.normal_(0.0, 0.05)
            fp8.experts.down_bias.normal_(0.0, 0.05)
    plain.load_state_dict(fp8.state_dict())
    return fp8, plain


def _run(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor, autocast: bool):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext():
        y = layer(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}


def _compare(got, want, what: str) -> None:
    (y, dx, grads), (ref_y, ref_dx, ref_grads) = got, want
    assert grads.keys() == ref_grads.keys(), what
    err = rel_err(y, ref_y)
    assert QUANTIZED_ABOVE < err, f"{what} output: {err:.2e}, as close as bf16 experts: not quantized?"
    for name, (a, b) in {"output": (y, ref_y), "dx": (dx, ref_dx),
                         **{n: (g, ref_grads[n]) for n, g in grads.items()}}.items():
        err = rel_err(a, b)
        assert within(err, LAYER_BOUND, f"{what} {name}", __name__), f"{what} {name}: {err:.2e} >= {LAYER_BOUND}"


@pytest.mark.parametrize("params", ["bf16", "fp32_autocast"])
@pytest.mark.parametrize("overrides", [dict(), dict(capacity_factor=0.75), dict(mlp_bias=True),
                                       dict(top_k=1, num_linears=1, activation="identity", intermediate_size=360)],
                         ids=["top2", "capacity", "bias", "one_linear"])
# 2053 tokens: 4106 routed rows, at least TMA_MIN_ROWS, so the kernels take their TMA paths (the
# dW's TMA store only for a dw in the rows' dtype: fp32 master weights get pointer stores)
@pytest.mark.parametrize("tokens", [8, 1021, 2053], ids=["small", "large", "tma_rows"])
def test_fp8_layer_within_the_bound_of_bf16_experts(params, overrides, tokens):
    autocast = params == "fp32_autocast"
    fp8, plain = _pair(torch.float32 if autocast else torch.bfloat16, **overrides)
    x = torch.randn(tokens, 360, device="cuda", dtype=fp8.experts.down.dtype)
    dy = torch.randn(tokens, 360, device="cuda", dtype=torch.bfloat16)
    got = _run(fp8, x, dy, autocast)
    _compare(got, _run(plain, x, dy, autocast), f"{params} T={tokens}")
    assert all(g.dtype == fp8.experts.down.dtype for g in got[2].values())  # the master weights' dtype
    # the EP code path (the expert pipeline: weights as stand-ins, cast, their dW deferred)
    for layer in (fp8, plain):
        layer.dispatcher = AllToAllDispatcher(layer.config, None, 0, 1, layer.num_local_experts)  # no group
    _compare(_run(fp8, x, dy, autocast), _run(plain, x, dy, autocast), f"{params} T={tokens} EP path")


def test_fp8_weight_copies_follow_optimizer_steps_in_cuda_graphs():
    """Small forwards without autograd replay a CUDA graph (``ep_moe.forward_graphs``): the
    graph quantizes the weights itself (no cached copy captured), so a replay after an
    optimizer step matches the eager forward of the stepped weights."""
    fp8, _ = _pair(torch.bfloat16)
    optimizer = torch.optim.Adam(fp8.parameters(), lr=1e-2)  # steps of about 1e-2: a fifth of a weight
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(37, 360, device="cuda", dtype=torch.bfloat16, generator=gen)
    fp8.eval()
    with torch.no_grad():
        outputs = [fp8(x) for _ in range(4)]  # the third captures, the fourth replays
    assert len(fp8.forward_graphs._graphs) == 1, "no graph captured"
    for grad_step in range(2):
        y = fp8._eager_forward(x.requires_grad_())
        y.float().square().mean().backward()
        before = fp8.experts.down.detach().clone()
        optimizer.step()
        assert not torch.equal(fp8.experts.down, before)
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            replayed, eager = fp8(x.detach()), fp8._eager_forward(x.detach())
        err = rel_err(replayed, eager)
        assert within(err, 1e-3, f"replay after step {grad_step}", __name__), f"step {grad_step}: {err:.2e}"
        assert rel_err(replayed, outputs[-1]) > 1e-3, "the replay kept the old weights' copies"
        outputs.append(replayed)


# ---------------------------------------------------------------------------------------
# EP=2 over NCCL against EP=1.

_MAIN_FORMAT_TOKENS = SLOT_ROWS_MAX_SLOTS // 2 + 76
EP_CASES = {"all_to_all": _MAIN_FORMAT_TOKENS, "all_gather": _MAIN_FORMAT_TOKENS, "all_to_all_slot_rows": 300}
"""Dispatch (the all-to-all's slot rows: its format for small eager calls) -> tokens a rank
(top-2): past the slot rows' vote the all-to-all sends its main format, 300 take the slot rows."""
EP_SAME_QUANT = 1e-2
"""EP=2 against EP=1 with the same FP8 operands (each row scaled alone, so both quantize
alike): the difference is bf16's rounding of sums in another order (a few 1e-3), well below
a quantization that one side skipped (3.5-4.5e-2)."""
SLOT_ROWS_GRADS = 1e-1
"""The slot rows' gradients against EP=1's (the output stays within EP_SAME_QUANT): the
router's share of the input gradient comes from the top-k weights' gradient, which the slot
rows take from the experts' outputs (fp32, at the sender) where the main format takes it
from the FP8 dX's row dots (3.3e-2 apart on an H200), and the experts see each output
gradient already weighted and rounded to bf16 before its row is quantized (the first
experts' gate_up gradient 1.4e-2 apart): within the FP8 layer's bound of the bf16 one
(``bench_ep.py``'s)."""


def _ep_setup(world_size: int, tokens: int):
    """(the EP=1 FP8 layer's state dict, per-rank tokens and output gradients)."""
    fp8, _ = _pair(torch.bfloat16, mlp_bias=True)
    state = {k: v.cpu() for k, v in fp8.state_dict().items()}
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randn(tokens, 360, generator=gen).bfloat16() for _ in range(world_size)]  # the all-gather: equal
    return state, inputs, [torch.randn(x.shape, generator=gen).bfloat16() for x in inputs]


def _dispatch(case: str) -> str:
    return case.removesuffix("_slot_rows")


def _expert_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {f"{name}.{e}": p.grad[j].float().cpu() for name, p in layer.experts.named_parameters()
            for j, e in enumerate(layer.experts.global_ids())}


def _fp8_ep_worker(rank: int, world_size: int) -> dict:
    import datetime

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    group = dist.new_group(list(range(world_size)), backend="nccl", timeout=datetime.timedelta(seconds=300))
    try:
        out = {}
        for case, tokens in EP_CASES.items():
            state, inputs, grads = _ep_setup(world_size, tokens)
            config = MoEConfig(hidden_size=360, intermediate_size=200, num_experts=8, top_k=2, init_std=0.05,
                               mlp_bias=True, expert_precision="fp8", dispatch=_dispatch(case))
            layer = MoELayer(config, group, device="cuda", dtype=torch.bfloat16)
            layer.load_state_dict(state)
            x = inputs[rank].cuda().requires_grad_()
            y = layer(x)
            y.backward(grads[rank].cuda())
            out[case] = dict(y=y.detach().float().cpu(), dx=x.grad.float().cpu(), grads=_expert_grads(layer),
                             dispatch=layer.dispatch)
            del layer  # before the group goes
        return out
    finally:
        dist.destroy_process_group(group)


@pytest.mark.distributed
def test_fp8_ep2_over_nccl_matches_ep1():
    """FP8 experts split over two GPUs (NCCL; the all-to-all in both its formats and the
    all-gather): each rank's output and input gradient, and every expert tensor's gradient,
    equal the EP=1 FP8 layer's over the same tokens (the expert gradients summed over both
    ranks' tokens); the slot rows' gradients within :data:`SLOT_ROWS_GRADS`."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    from dist_utils import run_distributed

    results = run_distributed(_fp8_ep_worker, 2, timeout_s=300)
    for case, tokens in EP_CASES.items():
        state, inputs, grads = _ep_setup(2, tokens)
        layer = MoELayer(MoEConfig(hidden_size=360, intermediate_size=200, num_experts=8, top_k=2, init_std=0.05,
                                   mlp_bias=True, expert_precision="fp8"), device="cuda", dtype=torch.bfloat16)
        layer.load_state_dict(state)
        for rank in range(2):
            x = inputs[rank].cuda().requires_grad_()
            y = layer(x)
            y.backward(grads[rank].cuda())  # the expert gradients: both ranks' tokens
            got = results[rank][case]
            assert got["dispatch"] == _dispatch(case)
            for what, mine, want in (("output", got["y"], y), ("dx", got["dx"], x.grad)):
                bound = SLOT_ROWS_GRADS if what == "dx" and case.endswith("slot_rows") else EP_SAME_QUANT
                err = rel_err(mine, want.float().cpu())
                assert within(err, bound, f"EP=2 {case} {what}", __name__), f"{case} {what}: {err:.2e}"
        want = _expert_grads(layer)
        got = {**results[0][case]["grads"], **results[1][case]["grads"]}
        assert got.keys() == want.keys()
        bound = SLOT_ROWS_GRADS if case.endswith("slot_rows") else EP_SAME_QUANT
        for name, grad in want.items():
            err = rel_err(got[name], grad)
            assert within(err, bound, f"EP=2 {case} {name}", __name__), f"{case} {name}: {err:.2e}"
