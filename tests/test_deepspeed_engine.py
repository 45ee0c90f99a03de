"""The DeepSpeed drop-in under ``deepspeed.initialize`` (DeepSpeed 0.19.8, CPU accelerator,
gloo) against DeepSpeed's own MoE layer given the same weights, tokens and RNG state: ZeRO
stages 0, 1 and 2, in float32 and in bf16 (the ``"bf16"`` config section; DeepSpeed's CPU
accelerator supports it, so every combination runs here: stage 0 through DeepSpeed's
``FP16_UnfusedOptimizer`` in bf16, stages 1 and 2 through ``DeepSpeedZeroOptimizer``), a
client ``torch.optim`` optimizer with DeepSpeed's MoE parameter groups and gradient clipping
on.

The model: Linear, a dropless top-2 layer of SwiGLU experts, a top-1 layer of GELU MLP
experts with biases that drops tokens (capacity 0.5, random token selection: DeepSpeed's
draws, followed by the drop-in), Linear. Its global experts have the same values at every
``ep_size``, so one model is the same function at ep_size 1, 2 and 4.

- Training (world 2 at ep_size 2, world 4 at ep_size 2): losses, DeepSpeed's global gradient
  norm and the weights after every step match DeepSpeed's layer (float32: to rounding; bf16:
  to bf16's precision); the engine sees the drop-in as an MoE layer, its expert weights (and
  only those) carry DeepSpeed's expert tags, and the engine reduces them over the
  expert-data-parallel group: ZeRO 1/2 partition them over it, stage 0 all-reduces them over
  it, and ``deepspeed.initialize`` broadcasts them from its first rank (world 4: replicas
  that start apart end up alike, as DeepSpeed's). One ZeRO-2 float32 run uses the Triton
  kernels (interpreter on the CPU).
- Checkpoints (``engine.save_checkpoint`` at world 2, ep_size 2; every stage and dtype, of
  both layers): a full ``load_checkpoint`` of the drop-in's checkpoint at the same ep_size
  resumes exactly (the next step equals the step of the engine that saved it); the weights
  load exactly at ep_size 1 (world 1 and 2), 2 (world 2 and 4) and 4 (world 4), from the
  drop-in's checkpoints and from DeepSpeed's layer's, and the drop-in's into DeepSpeed's
  layer; and a step at lr=0 keeps them (the optimizer's master weights took them too). A
  full load whose optimizer states do not fit (the drop-in's checkpoint at ep_size 1, every
  stage and dtype; DeepSpeed's layer's at ep_size 2) raises on every rank, before anything
  is loaded where ep_moe refuses it, and the same engine then loads the weights with
  ``load_module_only=True``.
- ``benchmarks/bench_deepspeed_train.py`` (the GPU comparison of both layers training a
  GPT-style model): its agreement check, and a CPU smoke run (2 gloo ranks, its tiny
  preset, 2 steps, ZeRO 2 in bf16 as on the GPUs).

One process group per world size serves every assertion of that size (module-scoped
fixtures, children forked from the test harness's forkserver).

What DeepSpeed itself supports across ``ep_size`` (found here with its own layer): its
expert weights are saved per global expert (``layer_X_expert_Y_mp_rank_00_model_states.pt``),
so they load at any ``ep_size`` that divides ``num_experts`` and any world size. Its
optimizer states do not: stage 0 keeps them per expert-parallel rank
(``expp_rank_R_mp_rank_00_optim_states.pt``) and raises at another ``ep_size`` (a parameter
group of another size), stages 1/2 keep flat partitions per data-parallel rank and raise at
another world size, or at another ``ep_size`` ("parameter-alignment layout does not
match"). Load the weights there with ``load_optimizer_states=False`` or
``load_module_only=True``; in bf16 at stage 0 only the latter: with the former DeepSpeed's
``FP16_UnfusedOptimizer`` keeps its old fp32 master weights and the next step overwrites the
loaded ones (its own layer alike). The drop-in keeps all of this, except that its stacked
expert tensors keep the parameter count alike at every ``ep_size``, so DeepSpeed would not
refuse a full load at another ``ep_size`` (ZeRO 1/2 at the same world size load states that
do not fit; stage 0 fails at the first step): ep_moe refuses it instead
(``CheckpointLayoutError``).

Skips without deepspeed (``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[1]
H, I, F_MLP, E = 16, 12, 20, 4
STAGES = (0, 1, 2)
DTYPES = ("fp32", "bf16")
COMBOS = [(stage, dtype) for dtype in DTYPES for stage in STAGES]
LR, MOMENTUM, CLIP = 0.5, 0.9, 0.05
TOKENS = 8  # per rank and step
EXPERT_KEY = re.compile(r"(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)")


class SwiGLUExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EngineModel(nn.Module):
    """Linear -> MoE (SwiGLU, k=2, dropless) -> MoE (GELU MLP with biases, k=1, dropping) ->
    Linear, with DeepSpeed's layers (``replace_deepspeed_moe`` makes it the drop-in's).
    Global expert g of layer i holds the same values at every ``ep_size``."""

    def __init__(self, ep_size: int, seed: int = 0):
        super().__init__()
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        torch.manual_seed(seed)
        self.inp = nn.Linear(H, H)
        self.moes = nn.ModuleList([
            DeepSpeedMoE(H, SwiGLUExpert(), num_experts=E, ep_size=ep_size, k=2, drop_tokens=False,
                         top2_2nd_expert_sampling=False),
            DeepSpeedMoE(H, nn.Sequential(nn.Linear(H, F_MLP), nn.GELU(), nn.Linear(F_MLP, H)), num_experts=E,
                         ep_size=ep_size, k=1, capacity_factor=0.5, min_capacity=1),
        ])
        self.out = nn.Linear(H, H)
        ep_rank = dist.get_rank() % ep_size
        with torch.no_grad():
            for p in self.parameters():  # large enough that routing and experts matter
                p.mul_(3.0)
            for i, moe in enumerate(self.moes):
                for j, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                    gen = torch.Generator().manual_seed(1000 * seed + 100 * i + ep_rank * (E // ep_size) + j)
                    for p in expert.parameters():
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x):
        h = self.inp(x)
        l_aux = 0.0
        for moe in self.moes:
            y, aux, _ = moe(h)
            h = h + y
            l_aux = l_aux + aux
        return self.out(h), l_aux


def _init_deepspeed():
    """deepspeed.init_distributed over run_distributed's gloo group (DeepSpeed's CPU backend
    would compile a shared-memory all-reduce op first, about a minute; gloo does its job)."""
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _model(impl: str, ep_size: int, seed: int = 0, backend: str = "auto") -> EngineModel:
    from ep_moe.integrations.deepspeed import replace_deepspeed_moe

    model = EngineModel(ep_size, seed)
    if impl == "ours":
        assert replace_deepspeed_moe(model, backend=backend) == 2
    return model


def _engine(deepspeed, model: nn.Module, stage: int, dtype: str, lr: float = LR):
    """DeepSpeed's engine with a client SGD (momentum: it has optimizer state) over
    DeepSpeed's MoE parameter groups, gradient clipping on (DeepSpeed's MoE-aware norm)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "params"})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def _step(engine, dtype: str, step: int) -> tuple[float, float]:
    """One training step on this rank's tokens of ``step``: (loss, DeepSpeed's global grad
    norm, -1 where the engine keeps none: stage 0 in float32 clips with a norm it does not keep)."""
    torch.manual_seed(10_000 + step)  # DeepSpeed's random token selection draws; the same for both layers
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    y, l_aux = engine(x.to(torch.bfloat16 if dtype == "bf16" else torch.float32))
    loss = y.float().square().mean() + 0.1 * l_aux
    engine.backward(loss)
    engine.step()
    norm = engine.get_global_grad_norm()
    return loss.item(), -1.0 if norm is None else float(norm)


