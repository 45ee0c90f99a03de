"""The small-call path in bfloat16: eager calls of few routed rows run the experts through
torch._grouped_mm (:mod:`ep_moe.grouped_mm_experts`), and must match the Triton kernels, which
run everything else: more rows, torch.compile, CUDA graph capture. On one GPU, over NCCL at
EP = every GPU (up to 4; the all-gather's bounded rows, the all-to-all's received rows), and
at EP=2 on one GPU over gloo (the all-to-all's slot-row format and main format)."""

from __future__ import annotations

import pytest
import torch

from ep_moe import MoEConfig, MoELayer, grouped_mm_experts
from dist_utils import run_distributed
from ep_moe.ep.all_to_all import AllToAllDispatcher
from tolerance import rel_err, within

pytestmark = pytest.mark.gpu
MAX_REL_ERR = 1e-2
"""The two paths round differently in bf16 (the activation in two steps, the weighted rows
before the slot sum at EP=1): a few bf16 ulps, about 4e-3 relative at most; a wrong
gradient is off by far more."""


@pytest.fixture
def taken(monkeypatch):
    """Counts the calls that take the small-call path."""
    calls = []
    original = grouped_mm_experts.grouped_mm_mlp

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    import ep_moe.experts as experts_mod
    monkeypatch.setattr(experts_mod, "grouped_mm_mlp", counting)
    return calls


def _layer(dtype, **overrides) -> MoELayer:
    torch.manual_seed(0)
    config = MoEConfig(**{**dict(hidden_size=360, intermediate_size=200, num_experts=8, top_k=2,
                                 init_std=0.05, backend="triton"), **overrides})
    layer = MoELayer(config, device="cuda", dtype=dtype)
    with torch.no_grad():  # biases that matter
        for name in layer.experts.tensor_names():
            if name.endswith("bias"):
                layer.experts.tensor(name).normal_(0.0, 0.5)
    return layer


def _run(layer, x, dy, autocast):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("path", ["ep1", "ep"])
@pytest.mark.parametrize("overrides", [dict(), dict(top_k=4, activation="gelu"), dict(num_shared_experts=1),
                                       dict(activation="geglu", mlp_bias=True),
                                       dict(activation="identity", num_linears=1, intermediate_size=360, mlp_bias=True)],
                         ids=["top2", "top4_gelu", "shared", "geglu_bias", "one_linear_bias"])
@pytest.mark.parametrize("params", ["bf16", "fp32_autocast"])
@pytest.mark.parametrize("tokens", [1, 37, 500])
def test_small_calls_match_the_kernels(tokens, params, overrides, path, taken, monkeypatch):
    """Output and every gradient of a small eager call against the same call on the Triton
    kernels, at EP=1 and on the EP path (no group: no collective), with bf16 parameters and
    with fp32 ones under bf16 autocast (the trainer's); experts with biases and of one Linear
    (the DeepSpeed drop-in's forms) too."""
    layer = _layer(torch.bfloat16 if params == "bf16" else torch.float32, **overrides)
    if path == "ep":
        layer.dispatcher = AllToAllDispatcher(layer.config, None, 0, 1, layer.num_local_experts)
    x = torch.randn(tokens, 360, device="cuda", dtype=layer.experts.first_weight.dtype)
    dy = torch.randn(tokens, 360, device="cuda", dtype=torch.bfloat16)
    small = _run(layer, x, dy, params != "bf16")
    assert len(taken) == 1, "the small call did not take the torch._grouped_mm path"
    monkeypatch.setattr(grouped_mm_experts, "GROUPED_MM_MAX_ROWS", 0)
    kernels = _run(layer, x, dy, params != "bf16")
    assert len(taken) == 1, "a call over GROUPED_MM_MAX_ROWS took the small-call path"
    for i, (got, want) in enumerate(zip(small, kernels)):
        what = ["output", "dx"][i] if i < 2 else f"grad {i - 2}"
        assert got.dtype == want.dtype, what
        err = rel_err(got, want)
        assert within(err, MAX_REL_ERR, what, __name__), f"{what}: relative error {err:.2e} >= {MAX_REL_ERR}"


