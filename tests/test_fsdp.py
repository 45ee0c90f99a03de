"""FSDP2 (``ep_moe.parallel.apply_fsdp``) against the replicated path (``sync_gradients``) on
gloo: the same model, seed and per-rank data, trained 3 AdamW steps both ways, gives the
same losses, the same gradients (gathered from the DTensors with ``full_tensor()``) and the
same weights, to fp32 tolerance. Cases (world, EP): (2, 1), (2, 2), (4, 2) (edp = 2), (4, 4),
and (4, 2) with 2 experts (one local expert over two edp ranks: sharded on dim 1). Also:
where each parameter is sharded, resharding after forward, activation-checkpointed blocks,
an in-place add to the MoE output, checkpoints under FSDP (the torch state-dict APIs, and
ep_moe.checkpoint's DCP save loaded at other (EP, edp) layouts and into the replicated
model), the mesh's bad input (before any collective), a layer on another EP group,
sync_gradients refusing a sharded model. One forkserver run per world size (the torch
backend: no Triton kernel runs, so the server's environment does not matter)."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import checkpoint

from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dist_utils import run_distributed
from ep_moe import MoEConfig, MoELayer
from ep_moe.checkpoint import load_checkpoint, save_checkpoint
from ep_moe.layer import moe_aux_loss
from ep_moe.parallel import (
    ParallelMesh,
    apply_fsdp,
    groups_from_mesh,
    init_ep_mesh,
    init_parallel_mesh,
    is_expert_param,
    parallel_dims,
    sync_gradients,
)
from test_dcp import _assert_equal_views

H, I = 16, 8
STEPS = 3
RTOL = 1e-5
"""fp32 tolerance, relative to each tensor's largest entry: the reduce-scatter sums in another
order than the replicated path's all-reduce."""


class _Block(nn.Module):
    """A dense layer and an MoE layer (with a shared expert), residual (``inplace``: added
    in place to the MoE layer's output)."""

    def __init__(self, config: MoEConfig, ep_group, inplace: bool = False) -> None:
        super().__init__()
        self.dense = nn.Linear(H, H)
        self.moe = MoELayer(config, ep_group)
        self.inplace = inplace

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        h_TH = x_TH + torch.tanh(self.dense(x_TH))
        if not self.inplace:
            return h_TH + self.moe(h_TH)
        y_TH = self.moe(h_TH)
        y_TH += h_TH
        return y_TH


