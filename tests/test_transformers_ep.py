"""Expert parallelism for Hugging Face models on gloo (world 2 and 4): the whole model's loss
and every gradient at EP=N equal EP=1's, over the all-to-all and the all-gather, with a rank
whose experts get no token and a rank with no token at all; checkpoints that each rank reads
in part and a save that plain transformers loads; the errors every rank raises alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import ep_moe.integrations.transformers as ep_hf  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from hf_models import VOCAB, tiny_model  # noqa: E402
from ep_moe.parallel import sync_gradients  # noqa: E402

pytestmark = pytest.mark.distributed

TOKENS = 7


def _token_ids(world: int) -> torch.Tensor:
    """[world, 2, TOKENS]: each rank's batch, the same on every rank."""
    return torch.randint(0, VOCAB, (world, 2, TOKENS), generator=torch.Generator().manual_seed(7))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _parity(family: str, dispatch: str, backend: str) -> dict[str, float]:
    """On this rank: EP=N over its own batch against EP=1 over every rank's batch (the loss
    the mean of the per-rank losses); the worst relative difference of the loss and of the
    gradients (this rank's experts' rows of the EP=1 expert gradients)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = _token_ids(world)
    reference = tiny_model(family)
    ep_hf.expert_parallel(reference, None, backend=backend)
    losses = [reference(input_ids=ids[r], labels=ids[r]).loss for r in range(world)]
    (sum(losses) / world).backward()
    model = ep_hf.expert_parallel(tiny_model(family), dist.group.WORLD, dispatch=dispatch, backend=backend)
    loss = model(input_ids=ids[rank], labels=ids[rank]).loss
    loss.backward()
    sync_gradients(model, dist.group.WORLD, None)
    worst = {"loss": _relative(loss.detach(), losses[rank].detach())}
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        grad = ref.grad
        if param.shape != ref.shape:  # an expert tensor: this rank's rows
            local = param.shape[0]
            grad = grad[rank * local:(rank + 1) * local]
        worst[name] = _relative(param.grad, grad)
    return worst


CASES = [(family, dispatch, "torch") for family in ("qwen3_moe", "gpt_oss", "deepseek_v3")
         for dispatch in ("all_to_all", "all_gather")] + [("gpt_oss", "all_to_all", "triton")]


def _parity_worker(rank: int, world: int) -> dict:
    return {case: _parity(*case) for case in CASES}


@pytest.fixture(scope="module", params=[2, 4])
def parity(request) -> list[dict]:
    return run_distributed(_parity_worker, request.param)


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_whole_model_matches_ep1(parity, case):
    """Loss and every gradient (router, attention, embeddings, each expert tensor and bias)
    of a tiny model split over the group equal one rank running every batch, float32."""
    for rank, results in enumerate(parity):
        worst = results[case]
        bad = {name: diff for name, diff in worst.items() if diff > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert any(".experts." in name for name in worst)


def _experts_only(rank: int, world: int, ids_TK: torch.Tensor, counts: list[int], dispatch: str) -> list[float]:
    """One Qwen3 experts module split over the group, rank r calling it with the first
    ``counts[r]`` rows of ``ids_TK[r]``, against the whole module on every rank's tokens:
    [output, input grad, weights grad, expert grads...] worst relative differences."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                                         num_experts_per_tok=2)
    torch.manual_seed(0)
    whole = Qwen3MoeExperts(config)
    with torch.no_grad():
        for param in whole.parameters():
            param.normal_(0.0, 0.1)
    split = torch.nn.ModuleList([Qwen3MoeExperts(config)])
    split[0].load_state_dict(whole.state_dict())
    ep_hf.expert_parallel(whole_list := torch.nn.ModuleList([whole]), None)
    ep_hf.expert_parallel(split, dist.group.WORLD, dispatch=dispatch)
    gen = torch.Generator().manual_seed(3)
    x_all = torch.randn(world, 5, 32, generator=gen)
    w_all = torch.rand(world, 5, 2, generator=gen)
    x_ref, w_ref = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    outs = [whole_list[0](x_ref[r, :counts[r]], ids_TK[r, :counts[r]], w_ref[r, :counts[r]]) for r in range(world)]
    tokens = counts[rank]
    x, w = x_all[rank, :tokens].clone().requires_grad_(), w_all[rank, :tokens].clone().requires_grad_()
    out = split[0](x, ids_TK[rank, :tokens], w)
    out.square().sum().backward()
    # every rank's EP=1 loss term: this rank's expert rows get every rank's share
    sum(o.square().sum() for o in outs).backward()
    local = 8 // world
    diffs = [_relative(out, outs[rank]) if tokens else 0.0]
    if tokens:
        diffs += [_relative(x.grad, x_ref.grad[rank, :tokens]), _relative(w.grad, w_ref.grad[rank, :tokens])]
    for name in ("gate_up_proj", "down_proj"):
        diffs.append(_relative(getattr(split[0], name).grad,
                               getattr(whole, name).grad[rank * local:(rank + 1) * local]))
    return diffs


