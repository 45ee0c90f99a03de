"""Distributed checkpoints (ep_moe.checkpoint, torch.distributed.checkpoint) of a model with
MoE layers: the torch state-dict APIs round trip; expert optimizer state gets a key per
global expert; a save at one (EP, DP) layout loads at another with every weight and AdamW
state tensor equal (world 4: (4, 1) into (2, 2) and (1, 4); world 2: (2, 1) into (1, 2));
a save killed before its ``.metadata`` does not count; bad input (another config, an EP
size that does not divide the experts) raises naming what differs."""

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dist_utils import run_distributed
from ep_moe import MoEConfig, MoELayer
from ep_moe.checkpoint import (
    is_complete,
    latest_checkpoint,
    load_checkpoint,
    load_moe_state_dict,
    moe_state_dict,
    save_checkpoint,
)
from ep_moe.layer import moe_aux_loss
from ep_moe.parallel import (
    build_ep_groups,
    expert_param_names,
    groups_from_mesh,
    init_ep_mesh,
    is_expert_param,
    mark_expert_param,
    sync_gradients,
)

# DCP warns when it runs without a process group; the single-process tests mean to
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

H, I, E = 16, 8, 8
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


class _Model(nn.Module):
    """A dense layer, two MoE layers (residual), a dense head."""

    def __init__(self, config: MoEConfig, ep_group=None) -> None:
        super().__init__()
        self.embed = nn.Linear(config.hidden_size, config.hidden_size)
        self.blocks = nn.ModuleList(MoELayer(config, ep_group) for _ in range(2))
        self.head = nn.Linear(config.hidden_size, 4)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        h_TH = self.embed(x_TH)
        for block in self.blocks:
            h_TH = h_TH + block(h_TH)
        return self.head(h_TH)


def _build(ep_size: int, seed: int, *, mesh: bool = False, **config):
    """(model, AdamW, groups) at EP ``ep_size`` (groups None without a process group; from
    a DeviceMesh with ``mesh``); the global weights depend on ``seed`` only, not on the layout."""
    groups = None
    if dist.is_initialized():
        groups = (groups_from_mesh(init_ep_mesh(ep_size, device_type="cpu", num_experts=E)) if mesh
                  else build_ep_groups(ep_size, num_experts=E))
    torch.manual_seed(seed)
    fields = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, backend="torch", init_std=0.5)
    model = _Model(MoEConfig(**{**fields, **config}), None if groups is None else groups.ep_group)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), groups


def _train(model, optimizer, groups, steps: int, rank: int) -> None:
    """AdamW steps on this rank's tokens, gradients averaged over all ranks."""
    for step in range(steps):
        torch.manual_seed(1000 * step + rank)
        loss = model(torch.randn(6, H)).square().mean() + moe_aux_loss(model)
        loss.backward()
        if groups is not None:
            sync_gradients(model, groups.ep_group, groups.edp_group)
        optimizer.step()
        optimizer.zero_grad()


