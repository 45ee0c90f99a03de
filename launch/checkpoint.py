"""Checkpoints of an expert-parallel run: save, find the latest, load (with EP resharding).

One checkpoint is a directory ``{dir}/step_{step:08d}/``::

    dense.pt                  rank 0: replicated weights (everything but the experts), their
                              AdamW state, optimizer hyper-parameters (a resumed run uses
                              its own config's and warns where they differ), and ``extra``
                              (step, data position)
    experts-{p:03d}-of-{P:03d}.pt
                              EP rank p of the first EP group (global rank p): its experts'
                              weights and AdamW state, keyed by *global* expert id
    rng-{r:05d}.pt            every rank: its torch CPU (and CUDA) RNG states
    meta.json                 written last, by rank 0: step, world and EP sizes, config

Replicas hold identical values (dense weights on every rank, experts on every rank of an
expert-data-parallel group), so only one copy is written. Expert tensors are stored per
global expert id, in the layout of ``MoELayer.state_dict()`` (``...experts.gate_up.{g}``),
and optimizer state the same way; so a checkpoint loads at any EP size that divides the
number of experts, each rank reading only the shards that hold its experts.

Files are written into ``step_XXXXXXXX.partial/`` and renamed once every rank is done, so
a directory without the suffix is complete. Pruning (``keep``) only considers checkpoints
up to the step just saved: newer ones (another run's, when this one resumed from an
earlier step) are left alone. Under several nodes ``dir`` must be on a file
system that every node sees.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ep_moe.parallel import is_expert_param

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# param_group entries that are not hyper-parameters of the run: which parameters, the lr the
# schedule sets every step, and implementation choices that follow the device.
_NOT_HYPER = frozenset({"params", "lr", "initial_lr", "fused", "foreach", "capturable", "differentiable"})


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When and where to save, and what to resume from."""

    dir: str = "outputs/checkpoints"
    """Directory of the step_XXXXXXXX checkpoints (shared by all nodes)."""
    interval: int = 100
    """Save every this many steps, and after the last step; 0 saves only at the end,
    -1 never."""
    keep: int = 2
    """Keep the newest this many checkpoints up to the step just saved (newer ones, left by
    another run, are never deleted); 0 keeps all."""
    resume: str = ""
    """``""``: start fresh; ``"latest"``: newest complete checkpoint in ``dir`` (fresh start
    if there is none, so a preempted job can be resubmitted unchanged); or a path to one
    ``step_XXXXXXXX`` directory."""

    def __post_init__(self) -> None:
        if self.interval < -1 or self.keep < 0:
            raise ValueError(f"checkpoint.interval={self.interval} must be >= -1 and "
                             f"checkpoint.keep={self.keep} >= 0")


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: which shard files it writes and which experts it holds."""

    rank: int
    world_size: int
    ep_rank: int
    ep_size: int

    @property
    def writes_experts(self) -> bool:
        """Rank p < ep_size is EP rank p of the first EP group; it writes shard p."""
        return self.rank < self.ep_size


def _expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that own expert parameters (``GroupedExperts``), by qualified name."""
    owners = {}
    for name, param in model.named_parameters():
        if is_expert_param(param):
            owner = name.rpartition(".")[0]
            owners[owner] = model.get_submodule(owner)
    return owners


def _dense_keys(model: nn.Module) -> set[str]:
    """State-dict keys of replicated tensors (tied weights under all their names)."""
    params = {n for n, p in model.named_parameters(remove_duplicate=False) if not is_expert_param(p)}
    return params | {n for n, _ in model.named_buffers(remove_duplicate=False)}