class _Model(nn.Module):
    def __init__(self, config: MoEConfig, ep_group, inplace: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(H, H)
        self.blocks = nn.ModuleList(_Block(config, ep_group, inplace) for _ in range(2))
        self.head = nn.Linear(H, 4)
        self.checkpoint_blocks = False
        """Recompute each block in the backward (non-reentrant activation checkpoint, as the trainer's)."""

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        h_TH = self.embed(x_TH)
        for block in self.blocks:
            h_TH = checkpoint(block, h_TH, use_reentrant=False) if self.checkpoint_blocks else block(h_TH)
        return self.head(h_TH)


def _config(num_experts: int) -> MoEConfig:
    return MoEConfig(hidden_size=H, intermediate_size=I, num_experts=num_experts, top_k=2, backend="torch",
                     init_std=0.2, num_shared_experts=1, aux_loss_coef=0.1, z_loss_coef=0.01)


def _build(ep_group, num_experts: int, inplace: bool = False):
    torch.manual_seed(0)  # the same dense weights on every rank; experts by global id
    return _Model(_config(num_experts), ep_group, inplace)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got, ref, atol=RTOL * scale, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, rank: int, sync=None, optimizer=None, steps: int = STEPS) -> dict:
    """AdamW steps on this rank's tokens: the losses, each step's gradients and the final
    weights (full tensors, this rank's experts)."""
    optimizer = _optimizer(model) if optimizer is None else optimizer
    out = {"loss": [], "grads": []}
    for step in range(steps):
        torch.manual_seed(1000 * step + rank)
        loss = model(torch.randn(6, H)).square().mean() + moe_aux_loss(model)
        loss.backward()
        if sync is not None:
            sync(model)
        out["loss"].append(loss.detach().clone())
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    out["weights"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _layout(model) -> dict[str, tuple]:
    """Each parameter's (mesh axis, placements, whether tagged as an expert parameter)."""
    return {n: (p.device_mesh.mesh_dim_names, str(p.placements), is_expert_param(p))
            for n, p in model.named_parameters()}


def _compare(rank, world_size, cases):
    """For each (ep, num_experts): the replicated path and FSDP, trained alike."""
    results = {}
    for ep, num_experts in cases:
        pm = init_parallel_mesh(ep, num_experts=num_experts, device_type="cpu")
        groups = pm.groups()
        replicated = _train(_build(groups.ep_group, num_experts), rank,
                            lambda m: sync_gradients(m, groups.ep_group, groups.edp_group))
        model = apply_fsdp(_build(pm.ep, num_experts), pm)
        layout = _layout(model)
        fsdp = _train(model, rank)
        with torch.no_grad():  # after the optimizer: a forward leaves the root's parameters unsharded
            model(torch.randn(3, H))
        # resharded after forward: the experts and the blocks register their shards again
        resharded = [isinstance(p, DTensor) for p in model.blocks.parameters()]
        results[(ep, num_experts)] = {"replicated": replicated, "fsdp": fsdp, "layout": layout,
                                      "resharded": resharded}
    return results


def _view(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's weights and AdamW state as full tensors, experts by global id, keyed as
    tests/test_dcp.py's view keys them (DTensors gathered with full_tensor())."""
    view = {}
    for name, param in model.named_parameters():
        weight, state = _full(param), {k: _full(v) for k, v in optimizer.state.get(param, {}).items()}
        if not is_expert_param(param):
            view[f"model.{name}"] = weight
            view.update({f"optim.{name}.{k}": v for k, v in state.items()})
            continue
        for j, g in enumerate(model.get_submodule(name.rpartition(".")[0]).global_ids()):
            view[f"model.{name}.{g}"] = weight[j]
            view.update({f"optim.{name}.{g}.{k}": v[j] if v.dim() else v for k, v in state.items()})
    return view


def _fresh(ep: int, fsdp: bool = True):
    """A model of other weights and its optimizer (no state yet) at EP ``ep``, under FSDP or replicated."""
    pm = init_parallel_mesh(ep, device_type="cpu")
    torch.manual_seed(1)
    model = _Model(_config(8), pm.ep if fsdp else pm.groups().ep_group)
    if fsdp:
        apply_fsdp(model, pm)
    return model, _optimizer(model)


def _checkpoints(rank, world_size, root):
    """FSDP at (EP, edp) = (2, 2), 2 steps, then: the torch state-dict APIs into another FSDP
    model of that layout; ep_moe.checkpoint's DCP save, loaded under FSDP at EP 4 and 1 and
    replicated at EP 2 (from a fresh optimizer: load_checkpoint initialises its state)."""
    pm = init_parallel_mesh(2, device_type="cpu")
    model = apply_fsdp(_build(pm.ep, 8), pm)
    optimizer = _optimizer(model)
    _train(model, rank, optimizer=optimizer, steps=2)
    out = {"saved": _view(model, optimizer), "loaded": {}}
    with CommDebugMode() as comm:
        model.state_dict()
    out["state_dict_collectives"] = comm.get_total_counts()
    out["stacked_tensors"] = sum(len(m.experts.tensor_names()) for m in model.modules() if isinstance(m, MoELayer))
    model_state, optim_state = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    other, other_optimizer = _fresh(2)
    _train(other, rank, optimizer=other_optimizer, steps=1)  # state to overwrite
    set_model_state_dict(other, model_state)
    set_optimizer_state_dict(other, other_optimizer, optim_state)
    out["loaded"]["torch_apis"] = _view(other, other_optimizer)
    save_checkpoint(root / "ckpt", model, optimizer, extra={"step": torch.tensor(2)})
    for ep, fsdp in ((4, True), (1, True), (2, False)):
        other, other_optimizer = _fresh(ep, fsdp)
        extra = {"step": torch.tensor(0)}
        load_checkpoint(root / "ckpt", other, other_optimizer, extra=extra)
        assert int(extra["step"]) == 2
        out["loaded"][(ep, fsdp)] = _view(other, other_optimizer)
    return out


@pytest.mark.distributed
def test_activation_checkpointed_blocks(world4):
    """Blocks recomputed in the backward (non-reentrant checkpoint; the experts' all-gather
    runs again in the recompute) at (EP, edp) = (2, 2): the replicated path's losses and gradients."""
    for rank, result in enumerate(world4):
        ref, got = result["compare"][(2, 8)]["replicated"], result["recomputed"]
        for step in range(STEPS):
            _assert_close(got["loss"][step], ref["loss"][step], f"rank {rank} step {step} loss")
            for name, grad in ref["grads"][step].items():
                _assert_close(got["grads"][step][name], grad, f"rank {rank} step {step} grad of {name}")


def _misuse(rank, world_size):
    """A layer built on another EP group than the mesh's; sync_gradients on a sharded model;
    the mesh's views (ParallelMesh from init_ep_mesh, groups_from_mesh); the MoE output added
    to in place (FSDP's backward hook on a view would be dropped)."""
    errors = {}
    pm = init_parallel_mesh(2, device_type="cpu")
    groups = pm.groups()
    inplace = {"replicated": _train(_build(groups.ep_group, 8, inplace=True), rank,
                                    lambda m: sync_gradients(m, groups.ep_group, groups.edp_group), steps=1),
               "fsdp": _train(apply_fsdp(_build(pm.ep, 8, inplace=True), pm), rank, steps=1)}
    try:
        apply_fsdp(_build(None, 8), pm)
    except ValueError as exc:
        errors["ep_size"] = str(exc)
    model = apply_fsdp(_build(pm.ep, 8), pm)
    model(torch.randn(2, H)).sum().backward()
    try:
        sync_gradients(model, pm.ep, pm.edp)
    except ValueError as exc:
        errors["sync"] = str(exc)
    wrapped = ParallelMesh.from_device_mesh(init_ep_mesh(1, device_type="cpu"))
    views = {"pm": (pm.ep_size, pm.edp_size, pm.dp_size, pm["ep"] is pm.ep),
             "groups": (groups_from_mesh(pm).ep_size, groups_from_mesh(pm.mesh).edp_size),
             "wrapped": (wrapped.ep_size, wrapped.edp_size, wrapped.dp_size),
             "ep_ranks": dist.get_process_group_ranks(pm.groups().ep_group)}
    return errors, views, inplace


def _world(rank, world_size, cases, root):
    """One run per world size (process start-up dominates): the comparisons of ``cases``,
    then at world 2 the misuse, at world 4 the checkpoints (in ``root``)."""
    out = {"compare": _compare(rank, world_size, cases)}
    if world_size == 2:
        out["misuse"] = _misuse(rank, world_size)
    else:
        out["checkpoints"] = _checkpoints(rank, world_size, root)
        pm = init_parallel_mesh(2, device_type="cpu")
        model = _build(pm.ep, 8)
        model.checkpoint_blocks = True
        out["recomputed"] = _train(apply_fsdp(model, pm), rank)  # against compare[(2, 8)]["replicated"]
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(_world, 2, [(1, 8), (2, 8)], tmp_path_factory.mktemp("fsdp_world2"),
                           timeout_s=60, deadline_s=150, start_method="forkserver")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_distributed(_world, 4, [(2, 8), (4, 8), (2, 2)], tmp_path_factory.mktemp("fsdp_world4"),
                           timeout_s=60, deadline_s=150, start_method="forkserver")


CASES = [(2, 1, 8), (2, 2, 8), (4, 2, 8), (4, 4, 8), (4, 2, 2)]


def _results(request, world: int) -> list[dict]:
    """Each rank's comparisons at ``world``."""
    return [r["compare"] for r in request.getfixturevalue(f"world{world}")]


@pytest.mark.distributed
@pytest.mark.parametrize("world,ep,num_experts", CASES)
def test_fsdp_matches_replicated(request, world, ep, num_experts):
    """Losses, every step's gradients and the final weights agree on every rank."""
    for rank, result in enumerate(_results(request, world)):
        ref, got = result[(ep, num_experts)]["replicated"], result[(ep, num_experts)]["fsdp"]
        for step in range(STEPS):
            _assert_close(got["loss"][step], ref["loss"][step], f"rank {rank} step {step} loss")
            assert got["grads"][step].keys() == ref["grads"][step].keys()
            for name, grad in ref["grads"][step].items():
                _assert_close(got["grads"][step][name], grad, f"rank {rank} step {step} grad of {name}")
        for name, weight in ref["weights"].items():
            _assert_close(got["weights"][name], weight, f"rank {rank} final {name}")
        assert ref["loss"][0] != ref["loss"][-1]  # it trained


@pytest.mark.distributed
@pytest.mark.parametrize("world,ep,num_experts", CASES)
def test_where_parameters_are_sharded(request, world, ep, num_experts):
    """Dense parameters over dp_shard (every rank); at EP > 1 the experts over edp, on dim 0
    or, with fewer local experts than edp ranks, dim 1; tags kept; resharded after forward."""
    for result in _results(request, world):
        layout = result[(ep, num_experts)]["layout"]
        experts = {n: v for n, v in layout.items() if ".experts." in n}
        assert experts and all(tagged for _, _, tagged in experts.values())
        assert not any(tagged for n, (_, _, tagged) in layout.items() if n not in experts)
        for name, (axes, placements, _) in layout.items():
            if name in experts and ep > 1:
                dim = 1 if num_experts // ep < world // ep else 0
                assert (axes, placements) == (("edp",), f"(Shard(dim={dim}),)"), name
            else:
                assert (axes, placements) == (("dp_shard",), "(Shard(dim=0),)"), name
        assert all(result[(ep, num_experts)]["resharded"])


@pytest.mark.distributed
def test_checkpoints_under_fsdp(world4):
    """get/set_model_state_dict and get/set_optimizer_state_dict round-trip under FSDP; a DCP
    checkpoint (ep_moe.checkpoint) saved under FSDP at (EP, edp) = (2, 2) loads under FSDP at
    (4, 1) and (1, 4) and into the replicated model at (2, 2): every weight and AdamW state
    tensor equal."""
    saved = [r["checkpoints"]["saved"] for r in world4]
    for layout in ("torch_apis", (4, True), (1, True), (2, False)):
        _assert_equal_views([r["checkpoints"]["loaded"][layout] for r in world4], saved)
    # the state dict of experts sharded by whole experts (4 a rank over 2 edp ranks): one gather
    # per stacked tensor (gate_up and down of each MoE layer), not one per expert
    counts = [(r["checkpoints"]["state_dict_collectives"], r["checkpoints"]["stacked_tensors"]) for r in world4]
    assert all(collectives == stacked > 0 for collectives, stacked in counts), counts


@pytest.mark.distributed
def test_misuse_is_named(world2):
    for errors, views, _ in (r["misuse"] for r in world2):
        assert "an MoE layer has ep_size=1 but the mesh's 'ep' axis has 2 ranks" in errors["ep_size"]
        assert "reduce-scatters already averaged the gradients" in errors["sync"]
        assert views == {"pm": (2, 1, 2, True), "groups": (2, 1), "wrapped": (1, 2, 2), "ep_ranks": [0, 1]}


@pytest.mark.distributed
def test_moe_output_added_to_in_place(world2):
    """``y = moe(h); y += h`` under FSDP at EP=2: the gradients of the replicated path (the
    layer's output is a view, which apply_fsdp copies so that FSDP's backward hook on it
    survives the in-place add)."""
    for rank, (_, _, inplace) in enumerate(r["misuse"] for r in world2):
        ref, got = inplace["replicated"], inplace["fsdp"]
        _assert_close(got["loss"][0], ref["loss"][0], f"rank {rank} loss")
        for name, grad in ref["grads"][0].items():
            _assert_close(got["grads"][0][name], grad, f"rank {rank} grad of {name}")


def test_mesh_dims_checked_before_any_collective():
    """No process group here: each raises naming both numbers."""
    assert parallel_dims(8, 2, num_experts=8) == {"dp_shard": 8, "edp": 4, "ep": 2}
    with pytest.raises(ValueError, match=r"dp_shard=6 \(= edp \* ep\) do not multiply to the world size 8"):
        init_parallel_mesh(2, dp_shard=6, world_size=8, device_type="cpu")
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide the world size 8"):
        init_parallel_mesh(3, world_size=8, device_type="cpu")
    with pytest.raises(ValueError, match=r"ep_size=4 does not divide num_experts=6"):
        init_parallel_mesh(4, world_size=8, num_experts=6, device_type="cpu")
    with pytest.raises(ValueError, match=re.escape("init_parallel_mesh needs torch.distributed")):
        init_parallel_mesh(2, world_size=8, device_type="cpu")