def _view(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's weights and AdamW state by global name (experts by global id), cloned;
    built from ``model.state_dict()`` and ``optimizer.state``, not from ep_moe.checkpoint."""
    view = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        if not is_expert_param(param):
            view.update({f"optim.{name}.{k}": v.clone() for k, v in state.items()})
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        for j, g in enumerate(owner.global_ids()):
            view.update({f"optim.{name}.{g}.{k}": (v[j] if v.dim() else v).clone() for k, v in state.items()})
    return view


def _assert_equal_views(loaded: list[dict], saved: list[dict]) -> None:
    """Every rank's loaded tensors equal the saved ones exactly, and together cover them."""
    merged = {}
    for view in saved:
        for key, value in view.items():
            assert key not in merged or torch.equal(merged[key], value), f"replicas differ at {key}"
            merged[key] = value
    for rank, view in enumerate(loaded):
        for key, value in view.items():
            assert torch.equal(value, merged[key]), f"rank {rank}: {key} differs after loading"
    assert set().union(*loaded) == set(merged)
    assert any(".experts.gate_up.7.exp_avg_sq" in k for k in merged)  # AdamW state of the last expert


def _reshard(rank, world_size, root, save_ep, load_eps):
    """Train 2 steps at EP ``save_ep`` and save; load at each of ``load_eps`` into a model of
    other weights (after a step of its own, or with a fresh optimizer: the last one; the
    first one's groups from a DeviceMesh, and when it has replicas, saved again and loaded
    back at ``save_ep``)."""
    model, optimizer, groups = _build(save_ep, seed=0)
    _train(model, optimizer, groups, 2, rank)
    save_checkpoint(root / "ckpt", model, optimizer, extra={"step": torch.tensor(2)})
    saved, loaded = _view(model, optimizer), {}
    for ep in load_eps:
        model, optimizer, groups = _build(ep, seed=1, mesh=ep == load_eps[0])
        if ep != load_eps[-1]:
            _train(model, optimizer, groups, 1, rank)
        extra = {"step": torch.tensor(0)}
        load_checkpoint(root / "ckpt", model, optimizer, extra=extra)
        loaded[ep] = (_view(model, optimizer), int(extra["step"]))
        if ep == load_eps[0] and ep < world_size:  # saved again with replicas, loaded at save_ep
            save_checkpoint(root / "again", model, optimizer)
            model, optimizer, groups = _build(save_ep, seed=1)
            load_checkpoint(root / "again", model, optimizer)
            loaded["again"] = (_view(model, optimizer), None)
    return saved, loaded


@pytest.mark.distributed
def test_reshard_world4(tmp_path):
    """(EP, DP) = (4, 1) saved; loaded at (2, 2) and (1, 4); the (2, 2) one, saved again
    (each expert on two ranks, written once), loads back at (4, 1)."""
    results = run_distributed(_reshard, 4, tmp_path, 4, (2, 1), timeout_s=60, deadline_s=150)
    saved = [r[0] for r in results]
    for ep in (2, 1):
        _assert_equal_views([r[1][ep][0] for r in results], saved)
        assert [r[1][ep][1] for r in results] == [2] * 4
    _assert_equal_views([r[1]["again"][0] for r in results], saved)


def _world2(rank, world_size, root):
    """At world 2: the reshard (2, 1) -> (1, 2); the optimizer keys moe_state_dict gives;
    loading another config's checkpoint, an incomplete and a damaged one (every rank's error)."""
    out = {"reshard": _reshard(rank, world_size, root, 2, (1,))}
    model, optimizer, _ = _build(2, seed=0)
    out["torch_keys"] = sorted(get_optimizer_state_dict(model, optimizer)["state"])
    out["moe_keys"] = sorted(moe_state_dict(model, optimizer)["optimizer"]["state"])
    errors = {}
    for name, config in (("hidden", dict(hidden_size=2 * H)), ("experts", dict(num_experts=4, top_k=1))):
        model, optimizer, _ = _build(2, seed=0, **config)
        try:
            load_checkpoint(root / "ckpt", model, optimizer)
        except ValueError as exc:
            errors[name] = str(exc)
    model, optimizer, _ = _build(2, seed=1)  # under DDP (experts ignored): the same keys
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model))
    ddp = DistributedDataParallel(model)
    load_checkpoint(root / "ckpt", ddp, optimizer)
    out["ddp"] = _view(model, optimizer)
    model, optimizer, _ = _build(2, seed=0, top_k=1, aux_loss_coef=0.0)  # the tensors fit: loads, warns
    load_checkpoint(root / "ckpt", model, optimizer)
    out["other_top_k"] = _view(model, optimizer)
    os.makedirs(root / "unfinished", exist_ok=True)
    try:
        load_checkpoint(root / "unfinished", model, optimizer)
    except ValueError as exc:
        errors["incomplete"] = str(exc)
    os.makedirs(root / "damaged", exist_ok=True)
    if rank == 0:
        (root / "damaged" / ".metadata").write_bytes(b"not a pickle")
    dist.barrier()
    try:
        load_checkpoint(root / "damaged", model, optimizer)
    except ValueError as exc:
        errors["damaged"] = str(exc)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp_world2")
    return run_distributed(_world2, 2, root, timeout_s=60, deadline_s=150)