def _optimizer_state_by_key(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Optimizer state keyed like the model's state dict: dense params by name, expert
    params split per global expert id (``{name}.{g}``), each slice with its own copy of
    the per-tensor scalars (``step``)."""
    owners = _expert_modules(model)
    out: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if not state:
            continue
        if not is_expert_param(param):
            out[name] = dict(state)
            continue
        owner, _, leaf = name.rpartition(".")
        for j, g in enumerate(owners[owner].global_ids()):
            out[f"{owner}.{leaf}.{g}"] = {k: (v[j] if _per_expert(v) else v) for k, v in state.items()}
    return out


def _per_expert(value: Any) -> bool:
    """Whether an optimizer state entry is a tensor with one row per expert (``exp_avg``),
    as opposed to a scalar shared by the whole parameter (``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _param_order(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Parameters in the index order of ``optimizer.state_dict()``."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def save_checkpoint(root: Path, step: int, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Write this rank's part of the checkpoint of ``step``; collective (call on every rank).

    Returns the final directory. Every rank must see the same ``root``.
    """
    final = root / f"step_{step:08d}"
    partial = final.with_name(final.name + ".partial")
    _check_finite(step, model, optimizer)
    if layout.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    model_state = model.state_dict()
    optim_state = _optimizer_state_by_key(model, optimizer)
    dense = _dense_keys(model)
    if layout.rank == 0:
        hyper = optimizer.state_dict()["param_groups"]
        torch.save({"model": {k: v for k, v in model_state.items() if k in dense},
                    "optimizer": {k: v for k, v in optim_state.items() if k in dense},
                    "param_groups": hyper, "extra": extra}, partial / "dense.pt")
    if layout.writes_experts:
        torch.save({"model": {k: v for k, v in model_state.items() if k not in dense},
                    "optimizer": {k: v for k, v in optim_state.items() if k not in dense}},
                   partial / f"experts-{layout.ep_rank:03d}-of-{layout.ep_size:03d}.pt")
    torch.save(_rng_state(), partial / f"rng-{layout.rank:05d}.pt")
    dist.barrier()
    if layout.rank == 0:
        (partial / "meta.json").write_text(json.dumps(
            {"step": step, "world_size": layout.world_size, "ep_size": layout.ep_size, **meta}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        _prune(root, keep, step)
    dist.barrier()
    return final


def _check_finite(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise, on every rank alike, when a weight, buffer or optimizer state tensor of any
    rank holds NaN or inf: such a checkpoint is never written (nor does pruning then delete
    an older, good one). Collective: one all-reduce of a flag over all ranks."""
    named = [(n, t) for n, t in model.state_dict().items() if t.is_floating_point()]
    named += [(f"optimizer state {k} of {n}", v) for n, p in model.named_parameters()
              for k, v in optimizer.state.get(p, {}).items()
              if isinstance(v, torch.Tensor) and v.is_floating_point()]
    device = next(model.parameters()).device
    finite = [torch.isfinite(t).all().to(device) for _, t in named]
    bad = torch.logical_not(torch.stack(finite)) if finite else torch.zeros(0, dtype=torch.bool, device=device)
    count = bad.sum(dtype=torch.float32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(count)
    if int(count.item()):
        names = [n for (n, _), b in zip(named, bad.tolist()) if b]
        here = (f"this rank: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" if names
                else "on other ranks")
        raise FloatingPointError(f"refusing to save the checkpoint of step {step}: weights or optimizer "
                                 f"state hold NaN or inf ({here}); the earlier checkpoints are kept")


def _prune(root: Path, keep: int, step: int) -> None:
    """Keep the newest ``keep`` complete checkpoints up to ``step`` (the one just saved, so
    always kept, and finite: see ``_check_finite``); newer ones belong to another run (this
    one resumed from an earlier step) and are never touched. Nothing is pruned unless the
    checkpoint of ``step`` is complete, so the newest complete one always survives."""
    saved = root / f"step_{step:08d}"
    if not keep or not (saved / "meta.json").is_file():
        return
    for old in [p for p in complete_checkpoints(root) if checkpoint_step(p) <= step][:-keep]:
        if old != saved:
            shutil.rmtree(old, ignore_errors=True)


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_XXXXXXXX`` checkpoint directory."""
    return int(_STEP_DIR.match(path.name).group(1))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def newer_checkpoints(root: Path, step: int) -> list[Path]:
    """Complete checkpoints under ``root`` past ``step``, oldest first."""
    return [p for p in complete_checkpoints(root) if checkpoint_step(p) > step]


def find_checkpoint(resume: str, root: Path) -> Optional[Path]:
    """The directory ``resume`` names (see :attr:`CheckpointConfig.resume`), or None."""
    if not resume:
        return None
    if resume == "latest":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"checkpoint.resume={resume!r} is not a complete checkpoint directory "
                                f"(no meta.json); pass a step_XXXXXXXX directory or 'latest'")
    return path


def _shards_for(path: Path, saved_ep: int, num_experts: int, experts: range) -> list[Path]:
    """The expert shard files of a checkpoint saved at EP ``saved_ep`` that hold ``experts``."""
    per_shard = num_experts // saved_ep
    first, last = experts.start // per_shard, (experts.stop - 1) // per_shard
    return [path / f"experts-{p:03d}-of-{saved_ep:03d}.pt" for p in range(first, last + 1)]


def load_checkpoint(path: Path, layout: Layout, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load weights, optimizer state and (same world size only) RNG states; return ``extra``.

    Loading is local (no collective): each rank reads ``dense.pt`` and the expert shards
    that cover its experts, whatever EP size they were saved at.
    """
    meta = json.loads((path / "meta.json").read_text())
    dense = torch.load(path / "dense.pt", map_location="cpu", weights_only=True)
    model_state, optim_state = dict(dense["model"]), dict(dense["optimizer"])
    owners = _expert_modules(model)
    if owners:
        num_experts = next(iter(owners.values())).num_local_experts * layout.ep_size
        mine = range(min(m.first_expert for m in owners.values()),
                     max(m.first_expert + m.num_local_experts for m in owners.values()))
        for shard in _shards_for(path, int(meta["ep_size"]), num_experts, mine):
            part = torch.load(shard, map_location="cpu", weights_only=True)
            model_state.update(part["model"])
            optim_state.update(part["optimizer"])
    model.load_state_dict(model_state, strict=True)
    _load_optimizer(model, optimizer, optim_state, dense["param_groups"], warn=layout.rank == 0)
    if int(meta["world_size"]) == layout.world_size:
        _set_rng_state(torch.load(path / f"rng-{layout.rank:05d}.pt", weights_only=True))
    else:
        logger.warning("checkpoint %s was saved by %s ranks, this run has %s: RNG states are not "
                       "restored and the data order differs from the original run",
                       path, meta["world_size"], layout.world_size)
    return dense["extra"]


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, by_key: dict[str, dict[str, Any]],
                    param_groups: list[dict[str, Any]], warn: bool = True) -> None:
    """Rebuild the index-keyed optimizer state dict from the per-key one, then load it with
    the optimizer's own param groups; ``warn``: log the hyper-parameters that differ from
    the checkpoint's ``param_groups``."""
    owners = _expert_modules(model)
    index = {id(p): i for i, p in enumerate(_param_order(optimizer))}
    state: dict[int, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not is_expert_param(param):
            if name in by_key:
                state[index[id(param)]] = by_key[name]
            continue
        owner, _, leaf = name.rpartition(".")
        slices = [by_key.get(f"{owner}.{leaf}.{g}") for g in owners[owner].global_ids()]
        if any(s is None for s in slices):
            if any(s is not None for s in slices):
                raise ValueError(f"checkpoint has optimizer state for only some experts of {name}")
            continue
        state[index[id(param)]] = {k: (torch.stack([s[k] for s in slices]) if _per_expert(v) else v)
                                   for k, v in slices[0].items()}
    # Hyper-parameters come from this run's config, not the checkpoint: only per-parameter
    # state (moments, step counts) is restored. The learning rate is set every step from the
    # schedule, and the implementation flags (fused, foreach) follow this run's device.
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(param_groups):
        raise ValueError(f"checkpoint has {len(param_groups)} optimizer parameter groups, this model "
                         f"{len(current)}")
    if warn:
        changed = sorted({f"{k}={saved[k]!r} -> {now[k]!r}" for saved, now in zip(param_groups, current)
                          for k in saved.keys() & now.keys()
                          if k not in _NOT_HYPER and saved[k] != now[k]})
        if changed:
            logger.warning("optimizer hyper-parameters differ from the checkpoint's; using this run's "
                           "config: %s", ", ".join(changed))
    optimizer.load_state_dict({"state": state, "param_groups": current})


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
