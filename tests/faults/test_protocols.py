"""The layer under Python's and PyTorch's protocols (issue 46, part 3): ``copy.deepcopy`` and
``torch.optim.swa_utils.AveragedModel`` after training steps (``last_stats`` holds tensors of
the step's graph, which deepcopy refuses), pickling (``torch.save`` of the module),
``torch.func.functional_call``, a forward on the meta device (shape inference before
materialisation), and double backward: exact on the torch backend at EP=1, one clear error
where the backward is not differentiable again (the Triton backend, EP>1)."""

import copy
import io
import pickle
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ep_moe.experts as experts_mod
from dist_utils import run_distributed
from ep_moe import MoELayer
from ep_moe.layer import expert_load, moe_aux_loss
from layer_helpers import H, _config, _naive_params, naive_moe

pytestmark = pytest.mark.faults

DOUBLE_BACKWARD = r"double backward \(create_graph=True\) through an ep_moe MoE layer is not supported"


@pytest.fixture(autouse=True)
def _default_kernel_configs(monkeypatch):
    """Triton runs on the kernels' default configs (no autotune cache read)."""
    monkeypatch.setattr(experts_mod, "_kernel_configs", lambda problem, num_rows, device: None)
    monkeypatch.delenv("EP_MOE_DEBUG", raising=False)