@pytest.mark.distributed
def test_reshard_world2(world2):
    """(EP, DP) = (2, 1) saved; loaded at (1, 2), saved again (both ranks hold every
    expert) and loaded back at (2, 1)."""
    saved = [r["reshard"][0] for r in world2]
    _assert_equal_views([r["reshard"][1][1][0] for r in world2], saved)
    _assert_equal_views([r["reshard"][1]["again"][0] for r in world2], saved)


@pytest.mark.distributed
def test_expert_optimizer_state_has_a_key_per_global_expert(world2):
    """torch's optimizer state dict keys a stacked expert parameter alike on every EP rank
    (DCP would keep one); moe_state_dict keys its state per global expert instead."""
    stacked = "blocks.0.experts.gate_up"
    assert all(stacked in r["torch_keys"] for r in world2)
    keys = [set(r["moe_keys"]) for r in world2]
    assert not any(stacked in k for k in keys)
    assert {k for k in keys[0] if k.startswith(stacked + ".")} == {f"{stacked}.{g}" for g in range(4)}
    assert {k for k in keys[1] if k.startswith(stacked + ".")} == {f"{stacked}.{g}" for g in range(4, 8)}
    assert {k for k in keys[0] if "experts" not in k} == {k for k in keys[1] if "experts" not in k}


@pytest.mark.distributed
def test_another_config_names_the_fields(world2):
    for r in world2:  # every rank raises
        hidden, experts = r["errors"]["hidden"], r["errors"]["experts"]
        assert "hidden_size=16 in the checkpoint, 32 in this model" in hidden
        assert "MoE layers 'blocks.0', 'blocks.1'" in hidden and "other shapes" in hidden
        assert "num_experts=8 in the checkpoint, 4 in this model" in experts
        assert "top_k=2 in the checkpoint, 1 in this model" in experts and "unexpected" in experts
        assert "build the model with the checkpoint's config" in experts


@pytest.mark.distributed
def test_load_through_ddp(world2):
    """A DistributedDataParallel wrapper (expert parameters ignored) keys the state alike."""
    _assert_equal_views([r["ddp"] for r in world2], [r["reshard"][0] for r in world2])


@pytest.mark.distributed
def test_config_fields_that_keep_the_tensors_load(world2):
    """Another top_k and aux_loss_coef: the same tensors, loaded (the differences are logged)."""
    _assert_equal_views([r["other_top_k"] for r in world2], [r["reshard"][0] for r in world2])


@pytest.mark.distributed
def test_incomplete_or_damaged_checkpoint_refused_on_every_rank(world2):
    for r in world2:
        assert "is incomplete: it has no .metadata" in r["errors"]["incomplete"]
        assert "cannot be read (UnpicklingError" in r["errors"]["damaged"]
        assert "load an earlier checkpoint" in r["errors"]["damaged"]


def test_torch_state_dict_apis_round_trip():
    """get/set_model_state_dict and get/set_optimizer_state_dict (EP=1, no process group)."""
    model, optimizer, _ = _build(1, seed=0)
    _train(model, optimizer, None, 2, 0)
    model_state = copy.deepcopy(get_model_state_dict(model))
    optim_state = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    assert {f"blocks.1.experts.down.{g}" for g in range(E)} <= set(model_state)
    other, other_optimizer, _ = _build(1, seed=1)
    _train(other, other_optimizer, None, 1, 0)
    set_model_state_dict(other, model_state)
    set_optimizer_state_dict(other, other_optimizer, optim_state)
    _assert_equal_views([_view(other, other_optimizer)], [_view(model, optimizer)])