def _global_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in float32 under DeepSpeed's keys (both layers have them),
    expert keys renumbered from local to global ids: comparable across layers and ep_size."""
    ep = {f"moes.{i}": (dist.get_rank() % m.ep_size, m.num_local_experts) for i, m in enumerate(model.moes)}
    out = {}
    for key, value in model.state_dict().items():
        match = EXPERT_KEY.match(key)
        if match:
            ep_rank, local = ep[match.group(1).split(".deepspeed_moe")[0]]
            key = f"{match.group(1)}{ep_rank * local + int(match.group(2))}{match.group(3)}"
        out[key] = value.detach().float().clone()
    return out


def _engine_facts(engine, model: nn.Module, ep_size: int) -> dict:
    """How the engine treats the drop-in's parameters: which are DeepSpeed expert parameters
    (and their group name), and over which ranks each optimizer parameter group is reduced."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    facts = dict(has_moe=engine.has_moe_layers, optimizer=type(engine.optimizer).__name__,
                 moe_params={n: getattr(p, "group_name", None) for n, p in model.named_parameters()
                             if is_moe_param(p)},
                 edp_ranks=dist.get_process_group_ranks(engine.expert_data_parallel_group[name]),
                 ep_group_is_deepspeeds=all(m.layer.ep_group is groups._get_expert_parallel_group(name)
                                            for m in model.moes if hasattr(m, "layer")))
    if hasattr(engine.optimizer, "real_dp_process_group"):  # ZeRO 1/2: groups partitioned over these ranks
        facts["zero_groups"] = [(bool(g.get("moe")), dist.get_process_group_ranks(pg), count)
                                for g, pg, count in zip(engine.optimizer.optimizer.param_groups,
                                                        engine.optimizer.real_dp_process_group,
                                                        engine.optimizer.partition_count)]
    return facts