def _no_tokens_worker(rank: int, world: int) -> dict:
    ids_TK = torch.stack([torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])] * world)  # rank 0's experts only
    spread = torch.randint(0, 8, (world, 5, 1), generator=torch.Generator().manual_seed(1))
    spread_TK = torch.cat([spread, (spread + 3) % 8], dim=2)
    every, last_empty = [5] * world, [5] * (world - 1) + [0]
    return {
        "experts of other ranks idle, all_to_all": _experts_only(rank, world, ids_TK, every, "all_to_all"),
        "experts of other ranks idle, all_gather": _experts_only(rank, world, ids_TK, every, "all_gather"),
        "last rank holds no token": _experts_only(rank, world, spread_TK, last_empty, "all_to_all"),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_without_tokens(world):
    """Every token routed to rank 0's experts (the others receive none), and a rank that
    brings no token at all (the all-to-all takes uneven counts): outputs and gradients
    equal the whole module's."""
    for rank, results in enumerate(run_distributed(_no_tokens_worker, world)):
        for case, diffs in results.items():
            assert max(diffs) < 1e-5, f"rank {rank}, {case}: {diffs}"


def _checkpoint_worker(rank: int, world: int, folder: str, family: str) -> dict:
    """Rank 0 saves a tiny model with transformers (sharded files); every rank loads its
    part; the split model's logits equal the original's; after a step of changes, the
    gathered save loads in plain transformers with the split model's logits."""
    from transformers import AutoModelForCausalLM

    ids = _token_ids(1)[0]
    original = tiny_model(family).eval()
    if rank == 0:
        original.save_pretrained(f"{folder}/original", max_shard_size="30KB")
    dist.barrier()
    model = ep_hf.from_pretrained(AutoModelForCausalLM, f"{folder}/original", dist.group.WORLD)
    experts = ep_hf.experts_modules(model)[0][1]
    with torch.no_grad():
        loaded = _relative(model(input_ids=ids).logits, original(input_ids=ids).logits)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.01)
        logits = model(input_ids=ids).logits
    ep_hf.save_pretrained(model, f"{folder}/saved")
    plain = AutoModelForCausalLM.from_pretrained(f"{folder}/saved").float().eval()
    with torch.no_grad():
        saved = _relative(plain(input_ids=ids).logits, logits)
    return {"loaded": loaded, "saved": saved, "local experts": experts.down_proj.shape[0], "training": model.training}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_checkpoint_read_in_part_and_saved_whole(tmp_path, family):
    """qwen3_moe's checkpoint keys are per expert (renumbered per rank), gpt_oss's stacked
    (cut to each rank's rows): both load at EP=2 with the original's logits, and the
    gathered save loads in plain transformers with the split model's."""
    for rank, result in enumerate(run_distributed(_checkpoint_worker, 2, str(tmp_path), family)):
        assert result["local experts"] == 4
        assert result["loaded"] < 1e-5 and result["saved"] < 1e-5, (rank, result)
        assert result["training"] is False  # as transformers' from_pretrained


