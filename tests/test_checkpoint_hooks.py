"""Activation checkpointing and other saved-tensor hooks around the layer: the expert
pipeline's expert graph saves through the enclosing hooks (a checkpoint frees its
activations and recomputes the layer once; save_on_cpu offloads them), gradients and
parameter hooks are those of the plain run, and the grouped GEMM's deferred dW reaches its
leaf even when the graph is gone. EP=1 and 2, every dispatch, torch and Triton
(interpreter) backends."""
import gc
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from dist_utils import run_distributed
from ep_moe import MoEConfig, MoELayer
from ep_moe.ep.pipeline import DeferredWeightGrads
from ep_moe.kernels.ops import defer_weight_grads, grouped_gemm
from ep_moe.layer import moe_aux_loss
from workspace_doubles import file_workspaces

H, I, E = 16, 12, 8


def _layer(group, **kw):
    torch.manual_seed(12)
    return MoELayer(MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, aux_loss_coef=0.1,
                              z_loss_coef=0.01, init_std=0.5, **kw), group)


def _bytes_held_after(fn):
    """What fn() returns, and the bytes of the storages created inside fn() still alive after it."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    made = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    old = made.get(st.data_ptr())
                    if old is None or old[0].expired():
                        made[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            return out

    with Track():
        out = fn()
    gc.collect()
    return out, sum(n for ref, n in made.values() if not ref.expired())


def _memory_worker(rank, world_size, dispatch):
    torch.manual_seed(0)  # the replicated router starts equal on every rank (the layer checks it)
    layer = MoELayer(MoEConfig(hidden_size=64, intermediate_size=256, num_experts=8, top_k=2, backend="torch",
                               dispatch=dispatch), dist.group.WORLD if world_size > 1 else None)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    held = {}
    for mode in ("plain", "checkpoint"):
        region = lambda t: layer(t).square()  # noqa: E731  (square saves y: a full recompute)
        y, held[mode] = _bytes_held_after(
            lambda: region(x) if mode == "plain" else checkpoint(region, x, use_reentrant=False))
        held[mode] -= y.numel() * y.element_size()
        y.sum().backward()
    return held


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,dispatch", [(1, "all_to_all"), (2, "all_to_all"), (2, "all_gather")])
def test_activation_checkpoint_frees_the_expert_activations(world_size, dispatch):
    """Between forward and backward a checkpointed layer holds far less than a plain one: the
    pipeline's expert graph does not keep its activations past a checkpoint."""
    for held in run_distributed(_memory_worker, world_size, dispatch):
        assert held["checkpoint"] < 0.5 * held["plain"], held


def _hooks_worker(rank, world_size, backend, dispatch, outer):
    group = dist.group.WORLD if world_size > 1 else None
    layer = _layer(group, backend=backend, dispatch=dispatch)
    fired = {n: [] for n, p in layer.named_parameters()}
    for n, p in layer.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired[n].append(p.grad.clone()))
    gen = torch.Generator().manual_seed(200 + rank)
    x0, g = torch.randn(19, H, generator=gen), torch.randn(19, H, generator=gen)
    forwards, packed = [], []
    layer.register_forward_pre_hook(lambda m, a: forwards.append(1))
    out = {}
    with file_workspaces(group) if dispatch == "all_gather_copy_engine" else nullcontext():
        for mode in ("plain", outer):
            layer.zero_grad(set_to_none=True)
            forwards.clear(); packed.clear()
            for f in fired.values():
                f.clear()
            x = x0.clone().requires_grad_()
            if mode == "plain":
                y = layer(x)
            elif mode == "checkpoint":
                y = checkpoint(layer, x, use_reentrant=False)
            elif mode == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu():
                    y = layer(x)
            else:  # an outer hook that is not a checkpoint: it sees every saved tensor
                with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
                    y = layer(x)
            ((y * g).sum() + moe_aux_loss(layer)).backward()
            out[mode] = dict(dx=x.grad, grads={n: p.grad.clone() for n, p in layer.named_parameters()},
                             fired={n: len(f) for n, f in fired.items()},
                             hook_grad_is_final={n: bool(f) and torch.equal(f[-1], layer.get_parameter(n).grad)
                                                 for n, f in fired.items()},
                             forwards=len(forwards), packed=list(packed))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("outer", ["checkpoint", "save_on_cpu", "counting_hooks"])
@pytest.mark.parametrize("world_size,backend,dispatch", [
    (1, "triton", "all_to_all"), (2, "torch", "all_to_all"), (2, "triton", "all_to_all"),
    (2, "torch", "all_gather"), (2, "triton", "all_gather_copy_engine")])
def test_outer_saved_tensor_hooks_keep_gradients_and_param_hooks(world_size, backend, dispatch, outer):
    """Under a non-reentrant checkpoint, save_on_cpu or any saved-tensor hooks: the layer's
    outputs and gradients equal the plain run, each parameter's post-accumulate hook fires
    once with the final gradient, a checkpoint recomputes the layer once, and the outer
    hooks see the expert GEMMs' saved rows too (not only the router's tensors)."""
    for res in run_distributed(_hooks_worker, world_size, backend, dispatch, outer):
        plain, got = res["plain"], res[outer]
        torch.testing.assert_close(got["dx"], plain["dx"], atol=1e-5, rtol=1e-5)
        for n, grad in plain["grads"].items():
            torch.testing.assert_close(got["grads"][n], grad, atol=1e-5, rtol=1e-5)
        assert set(got["fired"].values()) == {1} and all(got["hook_grad_is_final"].values())
        assert got["forwards"] == (2 if outer == "checkpoint" else 1)
        if outer == "counting_hooks":  # the experts' [*, I] activations went through the outer hook
            assert any(len(s) == 2 and s[1] in (I, 2 * I) for s in got["packed"]), got["packed"]


def test_deferred_weight_grad_arrives_after_the_graph_is_gone():
    """Under saved-tensor hooks the saved weight unpacks as a new tensor: its dW still reaches
    the leaf when the graph (and the leaf's grad accumulator with it) is freed before run()."""
    w = torch.randn(2, 8, 16, requires_grad=True)
    x, m = torch.randn(10, 16), torch.tensor([4, 6])
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = grouped_gemm(x, w, m, backend="triton")
    queue = DeferredWeightGrads([w], private_leaves=True)
    with defer_weight_grads(queue):
        y.sum().backward()
    del y
    queue.run()
    want = torch.autograd.grad(grouped_gemm(x, w, m, backend="torch").sum(), w)[0]
    torch.testing.assert_close(w.grad, want)