def _load(deepspeed, path: str, impl: str, ep_size: int, stage: int, dtype: str, *, full: bool = False,
          module_only: bool = True) -> dict:
    """A fresh model (other weights) of ``impl`` at ``ep_size`` loads ``path``: its state,
    and after one step at lr=0 (the optimizer's master weights must hold the loaded ones)."""
    model = _model(impl, ep_size, seed=7)
    engine = _engine(deepspeed, model, stage, dtype, lr=LR if full else 0.0)
    kwargs = {} if full else dict(load_module_only=True) if module_only else dict(load_optimizer_states=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, _ = engine.load_checkpoint(path, **kwargs)
    assert loaded is not None, path
    state = _global_state(model)
    loss, _ = _step(engine, dtype, 2)
    return dict(loaded=state, loss=loss, after=_global_state(model))


def _refused(deepspeed, path: str, ep_size: int, stage: int, dtype: str) -> dict:
    """A full load of ``path`` into a fresh drop-in model at ``ep_size``: the error it raised
    (type name, message) and whether the weights and step count were left as they were; then
    the same engine loads the weights with ``load_module_only=True`` (state, and after a step
    at lr=0, as :func:`_load`)."""
    model = _model("ours", ep_size, seed=7)
    engine = _engine(deepspeed, model, stage, dtype, lr=0.0)
    before = _global_state(model)
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            engine.load_checkpoint(path)
        except Exception as err:  # reported to the test, which checks which
            error = (type(err).__name__, str(err))
        untouched = all(torch.equal(value, before[key]) for key, value in _global_state(model).items())
        steps = engine.global_steps
        engine.load_checkpoint(path, load_module_only=True)
    state = _global_state(model)
    _step(engine, dtype, 2)
    return dict(error=error, untouched=untouched, global_steps=steps, loaded=state, after=_global_state(model))


def _world2_worker(rank, world_size, root):
    """World 2, ep_size 2: both layers train and save in every combination; then the loads."""
    deepspeed = _init_deepspeed()
    out = dict(train={}, resume={}, loads={}, refused={})
    for stage, dtype in COMBOS:
        for impl in ("ds", "ours"):
            model = _model(impl, 2)
            engine = _engine(deepspeed, model, stage, dtype)
            steps = [_step(engine, dtype, s) for s in range(2)]
            engine.save_checkpoint(f"{root}/{impl}-{stage}-{dtype}")
            saved = _global_state(model)
            steps.append(_step(engine, dtype, 2))
            out["train"][stage, dtype, impl] = dict(steps=steps, saved=saved, after=_global_state(model),
                                                    facts=_engine_facts(engine, model, 2))
        out["resume"][stage, dtype] = _load(deepspeed, f"{root}/ours-{stage}-{dtype}", "ours", 2, stage, dtype,
                                            full=True)
        for src, dst, ep_size in (("ds", "ours", 2), ("ours", "ours", 1), ("ds", "ours", 1), ("ours", "ds", 1)):
            # load_optimizer_states=False keeps stale master weights in bf16 at stage 0 (DeepSpeed's own layer too)
            module_only = src == "ds" or (stage, dtype) == (0, "bf16")
            out["loads"][stage, dtype, src, dst, ep_size] = _load(
                deepspeed, f"{root}/{src}-{stage}-{dtype}", dst, ep_size, stage, dtype, module_only=module_only)
        for src, ep_size in (("ours", 1), ("ds", 2)):  # full loads whose optimizer states do not fit
            out["refused"][stage, dtype, src, ep_size] = _refused(deepspeed, f"{root}/{src}-{stage}-{dtype}", ep_size,
                                                                  stage, dtype)
    # the Triton kernels (interpreter) under the engine: ZeRO 2, float32
    model = _model("ours", 2, backend="triton")
    engine = _engine(deepspeed, model, 2, "fp32")
    out["triton"] = dict(steps=[_step(engine, "fp32", s) for s in range(2)], state=_global_state(model))
    return out


def _world4_worker(rank, world_size, root):
    """World 4, ep_size 2 (expert-data-parallel groups [0, 2] and [1, 3]): both layers train
    in every combination, their experts first set apart on the replicas; then the world-2
    checkpoints load at ep_size 2 and 4."""
    from deepspeed.utils import groups

    from ep_moe.integrations.deepspeed import MoE

    deepspeed = _init_deepspeed()
    out = dict(train={}, loads={})
    # DeepSpeed's data-before-expert layout (EP group [0, 2]) is not ep_moe's: refused, naming the fix
    probe = MoE(H, SwiGLUExpert(), num_experts=E, ep_size=2, k=1, drop_tokens=False)
    try:
        probe.set_deepspeed_parallelism(use_data_before_expert_parallel_=True)
    except ValueError as err:
        out["layout_error"] = str(err)
    for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.pop("ep_size_2", None)  # forget those groups; the engines build the default ones
    for stage, dtype in COMBOS:
        for impl in ("ds", "ours"):
            model = _model(impl, 2)
            if rank >= 2:  # a replica's experts start apart: the engine broadcasts them from rank 0 or 1
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "experts" in name:
                            p.add_(1.0)
            engine = _engine(deepspeed, model, stage, dtype)
            out["train"][stage, dtype, impl] = dict(steps=[_step(engine, dtype, s) for s in range(3)],
                                                    after=_global_state(model),
                                                    facts=_engine_facts(engine, model, 2))
        for src, dst, ep_size in (("ours", "ours", 2), ("ds", "ours", 4), ("ours", "ours", 4), ("ours", "ds", 4)):
            out["loads"][stage, dtype, src, dst, ep_size] = _load(
                deepspeed, f"{root}/{src}-{stage}-{dtype}", dst, ep_size, stage, dtype)
    return out


def _world1_worker(rank, world_size, root):
    """World 1: the world-2 checkpoints load into one process (ep_size 1)."""
    deepspeed = _init_deepspeed()
    return {(stage, dtype, src, dst): _load(deepspeed, f"{root}/{src}-{stage}-{dtype}", dst, 1, stage, dtype)
            for stage, dtype in COMBOS for src, dst in (("ours", "ours"), ("ds", "ours"), ("ours", "ds"))}


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("deepspeed_checkpoints"))