def test_compile_capture_and_large_calls_run_the_kernels(taken):
    """torch.compile, CUDA graph capture and calls over the bound run the Triton kernels; a
    layer whose small calls ran eagerly first is then captured with make_graphed_callables
    (its warm-up calls take the small path, its capture the kernels) and replays to the
    eager result."""
    layer = _layer(torch.bfloat16)
    rows_over = grouped_mm_experts.GROUPED_MM_MAX_ROWS // layer.config.top_k + 1
    with torch.no_grad():
        layer(torch.randn(rows_over, 360, device="cuda", dtype=torch.bfloat16))
    assert not taken
    x = torch.randn(64, 360, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    eager = _run(layer, x, dy, False)
    assert len(taken) == 1
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    with torch.no_grad():
        compiled(x)
    assert len(taken) == 1, "torch.compile took the small-call path"

    layer.zero_grad(set_to_none=True)
    graphed = torch.cuda.make_graphed_callables(layer, (x.detach().requires_grad_(),), num_warmup_iters=2)
    warmups = len(taken)
    assert warmups == 3, "the capture took the small-call path (or the warm-ups did not)"  # eager + 2 warm-ups
    layer.zero_grad(set_to_none=True)
    x_in = x.detach().requires_grad_()
    y = graphed(x_in)
    y.backward(dy)
    assert len(taken) == warmups, "a graph replay ran the small-call path"
    replayed = [y.detach(), x_in.grad] + [p.grad.clone() for p in layer.parameters()]
    for i, (got, want) in enumerate(zip(replayed, eager)):
        err = rel_err(got, want)
        assert within(err, MAX_REL_ERR, f"graphed {i}", __name__), f"graphed {i}: {err:.2e}"


def _ep_worker(rank: int, world_size: int) -> dict:
    """Each dispatch at EP=world_size over NCCL: a small call on the small-call path (the
    all-gather's bounded rows, the all-to-all's received rows), then the same call on the
    kernels; this rank's output, input gradient and parameter gradients, relative errors."""
    import datetime

    import torch.distributed as dist

    import ep_moe.experts as experts_mod

    torch.cuda.set_device(rank)
    group = dist.new_group(list(range(world_size)), backend="nccl", timeout=datetime.timedelta(seconds=300))
    bounded = []
    original = grouped_mm_experts.grouped_mm_mlp

    def counting(*args, **kwargs):
        bounded.append(kwargs["bounded_rows"])
        return original(*args, **kwargs)

    experts_mod.grouped_mm_mlp = counting
    errors = {}
    for dispatch in ("all_gather", "all_to_all"):
        for variant, overrides in (("top2", dict()), ("geglu_bias", dict(activation="geglu", mlp_bias=True))):
            for params in ("bf16", "fp32_autocast"):
                dtype = torch.bfloat16 if params == "bf16" else torch.float32
                torch.manual_seed(0)
                config = MoEConfig(hidden_size=360, intermediate_size=200, num_experts=8, top_k=2, init_std=0.05,
                                   backend="triton", dispatch=dispatch, **overrides)
                layer = MoELayer(config, group, device="cuda", dtype=dtype)
                with torch.no_grad():
                    for name in layer.experts.tensor_names():
                        if name.endswith("bias"):
                            layer.experts.tensor(name).normal_(0.0, 0.5)
                for tokens in (1, 37):
                    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
                    x = torch.randn(tokens, 360, device="cuda", dtype=dtype, generator=gen)
                    dy = torch.randn(tokens, 360, device="cuda", dtype=torch.bfloat16, generator=gen)
                    bounded.clear()
                    grouped_mm_experts.GROUPED_MM_MAX_ROWS = 4096
                    small = _run(layer, x, dy, params != "bf16")
                    taken = list(bounded)
                    grouped_mm_experts.GROUPED_MM_MAX_ROWS = 0
                    kernels = _run(layer, x, dy, params != "bf16")
                    key = f"{dispatch}-{variant}-{params}-{tokens}"
                    errors[key] = dict(taken=taken, errs=[rel_err(a, b) for a, b in zip(small, kernels)],
                                       dtypes_match=all(a.dtype == b.dtype for a, b in zip(small, kernels)))
                if dispatch == "all_gather":  # its small calls keep the all-gather free of host syncs
                    grouped_mm_experts.GROUPED_MM_MAX_ROWS = 4096
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        _run(layer, x, dy, params != "bf16")
                        errors[f"sync-{variant}-{params}"] = None
                    except RuntimeError as error:
                        errors[f"sync-{variant}-{params}"] = str(error)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
    return errors


@pytest.mark.distributed
def test_small_calls_on_the_ep_path_match_the_kernels_over_nccl():
    """The all-gather's bounded rows (masked past the count on the small-call path) and the
    all-to-all's received rows, at EP = every GPU (up to 4): the small call's output and every
    gradient against the kernels', bf16 parameters and fp32 ones under autocast; the
    all-gather's small call without a host sync (``set_sync_debug_mode("error")``)."""
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        pytest.skip(f"needs 2 or more GPUs, found {num_gpus}")
    for rank, errors in enumerate(run_distributed(_ep_worker, min(num_gpus, 4), timeout_s=300)):
        for key in [key for key in errors if key.startswith("sync-")]:
            assert errors.pop(key) is None, f"rank {rank} {key}: the all-gather's small call synced with the host"
        for key, res in errors.items():
            want = [True] if key.startswith("all_gather") else [False]
            nothing_received = key.startswith("all_to_all") and key.endswith("-1") and res["taken"] == []
            assert res["taken"] == want or nothing_received, \
                f"rank {rank} {key}: small-call path taken as {res['taken']}, not {want}"
            assert res["dtypes_match"], f"rank {rank} {key}"
            for i, err in enumerate(res["errs"]):
                what = f"rank {rank} {key} " + (["output", "dx"][i] if i < 2 else f"grad {i - 2}")
                assert within(err, MAX_REL_ERR, what, __name__), f"{what}: relative error {err:.2e}"


def _one_gpu_worker(rank: int, world_size: int) -> dict:
    """EP=2 with both ranks on GPU 0 over gloo (NCCL refuses two ranks on one GPU): small
    calls in the all-to-all's slot-row format, then forced onto its main format; this rank's
    output, input gradient and parameter gradients (experts by global id), on the CPU."""
    import torch.distributed as dist

    import ep_moe.ep.all_to_all as all_to_all

    formats = []
    send = all_to_all.AllToAllDispatcher._send_slot_rows
    all_to_all.AllToAllDispatcher._send_slot_rows = lambda self, *args: formats.append(1) or send(self, *args)
    vote = all_to_all.wants_slot_rows
    results = {}
    for name, overrides in ONE_GPU_CASES.items():
        state, xs, dys = _one_gpu_case(name, overrides, world_size)
        for fmt in ("slot_rows", "main_format"):
            all_to_all.wants_slot_rows = vote if fmt == "slot_rows" else (lambda x, num_slots: False)
            layer = _one_gpu_layer(overrides, dist.group.WORLD)
            layer.load_state_dict(state)
            formats.clear()
            run = _run(layer, xs[rank].cuda(), dys[rank].cuda(), False)
            results[name, fmt] = dict(run=[t.float().cpu() for t in run[:2]], grads=_by_global_id(layer),
                                      formats=list(formats))
    return results


ONE_GPU_CASES = {
    "top2": dict(top_k=2),
    "capacity": dict(top_k=3, capacity_factor=0.75),
    # every token picks rank 0's experts: rank 1 receives no rows
    "skewed": dict(top_k=2),
}


def _one_gpu_layer(overrides: dict, group=None) -> MoELayer:
    config = MoEConfig(**{**dict(hidden_size=360, intermediate_size=200, num_experts=8, init_std=0.05,
                                 backend="triton", dispatch="all_to_all"), **overrides})
    return MoELayer(config, group, device="cuda", dtype=torch.bfloat16)


def _one_gpu_case(name: str, overrides: dict, world_size: int):
    """(state dict, per-rank inputs, per-rank output gradients), bf16 on the CPU."""
    torch.manual_seed(3)
    state = _one_gpu_layer(overrides).state_dict()
    gen = torch.Generator().manual_seed(list(ONE_GPU_CASES).index(name))
    xs = [torch.randn(37 + 5 * r, 360, generator=gen) for r in range(world_size)]
    if name == "skewed":
        xs = [x.abs() + 0.1 for x in xs]
        router = state["router.weight"].float().abs()
        router[8 // world_size:] *= -1
        state["router.weight"] = router.to(torch.bfloat16)
    return state, [x.to(torch.bfloat16) for x in xs], [torch.randn_like(x).to(torch.bfloat16) for x in xs]


def _by_global_id(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Parameter gradients on the CPU in fp32, the experts' keyed by global expert id."""
    grads = {name: p.grad.float().cpu() for name, p in layer.named_parameters()
             if name not in ("experts.gate_up", "experts.down")}
    for name in ("gate_up", "down"):
        stacked = getattr(layer.experts, name).grad
        for j, expert in enumerate(layer.experts.global_ids()):
            grads[f"experts.{name}.{expert}"] = stacked[j].float().cpu()
    return grads


@pytest.mark.distributed
def test_small_calls_at_ep2_on_one_gpu_match_ep1():
    """The all-to-all at EP=2 on a single GPU (gloo moving CUDA tensors): its CUDA paths (the
    counts copied to pinned memory on a side stream, a rank receiving no rows) in bf16, in the
    slot-row format and in its main format, against EP=1 on the fused kernels."""
    results = run_distributed(_one_gpu_worker, 2, timeout_s=300)
    for name, overrides in ONE_GPU_CASES.items():
        state, xs, dys = _one_gpu_case(name, overrides, 2)
        reference = _one_gpu_layer(overrides)
        reference.load_state_dict(state)
        grouped_mm_experts.GROUPED_MM_MAX_ROWS, saved = 0, grouped_mm_experts.GROUPED_MM_MAX_ROWS
        refs = []
        try:
            for x, dy in zip(xs, dys):  # the parameter gradients summed over both ranks' tokens
                x = x.cuda().requires_grad_()
                y = reference(x)
                y.backward(dy.cuda())
                refs.append((y.detach(), x.grad))
        finally:
            grouped_mm_experts.GROUPED_MM_MAX_ROWS = saved
        ref_grads = _by_global_id(reference)
        for fmt in ("slot_rows", "main_format"):
            assert [res[name, fmt]["formats"] for res in results] == [[1] if fmt == "slot_rows" else []] * 2
            summed = {}
            for rank, res in enumerate(results):
                for what, got, want in zip(("output", "dx"), res[name, fmt]["run"], refs[rank]):
                    err = rel_err(got, want.float().cpu())
                    assert within(err, MAX_REL_ERR, f"{name} {fmt} rank {rank} {what}", __name__), err
                for key, grad in res[name, fmt]["grads"].items():
                    summed[key] = summed.get(key, 0) + grad
            assert summed.keys() == ref_grads.keys()
            for key, grad in ref_grads.items():
                err = rel_err(summed[key], grad)
                assert within(err, MAX_REL_ERR, f"{name} {fmt} grad {key}", __name__), err