def test_compiled_blocks(tmp_path):
    """Blocks wrapped by torch.compile (as the trainer does) save under the plain keys, and
    load into plain blocks and compiled ones."""
    model, optimizer, _ = _build(1, seed=0)
    _train(model, optimizer, None, 1, 0)
    saved = _view(model, optimizer)
    model.blocks[1] = torch.compile(model.blocks[1])
    save_checkpoint(tmp_path, model, optimizer)
    for compiled in (False, True):
        other, other_optimizer, _ = _build(1, seed=1)
        if compiled:
            other.blocks[0] = torch.compile(other.blocks[0])
        load_checkpoint(tmp_path, other, other_optimizer)
        view = {k.replace("_orig_mod.", ""): v for k, v in _view(other, other_optimizer).items()}
        _assert_equal_views([view], [saved])


_KILLED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from torch.distributed.checkpoint import FileSystemWriter
from test_dcp import _build
from ep_moe.checkpoint import save_checkpoint
# killed once every data file is written, before the .metadata
FileSystemWriter.finish = lambda self, metadata, results: os.kill(os.getpid(), signal.SIGKILL)
model, optimizer, _ = _build(1, seed=2)
save_checkpoint({path!r}, model, optimizer)
"""


def test_save_killed_before_metadata_is_not_complete(tmp_path):
    """Steps 1 and 2 saved; a re-save of step 2 killed before its .metadata: step 2 no
    longer counts as a checkpoint (load_checkpoint refuses it), step 1 is the latest."""
    model, optimizer, _ = _build(1, seed=0)
    for step in (1, 2):
        _train(model, optimizer, None, 1, 0)
        save_checkpoint(tmp_path / f"step_{step:08d}", model, optimizer)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    code = textwrap.dedent(_KILLED_SAVE.format(tests=TESTS_DIR, path=str(tmp_path / "step_00000002")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not is_complete(tmp_path / "step_00000002")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    with pytest.raises(ValueError, match=r"is incomplete: it has no \.metadata.*load an earlier checkpoint"):
        load_checkpoint(tmp_path / "step_00000002", model, optimizer)


def test_model_only_checkpoint_names_the_missing_optimizer_state(tmp_path):
    model, optimizer, _ = _build(1, seed=0)
    save_checkpoint(tmp_path, model)
    with pytest.raises(ValueError, match=r"holds no optimizer state; load it with optimizer=None"):
        load_checkpoint(tmp_path, model, optimizer)
    other, _, _ = _build(1, seed=1)
    load_checkpoint(tmp_path, other)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


class _UnsplitExperts(nn.Module):
    """Experts whose state dict keeps the stacked tensor (no per-expert hook), rows 2 and 3
    of 4 experts, as a transformers experts module under expert_parallel."""

    num_global_experts = 4

    def __init__(self) -> None:
        super().__init__()
        self.w = mark_expert_param(nn.Parameter(torch.arange(6.0).view(2, 3)))

    def global_ids(self) -> range:
        return range(2, 4)


def test_stacked_experts_a_module_keeps_whole_are_split_per_expert_and_stacked_back():
    """DCP would keep one rank's copy of a stacked tensor that every rank keys alike: the
    state is keyed per global expert instead, and loads back stacked."""
    model = nn.ModuleDict({"experts": _UnsplitExperts()})
    state = moe_state_dict(model)
    assert sorted(state["model"]) == ["experts.w.2", "experts.w.3"]
    assert torch.equal(state["model"]["experts.w.3"], torch.tensor([3.0, 4.0, 5.0]))
    loaded = nn.ModuleDict({"experts": _UnsplitExperts()})
    with torch.no_grad():
        loaded.experts.w.zero_()
    load_moe_state_dict(loaded, None, state)
    assert torch.equal(loaded.experts.w, model.experts.w)


def test_expert_parameters_in_no_experts_module_raise():
    stray = nn.Linear(2, 2)
    mark_expert_param(stray.weight)
    with pytest.raises(ValueError, match=r"expert parameters \['weight'\] are in no experts module"):
        moe_state_dict(stray)


def test_ep_size_must_divide_experts_before_any_collective():
    """Raised with no process group at all: nothing collective ran."""
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide num_experts=8"):
        build_ep_groups(3, num_experts=8)
    with pytest.raises(ValueError, match=r"ep_size=4 does not divide num_experts=6"):
        init_ep_mesh(4, device_type="cpu", num_experts=6)