@pytest.fixture(scope="module")
def world2(deepspeed, checkpoint_root):
    return run_distributed(_world2_worker, 2, checkpoint_root, timeout_s=180, start_method="forkserver")


@pytest.fixture(scope="module")
def world4(deepspeed, world2, checkpoint_root):
    return run_distributed(_world4_worker, 4, checkpoint_root, timeout_s=180, start_method="forkserver")


def _saved(world2) -> dict:
    """(stage, dtype, impl) -> the global state each world-2 engine saved (experts from their ranks)."""
    merged = {}
    for res in world2:
        for key, run in res["train"].items():
            merged.setdefault(key, {}).update(run["saved"])
    return merged


def _tolerance(dtype: str) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == "fp32" else dict(atol=2e-2, rtol=2e-2)


def _assert_matches_deepspeed(results, world_size: int) -> None:
    for rank, res in enumerate(results):
        for stage, dtype in COMBOS:
            ours, ds = res["train"][stage, dtype, "ours"], res["train"][stage, dtype, "ds"]
            where = f"rank {rank}, ZeRO {stage}, {dtype}"
            tol = _tolerance(dtype)
            torch.testing.assert_close(torch.tensor(ours["steps"]), torch.tensor(ds["steps"]), **tol,
                                       msg=lambda m: f"{where}: (loss, grad norm) per step: {m}")
            assert ours["after"].keys() == ds["after"].keys()
            for key, want in ds["after"].items():
                torch.testing.assert_close(ours["after"][key], want, **tol, msg=lambda m: f"{where}, {key}: {m}")
            # the engine's view of the drop-in's parameters
            facts = ours["facts"]
            assert facts["has_moe"] and facts["optimizer"] == ds["facts"]["optimizer"], where
            expert_names = {n for n in facts["moe_params"]}
            assert expert_names == {f"moes.{i}.layer.experts.{t}" for i, t in
                                    [(0, "gate_up"), (0, "down"), (1, "gate_up"), (1, "down"), (1, "gate_up_bias"),
                                     (1, "down_bias")]}, where
            assert set(facts["moe_params"].values()) == {"ep_size_2"}, where
            edp = list(range(rank % 2, world_size, 2))
            assert facts["edp_ranks"] == edp and facts["ep_group_is_deepspeeds"], where
            if stage > 0:  # ZeRO partitions the expert groups over the expert-data-parallel ranks only
                assert facts["zero_groups"] == ds["facts"]["zero_groups"], where
                assert sorted(facts["zero_groups"]) == [(False, list(range(world_size)), world_size),
                                                        (True, edp, len(edp))], where


