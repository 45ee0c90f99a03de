"""The trainer's CUDA graphs of the blocks (``ep_moe/train/graphs.py``), on the CPU.

Capture itself needs a GPU (``tests/gpu/test_train_matrix_nccl.py`` trains with it; on 2x
H200 a graphed run follows the eager one as closely as two eager runs follow each other).
Here ``torch.cuda.make_graphed_callables`` is replaced by a stand-in that runs each
callable through an autograd function built in a closure, as torch's is: what is tested is
the plumbing around it.

- the model replays the graphed blocks only in training with autograd on, and raises on
  another batch shape;
- the MoE aux and z losses come out of the "graph" and still train the router: every
  gradient equals the eager model's;
- ``Trainer.release_graphs`` drops every reference to the graphs, the layers' last losses
  included (their autograd node holds the graphs; alive, graphs that captured NCCL work
  make ``destroy_process_group`` hang);
- :func:`graphs_unsupported` names what keeps graphs off.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


class _Sentinel:
    """Stands for a captured CUDA graph: alive as long as something can replay it."""


def _fake_make_graphed_callables(sentinels: list):
    """A stand-in for ``torch.cuda.make_graphed_callables``: each callable runs inside an
    autograd function defined in a closure holding a :class:`_Sentinel`, so the outputs'
    autograd nodes keep it alive, as torch's keep their graphs."""

    def make(callables, sample_args, num_warmup_iters=3, allow_unused_input=False):
        def graphed(module):
            sentinel = _Sentinel()
            sentinels.append(weakref.ref(sentinel))

            class Replay(torch.autograd.Function):
                @staticmethod
                def forward(ctx, *inputs):
                    ctx.graph = sentinel  # what torch's Graphed function holds: the graphs
                    with torch.enable_grad():
                        ctx.inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
                        ctx.outputs = module(*ctx.inputs)
                    return tuple(o.detach() for o in ctx.outputs)

                @staticmethod
                def backward(ctx, *grads):
                    leaves = [t for t in ctx.inputs if t.requires_grad]
                    params = list(module.parameters())
                    pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if o.requires_grad]
                    got = torch.autograd.grad([o for o, _ in pairs], leaves + params, [g for _, g in pairs],
                                              allow_unused=True)
                    for p, g in zip(params, got[len(leaves):]):
                        if g is not None:
                            p.grad = g if p.grad is None else p.grad + g
                    it = iter(got[:len(leaves)])
                    return tuple(next(it) if t.requires_grad else None for t in ctx.inputs)

            return lambda *args: Replay.apply(*args)

        return tuple(graphed(c) for c in callables)

    return make


def _model(z_loss_coef: float = 1e-3):
    from ep_moe.train import config, model

    job = config.parse_args(["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
                             "--set", "model.vocab_size=16", "--set", "moe.num_experts=4",
                             "--set", "moe.intermediate_size=32", "--set", "moe.backend='torch'",
                             "--set", f"moe.z_loss_coef={z_loss_coef}"])
    torch.manual_seed(0)
    return job, model.MoETransformer(job.model, job.moe_config())


def _step(net, tokens_BL):
    from ep_moe.layer import moe_aux_loss

    net.zero_grad(set_to_none=True)
    logits = net(tokens_BL[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens_BL[:, 1:].flatten()) + moe_aux_loss(net)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}


def _graph(net, batch: int, seq: int, monkeypatch, sentinels: list):
    from ep_moe.train import graphs

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _fake_make_graphed_callables(sentinels))
    sample = torch.randn(batch, seq, net.cfg.dim)
    net.graphed_blocks = graphs.GraphedBlocks(net.layers, sample, net.rope_cos[:seq], net.rope_sin[:seq],
                                              torch.autocast("cpu", enabled=False))


def test_graphed_blocks_train_like_eager(monkeypatch):
    """Same loss and every gradient, the router's included (its aux and z losses come out
    of the graph), as the eager model; eval and no-grad forwards run eagerly."""
    _, net = _model()
    tokens = torch.randint(0, 16, (2, 9))
    want_loss, want = _step(net, tokens)
    _graph(net, 2, 8, monkeypatch, [])
    got_loss, got = _step(net, tokens)
    torch.testing.assert_close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    router = [n for n in want if n.endswith("router.weight")]
    assert router and all(want[n].abs().sum() > 0 for n in router)
    net.graphed_blocks = types.SimpleNamespace()  # not callable: only eager blocks may run now
    net.eval()
    net(tokens[:, :-1])
    net.train()
    with torch.no_grad():
        net(tokens[:, :-1])


def test_aux_losses_still_train_the_router(monkeypatch):
    """Without the graphed losses the router's gradient would come from the task loss only:
    the aux-loss share of it must be there."""
    from ep_moe.layer import moe_aux_loss

    _, net = _model()
    tokens = torch.randint(0, 16, (2, 9))
    _graph(net, 2, 8, monkeypatch, [])
    net(tokens[:, :-1])
    aux = moe_aux_loss(net)
    assert aux.requires_grad
    aux.backward()
    assert all(layer.moe.router.weight.grad.abs().sum() > 0 for layer in net.layers)


def test_other_batch_shape_is_refused(monkeypatch):
    _, net = _model()
    _graph(net, 2, 8, monkeypatch, [])
    with pytest.raises(ValueError, match=r"captured for inputs of shape \(2, 8, 32\).*same batch_size and seq_len"):
        net(torch.randint(0, 16, (3, 8)))


def test_release_graphs_frees_them(monkeypatch):
    """After ``Trainer.release_graphs`` nothing holds a graph, though the last step's MoE
    losses (graph outputs) were kept in the layers' stats."""
    from ep_moe.train import trainer

    _, net = _model()
    sentinels: list = []
    _graph(net, 2, 8, monkeypatch, sentinels)
    _step(net, torch.randint(0, 16, (2, 9)))
    gc.collect()
    assert len(sentinels) == 2 and all(ref() is not None for ref in sentinels)
    fake = types.SimpleNamespace(model=net, ranks=types.SimpleNamespace(device=torch.device("cpu")))
    trainer.Trainer.release_graphs(fake)
    assert net.graphed_blocks is None
    assert all(ref() is None for ref in sentinels), "a graph outlived release_graphs"


@pytest.mark.parametrize("dispatch, device, compile, checkpointing, reason", [
    ("local", "cuda", False, False, None),
    ("all_gather", "cuda", False, False, None),
    ("all_gather_copy_engine", "cuda", False, False, None),
    ("all_to_all", "cuda", False, False, r"dispatch='all_to_all'.*syncs with the host.*moe.dispatch='all_gather'"),
    ("local", "cpu", False, False, "need a CUDA device"),
    ("local", "cuda", True, False, "training.compile"),
    ("local", "cuda", False, True, "activation checkpointing"),
])
def test_graphs_unsupported(dispatch, device, compile, checkpointing, reason):
    from ep_moe.train import graphs

    got = graphs.graphs_unsupported(dispatch, torch.device(device), compile=compile,
                                    activation_checkpointing=checkpointing)
    if reason is None:
        assert got is None
    else:
        assert got is not None and __import__("re").search(reason, got), got


def test_cuda_graphs_setting_is_checked():
    from ep_moe.train import config
    from ep_moe.train.errors import ConfigError

    assert config.parse_args([]).training.cuda_graphs == "auto"
    with pytest.raises(ConfigError, match="cuda_graphs"):
        config.parse_args(["--set", "training.cuda_graphs='yes'"])