def _trained(backend="torch", steps=2, **overrides):
    """A dense layer around an MoE layer after ``steps`` SGD steps (aux and z losses on):
    its ``last_stats`` holds the last step's graph tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), MoELayer(_config(top_k=2, backend=backend, **overrides)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(step))
        (model(x).square().mean() + moe_aux_loss(model)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert model[1].last_stats.aux_loss.grad_fn is not None  # what deepcopy used to refuse
    return model


def _same_module(copied, model):
    """``copied`` holds ``model``'s values in tensors of its own, and computes what it computes."""
    for (name, a), (_, b) in zip(model.state_dict().items(), copied.state_dict().items()):
        assert torch.equal(a, b), name
        assert a.data_ptr() != b.data_ptr(), f"{name} is shared with the original"
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(copied(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deepcopy_after_training_steps(backend):
    model = _trained(backend, expert_bias=True, num_shared_experts=1)
    copied = copy.deepcopy(model)
    assert copied[1].last_stats is None  # the copy ran no forward: no stats, no graph shared
    assert model[1].last_stats is not None  # the original's are untouched
    assert torch.equal(copied[1]._load_since_update, model[1]._load_since_update)
    _same_module(copied, model)
    (copied(torch.randn(4, H)).sum() + moe_aux_loss(copied)).backward()  # the copy trains on its own
    assert all(p.grad is None for p in model.parameters())
    assert expert_load(copied).shape == (1, 8)


def test_averaged_model_after_training_steps():
    model = _trained()
    swa = torch.optim.swa_utils.AveragedModel(model)
    swa.update_parameters(model)
    _same_module(swa.module, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    swa.update_parameters(model)  # the average of the two
    for (name, avg), p in zip(swa.module.named_parameters(), model.parameters()):
        torch.testing.assert_close(avg, p - 0.5, msg=name)


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_pickle_after_training_steps(how):
    model = _trained()
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    else:
        loaded = pickle.loads(pickle.dumps(model))
    assert loaded[1].last_stats is None  # stats of a forward are no state of the module
    _same_module(loaded, model)


def test_functional_call_after_training_steps():
    model = _trained()
    params = {name: p.detach() * 0.5 for name, p in model.named_parameters()}
    x = torch.randn(5, H)
    y = torch.func.functional_call(model, params, (x,))
    halved = copy.deepcopy(model)
    with torch.no_grad():
        for p in halved.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(y, halved(x), rtol=0, atol=0)
    # gradients through functional_call reach the parameters passed in
    params = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    torch.func.functional_call(model, params, (x,)).sum().backward()
    assert params["1.router.weight"].grad is not None and params["1.experts.down"].grad.abs().sum() > 0


META_CONFIGS = {
    "plain": dict(top_k=2),
    "shared+bias": dict(top_k=2, num_shared_experts=1, expert_bias=True, mlp_bias=True),
    "capacity": dict(top_k=2, capacity_factor=1.0),
    "triton": dict(top_k=2, backend="triton"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(META_CONFIGS))
def test_meta_device_forward_returns_meta_outputs(name, dtype):
    """Shape inference before FSDP's materialisation: a meta layer's forward returns a meta
    output of the input's shape and the layer's dtype, with meta stats, and no value read."""
    with torch.device("meta"):
        layer = MoELayer(_config(**META_CONFIGS[name]), dtype=dtype)
        x = torch.randn(2, 3, H, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.is_meta and y.shape == x.shape and y.dtype == dtype
    assert y.requires_grad
    stats = layer.last_stats
    assert stats.aux_loss.is_meta and stats.aux_loss.shape == () and stats.aux_loss.requires_grad
    assert stats.tokens_per_expert.is_meta and stats.tokens_per_expert.shape == (8,)
    assert stats.tokens_per_expert.dtype == torch.int64 and stats.num_dropped.is_meta
    assert moe_aux_loss(layer).is_meta
    (y.sum() + moe_aux_loss(layer)).backward()  # meta gradients, of the parameters' shapes
    assert layer.router.weight.grad.is_meta and layer.experts.down.grad.shape == layer.experts.down.shape
    # then materialised as FSDP does, the layer runs for real
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert layer(torch.randn(4, H, dtype=dtype)).is_meta is False


def test_meta_device_forward_still_checks_the_input():
    with torch.device("meta"):
        layer = MoELayer(_config(top_k=2))
    with pytest.raises(ValueError, match=r"x has shape \(4, 12\) but the layer's hidden_size is 16"):
        layer(torch.empty(4, 12, device="meta"))
    with pytest.raises(ValueError, match=r"x is on cpu but the layer is on meta; move one of them"):
        layer(torch.randn(4, H))


@pytest.mark.filterwarnings("ignore:ep_moe runs the expert module")
@pytest.mark.parametrize("name", ["plain", "capacity", "shared", "one Linear", "expert module, capacity"])
@pytest.mark.parametrize("style", ["backward", "autograd.grad"])
def test_double_backward_on_triton_raises_one_clear_error(style, name):
    """Both call styles end in the same error naming the fix, at the first backward that
    asks for a graph (not later, in a second backward that misses the expert weights)."""
    overrides = {"plain": {}, "capacity": dict(capacity_factor=1.0), "shared": dict(num_shared_experts=1),
                 "one Linear": dict(num_linears=1, activation="identity", intermediate_size=H),
                 "expert module, capacity": dict(capacity_factor=0.5)}[name]  # slots dropped: sum_slot_rows
    module = nn.Sequential(nn.Linear(H, 8), nn.GELU(), nn.Linear(8, H)) if "module" in name else None
    layer = MoELayer(_config(top_k=2, backend="triton", **overrides), expert_module=module)
    x = torch.randn(5, H, requires_grad=True)
    loss = layer(x).square().sum()
    with pytest.raises(RuntimeError, match=rf"{DOUBLE_BACKWARD} on the Triton backend \(its kernels' backward is "
                                           r"not differentiable again\); build the layer with "
                                           r"MoEConfig\(backend='torch'\), whose backward is, at EP=1"):
        if style == "backward":
            loss.backward(create_graph=True)
        else:
            torch.autograd.grad(loss, x, create_graph=True)


def test_first_order_backward_on_triton_is_unchanged():
    """No graph asked for: the backward runs as before, also inside an enable_grad block."""
    layer = MoELayer(_config(top_k=2, backend="triton"))
    x = torch.randn(5, H, requires_grad=True)
    with torch.enable_grad():
        layer(x).square().sum().backward()
    assert x.grad is not None and layer.experts.down.grad.abs().sum() > 0


DOUBLE_CONFIGS = {
    "dropless": dict(top_k=2),
    "capacity": dict(top_k=2, capacity_factor=0.75),
    "shared": dict(top_k=2, num_shared_experts=1),
    "gelu": dict(top_k=2, activation="gelu", norm_topk_prob=False),
}


@pytest.mark.parametrize("style", ["backward", "autograd.grad"])
@pytest.mark.parametrize("name", list(DOUBLE_CONFIGS))
def test_double_backward_on_torch_matches_float64_loop(name, style):
    """A gradient penalty ``|dL/dx|^2`` (``L = y.g + 0.1 |y|^2``) differentiated again, through the torch backend
    at EP=1: the router's, the experts' and x's gradients of the float64 loop's."""
    torch.manual_seed(0)
    layer = MoELayer(_config(**DOUBLE_CONFIGS[name]))
    x, g = torch.randn(6, H), torch.randn(6, H)
    x32 = x.clone().requires_grad_()
    weights = [layer.router.weight, layer.experts.gate_up, layer.experts.down]
    def loss(y):  # its gradient w.r.t. y depends on y: the backward's inputs need a graph too
        return (y * g).sum() + 0.1 * y.square().sum()

    if style == "backward":
        loss(layer(x32)).backward(create_graph=True)
        penalty = x32.grad.square().sum()
        for p in weights:
            p.grad = None
        x32.grad = None
        penalty.backward()
        got = [p.grad for p in weights] + [x32.grad]
    else:
        dx, = torch.autograd.grad(loss(layer(x32)), x32, create_graph=True)
        got = list(torch.autograd.grad(dx.square().sum(), weights + [x32]))
    params = _naive_params(layer)
    x64 = x.double().requires_grad_()
    y64 = naive_moe(x64, params, layer.config)[0]
    g = g.double()
    dx64, = torch.autograd.grad(loss(y64), x64, create_graph=True)
    keys = ["router"] + [f"gate_up.{e}" for e in range(8)] + [f"down.{e}" for e in range(8)]
    want = torch.autograd.grad(dx64.square().sum(), [params[k] for k in keys] + [x64], allow_unused=True)
    want = [w if w is not None else torch.zeros_like(params[k]) for k, w in zip(keys, want[:-1])] + [want[-1]]
    want = [want[0], torch.stack(want[1:9]), torch.stack(want[9:17]), want[17]]
    for what, a, b in zip(["router", "gate_up", "down", "x"], got, want):
        scale = max(float(b.abs().max()), 1.0)
        torch.testing.assert_close(a.double() / scale, b / scale, atol=2e-6, rtol=0, msg=what)


# --- EP=2 (gloo) --------------------------------------------------------------------------


def _ep2_worker(rank, world_size):
    from ep_moe.parallel import build_ep_groups

    out = {}
    group = build_ep_groups(2).ep_group
    torch.manual_seed(0)
    layer = MoELayer(_config(top_k=2), group)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    for step in range(2):
        x = torch.randn(4, H, generator=torch.Generator().manual_seed(10 * rank + step))
        (layer(x).square().mean() + moe_aux_loss(layer)).backward()
        optimizer.step()
        optimizer.zero_grad()
    # deepcopy and AveragedModel: the copy shares the EP group (a communicator, not state)
    copied = copy.deepcopy(layer)
    swa = torch.optim.swa_utils.AveragedModel(layer)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5 + rank))
    with torch.no_grad():
        out["copy_diff"] = float((copied(x) - layer(x)).abs().max())
        out["swa_diff"] = float((swa(x) - layer(x)).abs().max())
    out["copy_group_same"] = copied.ep_group is layer.ep_group and copied.dispatcher is not layer.dispatcher
    out["copy_stats"] = copied.last_stats is not None  # set by its own forward above
    try:
        pickle.dumps(layer)
    except TypeError as err:
        out["pickle_error"] = str(err)
    # double backward at EP>1: one clear error on every rank, in both styles
    for style in ("backward", "autograd.grad"):
        xg = x.clone().requires_grad_()
        loss = layer(xg).square().sum()
        try:
            if style == "backward":
                loss.backward(create_graph=True)
            else:
                torch.autograd.grad(loss, xg, create_graph=True)
        except RuntimeError as err:
            out[f"double_{style}"] = str(err)
        layer.zero_grad(set_to_none=True)
    # a meta layer at EP=2: shapes only, no collective
    with torch.device("meta"):
        meta = MoELayer(_config(top_k=2), group)
    y = meta(torch.empty(3, 4, H, device="meta"))
    out["meta"] = (y.is_meta, tuple(y.shape))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ep2_results():
    return run_distributed(_ep2_worker, 2, timeout_s=120)


@pytest.mark.distributed
def test_deepcopy_and_averaged_model_at_ep2(ep2_results):
    for res in ep2_results:
        assert res["copy_diff"] == 0.0 and res["swa_diff"] == 0.0
        assert res["copy_group_same"] and res["copy_stats"]


@pytest.mark.distributed
def test_pickling_a_layer_with_an_ep_group_names_the_fix(ep2_results):
    for res in ep2_results:
        assert re.search(r"an MoELayer with an EP group \(EP=2\) cannot be pickled: its process group lives in "
                         r"this job only; save layer.state_dict\(\) instead", res["pickle_error"])


@pytest.mark.distributed
@pytest.mark.parametrize("style", ["backward", "autograd.grad"])
def test_double_backward_at_ep2_raises_one_clear_error(ep2_results, style):
    for res in ep2_results:
        assert re.search(rf"{DOUBLE_BACKWARD} at EP>1 \(the expert-parallel exchanges' backward is not "
                         r"differentiable again\); run the gradient penalty on a layer at EP=1 with "
                         r"MoEConfig\(backend='torch'\)", res[f"double_{style}"])


@pytest.mark.distributed
def test_meta_device_forward_at_ep2(ep2_results):
    for res in ep2_results:
        assert res["meta"] == (True, (3, 4, H))