@pytest.mark.distributed
def test_engine_trains_as_deepspeed_at_world2(world2):
    """ep_size 2 at world 2: every ZeRO stage, float32 and bf16."""
    _assert_matches_deepspeed(world2, 2)


@pytest.mark.distributed
def test_engine_trains_as_deepspeed_at_world4(world4):
    """ep_size 2 at world 4: expert gradients reduced (and experts broadcast at start) over
    the expert-data-parallel groups [0, 2] and [1, 3] only."""
    _assert_matches_deepspeed(world4, 4)
    for rank, res in enumerate(world4):
        for key, run in res["train"].items():  # replicas (started apart) agree on everything
            replica = world4[rank % 2]["train"][key]["after"]
            assert run["after"].keys() == replica.keys()
            for name, value in run["after"].items():
                assert torch.equal(value, replica[name]), (rank, key, name)
        assert re.search(r"expert-parallel group \[\d, \d\].*ep_moe's expert-then-data layout.*"
                         r'"use_data_before_expert_parallelism": false', res["layout_error"])


@pytest.mark.distributed
def test_triton_kernels_under_the_engine(world2):
    for res in world2:
        ds = res["train"][2, "fp32", "ds"]
        torch.testing.assert_close(torch.tensor(res["triton"]["steps"]), torch.tensor(ds["steps"][:2]),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_resume_at_the_same_ep_size_is_exact(world2):
    """A full load_checkpoint (optimizer state included) at ep_size 2: the next step is the
    step the saving engine took, exactly, in every stage and dtype."""
    for rank, res in enumerate(world2):
        for stage, dtype in COMBOS:
            want = res["train"][stage, dtype, "ours"]
            got = res["resume"][stage, dtype]
            assert got["loss"] == want["steps"][2][0], (rank, stage, dtype)
            for key, value in want["after"].items():
                assert torch.equal(got["after"][key], value), (rank, stage, dtype, key)


def _assert_loads(results_by_rank: list[dict], saved: dict) -> None:
    """Every load took the saved weights exactly, and a step at lr=0 kept them."""
    checked = 0
    for rank, loads in enumerate(results_by_rank):
        for key, got in loads.items():
            stage, dtype, src = key[:3]
            want = saved[stage, dtype, src]
            for state in ("loaded", "after"):
                assert got[state].keys() <= want.keys() and any("experts" in k for k in got[state]), key
                for name, value in got[state].items():
                    assert torch.equal(value, want[name]), (rank, key, state, name)
            checked += 1
    assert checked


@pytest.mark.distributed
def test_checkpoints_load_across_ep_size_at_world2(world2):
    """Saved at ep_size 2 (world 2) by either layer: into the drop-in at ep_size 2 and 1, and
    the drop-in's into DeepSpeed's layer at ep_size 1."""
    _assert_loads([res["loads"] for res in world2], _saved(world2))


@pytest.mark.distributed
def test_full_load_of_optimizer_states_that_do_not_fit_is_refused(world2):
    """A full load_checkpoint (optimizer state included) into the drop-in of a checkpoint saved
    at ep_size 2 whose optimizer states do not fit raises on every rank: the drop-in's
    checkpoint at ep_size 1 (every stage; ZeRO 1/2 would load them silently otherwise), and
    DeepSpeed's layer's at ep_size 2 (ZeRO 1/2: refused by ep_moe; ZeRO 0: torch refuses the
    optimizer's parameter groups of another size). ep_moe refuses before anything is loaded;
    the same engine then loads the weights with load_module_only=True."""
    for rank, res in enumerate(world2):
        for (stage, dtype, src, ep_size), got in res["refused"].items():
            where = (rank, stage, dtype, src, ep_size)
            assert got["error"] is not None, where
            kind, message = got["error"]
            if src == "ds" and stage == 0:
                assert kind == "ValueError" and "parameter group" in message, where
                continue
            assert kind == "CheckpointLayoutError", (where, got["error"])
            assert got["untouched"] and got["global_steps"] == 0, where
            assert "load_module_only=True" in message and "nothing loaded" in message, where
            if src == "ours":
                assert re.search(r"ep_size=2\b.*ep_size=1\b", message) and "resume at ep_size=2" in message, message
            else:
                assert "DeepSpeed's own MoE layer" in message, message
    _assert_loads([res["refused"] for res in world2], _saved(world2))


@pytest.mark.distributed
def test_checkpoints_load_across_ep_size_at_world4(world4, world2):
    """Saved at world 2, ep_size 2: loaded at world 4, ep_size 2 and 4 (one expert per rank)."""
    _assert_loads([res["loads"] for res in world4], _saved(world2))


@pytest.mark.distributed
def test_checkpoints_load_at_world1(world2, checkpoint_root):
    _assert_loads(run_distributed(_world1_worker, 1, checkpoint_root, timeout_s=180, start_method="forkserver"),
                  _saved(world2))


# ---------------------------------------------------------------------------------------
# benchmarks/bench_deepspeed_train.py: the GPU comparison, as a CPU smoke run.

BENCH = REPO / "benchmarks" / "bench_deepspeed_train.py"


def _bench_module(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    spec = importlib.util.spec_from_file_location("bench_deepspeed_train", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_compare_flags_curves_apart(deepspeed, monkeypatch):
    bench = _bench_module(monkeypatch)
    args = bench.parse_args(["--preset", "tiny", "--dtype", "bf16"])
    ds = [4.0, 3.8, 3.6, 3.5, 3.4, 3.3]
    close = bench.compare(ds, [x * 1.01 for x in ds], args)
    assert close["agree"] and close["max_rel_diff_first5"] == pytest.approx(0.01)
    apart_early = bench.compare(ds, ds[:2] + [3.8] + ds[3:], args)  # 5.6% off at step 2
    assert not apart_early["agree"] and apart_early["max_rel_diff_first5"] == pytest.approx(0.2 / 3.6)
    assert not bench.compare(ds * 3, ds * 2 + [x * 1.1 for x in ds], args)["agree"]  # the last 10 apart
    assert bench.parse_args(["--dtype", "fp32"]).tol_first == 1e-4


@pytest.mark.distributed
def test_bench_deepspeed_train_cpu_smoke(deepspeed, tmp_path):
    """2 gloo ranks, the tiny preset, 2 steps, ZeRO 2 and bf16 as on the GPUs: both layers,
    dropless and dropping, train from the same start and the curves agree."""
    out = tmp_path / "ds_train.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the CPU path runs torch's grouped GEMM
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(BENCH),
           "--preset", "tiny", "--steps", "2", "--warmup", "0", "--profile-steps", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("-> agree") == 2, proc.stdout
    data = json.loads(out.read_text())
    assert data["world_size"] == data["ep_size"] == 2 and data["agree"]
    assert data["args"]["dtype"] == "bf16" and data["args"]["zero_stage"] == 2
    runs = {(r["mode"], r["layer"]): r for r in data["runs"]}
    assert runs.keys() == {(m, layer) for m in ("dropless", "drop") for layer in ("deepspeed", "ep_moe")}
    for (mode, layer), run in runs.items():
        assert len(run["losses"]) == 2 and run["losses"][1] < run["losses"][0], (mode, layer)
        assert run["step_ms"] > 0 and len(run["median_step_ms_per_rank"]) == 2
        assert run["optimizer"] == "DeepSpeedZeroOptimizer"
        assert run["dispatch"] == (None if layer == "deepspeed" else "all_to_all")
        profile = run["profile_rank0"]
        assert profile["steps"] == 1 and profile["top_ops"][0]["self_ms"] > 0, (mode, layer)
        assert run["losses"][0] == pytest.approx(runs[mode, "deepspeed"]["losses"][0], rel=1e-2)
    for comparison in data["comparisons"]:
        assert comparison["agree"] and comparison["max_rel_diff_first5"] < 1e-3, comparison
