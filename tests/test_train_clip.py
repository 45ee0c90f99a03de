"""Gradient clipping at EP=2 against EP=1, with a clip that bites (CPU, gloo, 2 ranks).

Each rank builds the same model twice from one seed (the layer draws its experts per
global id, so the weights do not depend on the EP size): once at EP=1 (all 8 experts on
each rank, data parallel over both) and once at EP=2 (4 experts per rank). Both run the
rank's own batch, the trainer's gradient sync (``sync_gradients``) and then its clipping
(``ep_moe/train/trainer.py:clip_gradients``) to a tenth of the global norm. The EP=2 run must
report the EP=1 global norm and leave, dense and expert shard alike, the EP=1 clipped
gradients. Measured: within 4e-7 (relative) of EP=1 when right; with the expert-norm
all-reduce removed (each rank's norm from its own experts only), the norm is 1.0 to 1.2%
too small and the clipped gradients 1.0 to 1.2% too large, 1000 times ``RTOL``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
CLIP_FRACTION = 0.1
"""The clip, as a fraction of the global gradient norm: well below 1, so it bites."""
RTOL = 1e-5
VOCAB = 16
"""float32, the same math at both EP sizes: measured differences are about 1e-7."""


def _model(ep_group):
    """The trainer's model (2 layers, 8 experts, top-2, the torch experts), seed 0. A small
    vocabulary and wide experts with a larger init give the experts a large share of the
    gradient norm, which is what a broken expert-norm reduction gets wrong."""
    from ep_moe.train import config, model

    job = config.parse_args(["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
                             "--set", f"model.vocab_size={VOCAB}", "--set", "moe.num_experts=8",
                             "--set", "moe.intermediate_size=128", "--set", "moe.init_std=0.1",
                             "--set", "moe.backend='torch'"])
    torch.manual_seed(0)
    return model.MoETransformer(job.model, job.moe_config(), ep_group)


def _clipped(net, ep_group, edp_group, tokens_BL, clip, folded=True):
    """Forward, backward, the trainer's sync and clipping (``folded``: as the trainer runs
    them, the averaging folded into the clip's multiply; else averaged first); (global norm,
    clipped gradients by name, expert gradients keyed by global expert id)."""
    from ep_moe.parallel import is_expert_param
    from ep_moe.train import trainer

    logits_BLV = net(tokens_BL[:, :-1])
    loss = F.cross_entropy(logits_BLV.flatten(0, 1), tokens_BL[:, 1:].flatten())
    loss.backward()
    divisor = trainer.sync_gradients(net, ep_group, edp_group, average=not folded)
    total, finite = trainer.clip_gradients(net, clip, ep_group, loss, grad_scale=1.0 / divisor if folded else 1.0)
    assert finite
    grads = {}
    for name, param in net.named_parameters():
        if not is_expert_param(param):
            grads[name] = param.grad.clone()
            continue
        owner = net.get_submodule(name.rpartition(".")[0])
        for j, g in enumerate(owner.global_ids()):
            grads[f"{name}.{g}"] = param.grad[j].clone()
    return float(total), grads


def _clip_worker(rank: int, world_size: int):
    from ep_moe.parallel import build_ep_groups

    ep1, ep2 = build_ep_groups(1), build_ep_groups(2)
    tokens_BL = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(100 + rank))
    norm1, _ = _clipped(_model(None), None, ep1.edp_group, tokens_BL, clip=0.0)  # the unclipped norm
    clip = CLIP_FRACTION * norm1
    norm1, grads1 = _clipped(_model(None), None, ep1.edp_group, tokens_BL, clip)
    norm2, grads2 = _clipped(_model(ep2.ep_group), ep2.ep_group, None, tokens_BL, clip)
    norm_avg, grads_avg = _clipped(_model(ep2.ep_group), ep2.ep_group, None, tokens_BL, clip, folded=False)
    unfolded = max(float((grads2[k] - grads_avg[k]).abs().max() / grads_avg[k].abs().max()) for k in grads2)
    clipped_sq = torch.tensor(sum(float(g.square().sum()) for g in grads2.values()))
    dist.all_reduce(clipped_sq)  # each rank's dense gradients count once per rank: divide below
    worst = max((float((grads2[k] - grads1[k]).abs().max() / grads1[k].abs().max()), k) for k in grads2)
    return {"norm1": norm1, "norm2": norm2, "clip": clip, "worst": worst, "norm_avg": norm_avg, "unfolded": unfolded,
            "dense_sq": sum(float(g.square().sum()) for k, g in grads2.items() if "experts." not in k),
            "clipped_sq": float(clipped_sq)}


def test_clipping_at_ep2_matches_ep1():
    results = run_distributed(_clip_worker, 2, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["norm2"] == pytest.approx(r["norm1"], rel=RTOL), (
            f"rank {rank}: global grad norm at EP=2 {r['norm2']:.6g}, at EP=1 {r['norm1']:.6g}: the expert "
            f"norms are not summed over the EP group")
        diff, key = r["worst"]
        assert diff <= RTOL, f"rank {rank}: clipped gradient {key} differs from EP=1 by {diff:.2e} (relative)"
        assert r["norm1"] > 5 * r["clip"], "the clip must bite"
        # the averaging folded into the clip's multiply (the trainer) = averaging first
        assert r["norm_avg"] == pytest.approx(r["norm2"], rel=RTOL) and r["unfolded"] <= RTOL, r
    # After clipping, the global norm is the clip: dense gradients (on both ranks) once, each
    # rank's experts once.
    dense_sq = results[0]["dense_sq"]
    clipped = (results[0]["clipped_sq"] - dense_sq) ** 0.5
    assert clipped == pytest.approx(results[0]["clip"], rel=1e-4)