def _dcp_worker(rank: int, world: int, folder: str) -> dict:
    """A gpt_oss model split over the group trains a step and saves a distributed checkpoint
    (ep_moe.checkpoint) with its AdamW state; a model on one rank's layout (every expert on
    every rank) and a fresh split one load it: their logits and the experts' AdamW moments
    equal the saver's."""
    from ep_moe.checkpoint import load_checkpoint, save_checkpoint

    ids = _token_ids(world)

    def build(group, seed):
        model = ep_hf.expert_parallel(tiny_model("gpt_oss", seed=seed), group)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build(dist.group.WORLD, seed=0)
    model(input_ids=ids[rank], labels=ids[rank]).loss.backward()
    sync_gradients(model, dist.group.WORLD, None)
    optimizer.step()
    save_checkpoint(folder, model, optimizer)
    experts = ep_hf.experts_modules(model)[0][1]
    with torch.no_grad():
        want = model(input_ids=ids[0]).logits
    moment = optimizer.state[experts.gate_up_proj]["exp_avg"]
    results = {}
    for layout, group in (("EP=1", None), ("EP=2", dist.group.WORLD)):
        other, other_optimizer = build(group, seed=1)  # other weights: the load must replace them
        load_checkpoint(folder, other, other_optimizer)
        other_experts = ep_hf.experts_modules(other)[0][1]
        other_moment = other_optimizer.state[other_experts.gate_up_proj]["exp_avg"]
        rows = slice(rank * 4, rank * 4 + 4) if group is None else slice(None)
        with torch.no_grad():
            results[layout] = (_relative(other(input_ids=ids[0]).logits, want),
                               _relative(other_moment[rows], moment))
    return results


def test_distributed_checkpoint_reshards(tmp_path):
    """DCP through ep_moe.checkpoint: saved at EP=2, loaded at EP=1 and EP=2, weights and
    optimizer state (each expert's rows keyed by its global id)."""
    for rank, results in enumerate(run_distributed(_dcp_worker, 2, str(tmp_path / "ckpt"))):
        for layout, diffs in results.items():
            assert max(diffs) < 1e-6, (rank, layout, diffs)


def _fsdp_worker(rank: int, world: int, ep: int) -> dict:
    """A qwen3_moe model split over the mesh's "ep" axis, trained 2 AdamW steps with FSDP2
    (apply_fsdp: experts over "edp", the rest over every rank) and replicated
    (sync_gradients): the worst relative difference of the losses and final weights."""
    from torch.distributed.tensor import DTensor

    from ep_moe.parallel import apply_fsdp, init_parallel_mesh

    pm = init_parallel_mesh(ep, num_experts=8, device_type="cpu")
    groups = pm.groups()
    ids = _token_ids(world)

    def train(model, sync) -> tuple[list[float], dict]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            loss = model(input_ids=ids[rank], labels=ids[rank]).loss
            loss.backward()
            sync(model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
        return losses, full

    replicated = train(ep_hf.expert_parallel(tiny_model("qwen3_moe"), groups.ep_group),
                       lambda m: sync_gradients(m, groups.ep_group, groups.edp_group))
    sharded = apply_fsdp(ep_hf.expert_parallel(tiny_model("qwen3_moe"), pm.ep), pm)
    fsdp = train(sharded, lambda m: None)
    worst = {"loss": max(_relative(a, b) for a, b in zip(fsdp[0], replicated[0]))}
    worst.update({name: _relative(fsdp[1][name], replicated[1][name]) for name in replicated[1]})
    experts = ep_hf.experts_modules(sharded)[0][1]
    worst["experts sharded over edp"] = float(experts.down_proj.device_mesh.mesh_dim_names != ("edp",))
    return worst


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2)])
def test_fsdp_matches_replicated(world, ep):
    """FSDP2 of a transformers model under expert_parallel (experts sharded over the
    expert-data-parallel ranks, called by the model itself) trains as the replicated model
    with sync_gradients: losses and weights after 2 AdamW steps."""
    for rank, worst in enumerate(run_distributed(_fsdp_worker, world, ep)):
        bad = {name: diff for name, diff in worst.items() if diff > 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def _error_worker(rank: int, world: int, case: str) -> str:
    try:
        if case == "indivisible":
            ep_hf.expert_parallel(tiny_model("qwen3_moe", num_experts=6), dist.group.WORLD)
        elif case == "mismatched ranks":
            model = tiny_model("qwen3_moe")
            if rank == 1:
                model = model.double()
            ep_hf.expert_parallel(model, dist.group.WORLD)
            model(input_ids=_token_ids(1)[0])
        else:
            ep_hf.expert_parallel(torch.nn.Linear(4, 4), dist.group.WORLD)
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("case, words", [
    ("indivisible", ["6", "ep_group size 4"]),
    ("mismatched ranks", ["differs across the EP group", "compute dtype"]),
    ("no experts", ["no transformers experts module"]),
])
def test_errors_on_every_rank(case, words):
    """Experts that do not split over the group, ranks whose models differ and a model
    without experts raise on every rank, naming the cause; none hangs."""
    for rank, message in enumerate(run_distributed(_error_worker, 4, case, timeout_s=60)):
        assert all(word in message for word in words), f"rank {rank}: {message}"
