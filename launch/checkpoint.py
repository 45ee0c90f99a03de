"""Checkpoints of an expert-parallel run: save, find the latest, load (with EP resharding).

One checkpoint is a directory ``{dir}/step_{step:08d}/``, in one of two formats
(``checkpoint.format``; loading reads the format from ``meta.json``, so either resumes).
``"dcp"``, the default: ``torch.distributed.checkpoint`` through ``ep_moe.checkpoint``::

    .metadata, __{r}_0.distcp DCP (``ep_moe.checkpoint.save_checkpoint``): weights and AdamW
                              state, experts and their state keyed per *global* expert, each
                              tensor written once (replicas deduplicated), and the MoE
                              layers' configs; loads at any (EP, DP) layout, each rank
                              reading the tensors of its own experts
    rng-{r:05d}.pt            every rank: its torch CPU (and CUDA) RNG states
    meta.json                 rank 0: format, step, world and EP sizes, config, ``extra``
                              (step, data position)
    COMPLETE                  written last, by rank 0: the checkpoint is complete

``"native"``, this module's own files::

    dense.pt                  rank 0: replicated weights (everything but the experts), their
                              AdamW state, optimizer hyper-parameters (a resumed run uses
                              its own config's and warns where they differ), and ``extra``
                              (step, data position)
    experts-{p:03d}-of-{P:03d}.pt
                              EP rank p of the first EP group (global rank p): its experts'
                              weights and AdamW state, keyed by *global* expert id
    rng-{r:05d}.pt            every rank: its torch CPU (and CUDA) RNG states
    meta.json                 rank 0: format, step, world and EP sizes, config
    COMPLETE                  written last, by rank 0: the checkpoint is complete

A model sharded with FSDP (``parallel.fsdp``) saves in DCP only: each rank writes its
shards, and the checkpoint loads sharded or replicated, at any (EP, DP) layout. Native
checkpoints neither save nor load under FSDP (an error says so).

Replicas hold identical values (dense weights on every rank, experts on every rank of an
expert-data-parallel group), so only one copy is written. Expert tensors are stored per
global expert id, in the layout of ``MoELayer.state_dict()`` (``...experts.gate_up.{g}``),
and optimizer state the same way; so a checkpoint loads at any EP size that divides the
number of experts, each rank reading only the shards that hold its experts. Either format
resumes the optimizer's per-parameter state (moments, step counts), not its
hyper-parameters: those come from the run's config. RNG states are restored when the
world size is the one saved.

Both formats share what follows. Nothing a kill interrupts looks complete. Files are written
into ``step_XXXXXXXX.partial/``; once every rank is done, rank 0 writes the ``COMPLETE``
marker there and renames the directory into place (for DCP, DCP's own ``.metadata`` is not
enough: the marker comes after it, the RNG files and ``meta.json``). Only a directory
holding the marker counts as a checkpoint. Deleting one (pruning, or a re-save of the same
step replacing it) first renames the directory to ``*.deleting`` (atomic; no lookup matches
that name), then removes its marker and deletes it. A re-save killed after the old
directory was renamed away leaves the new one complete as ``.partial``, which ``--resume
latest`` puts in place. ``--resume latest`` takes the newest complete checkpoint that loads
on every rank, naming in the log each one it skips and why; a damaged file is named with its
checkpoint and an earlier step to resume from (DCP: a missing ``.metadata`` by name, other
damage by the reader's error), a checkpoint of another model config with the ``[model]`` and
``[moe]`` values that differ. Non-finite weights or optimizer state are never saved.

Pruning (``keep``) only considers checkpoints up to the step just saved, which is never
deleted: newer ones (another run's, when this one resumed from an earlier step) are left
alone. Under several nodes ``dir`` must be on a file system that every node sees.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from errors import CheckpointError

from ep_moe import checkpoint as dcp_checkpoint
from ep_moe.parallel import is_expert_param

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"
"""The file that makes a checkpoint directory complete: written last, removed first."""
_DELETING = ".deleting"
"""Suffix of a checkpoint directory being deleted (renamed so, after its marker is gone)."""
# param_group entries that are not hyper-parameters of the run: which parameters, the lr the
# schedule sets every step, and implementation choices that follow the device.
_NOT_HYPER = frozenset({"params", "lr", "initial_lr", "fused", "foreach", "capturable", "differentiable"})
FORMATS = ("dcp", "native")
"""The values of ``checkpoint.format``."""


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
    """``""``: start fresh; ``"latest"``: the newest complete checkpoint in ``dir`` that
    loads (fresh start if there is none, so a preempted job can be resubmitted unchanged);
    or a path to one ``step_XXXXXXXX`` directory."""
    export_hf: str = "auto"
    """Where an HF model (``model.hf``) is written as an HF folder at the end of the run, which
    plain transformers loads (with the model folder's tokenizer): ``"auto"``: ``{dir}/hf``;
    ``""``: nowhere. The built-in model is not exported."""
    format: Literal["dcp", "native"] = "dcp"
    """How checkpoints are written: ``dcp`` (``torch.distributed.checkpoint``, each tensor
    under a global key, experts per global id) or ``native`` (this trainer's own files).
    Either loads at any EP and data-parallel layout; resuming reads the format a checkpoint
    was saved in, whatever this value."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"checkpoint.format={self.format!r}: use {' or '.join(map(repr, FORMATS))}")
        if self.interval < -1:
            raise ValueError(f"checkpoint.interval={self.interval} must be >= -1 (-1: never save)")
        if self.keep < 0:
            raise ValueError(f"checkpoint.keep={self.keep} must be >= 0 (0: keep all)")


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
                    extra: dict[str, Any], meta: dict[str, Any], keep: int, format: str = "native") -> Path:
    """Write this rank's part of the checkpoint of ``step``; collective (call on every rank).

    Returns the final directory. Every rank must see the same ``root``. A kill at any point
    leaves every earlier checkpoint complete, and this one complete or unmarked. ``format``:
    one of :data:`FORMATS` (the trainer passes ``checkpoint.format``); with ``"dcp"``,
    ``extra`` must be JSON (it goes to ``meta.json``).
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: use {' or '.join(map(repr, FORMATS))}")
    if format == "native" and _sharded(model):
        raise ValueError("format='native' saves replicated dense weights, but the model is sharded (FSDP: its "
                         "parameters are DTensors); save it with format='dcp'")
    final = root / f"step_{step:08d}"
    partial = final.with_name(final.name + ".partial")
    meta = {"format": format, "step": step, "world_size": layout.world_size, "ep_size": layout.ep_size,
            **({"extra": extra} if format == "dcp" else {}), **meta}
    meta_json = json.dumps(meta, indent=1)  # not JSON: raises here on every rank, before any collective
    _check_finite(step, model, optimizer)
    if layout.rank == 0:
        _discard(partial)  # an interrupted save of this step
        for trash in root.glob(f"step_*{_DELETING}"):  # an interrupted deletion
            shutil.rmtree(trash, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    if format == "dcp":
        dcp_checkpoint.save_checkpoint(partial, model, optimizer)  # collective
    else:
        _save_native(partial, layout, model, optimizer, extra)
    torch.save(_rng_state(), partial / f"rng-{layout.rank:05d}.pt")
    dist.barrier()
    if layout.rank == 0:
        (partial / "meta.json").write_text(meta_json)
        _mark_complete(partial, step)
        _discard(final)  # a re-save of this step: the old one stops counting before it goes
        partial.rename(final)
        _prune(root, keep, step)
    dist.barrier()
    return final


def _save_native(partial: Path, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer,
                 extra: dict[str, Any]) -> None:
    """This rank's files of the native format: rank 0 the replicated tensors, the ranks of
    the first EP group their experts."""
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


def _mark_complete(path: Path, step: int) -> None:
    """Write the marker that makes ``path`` a complete checkpoint, once every file is in
    place (temp file, fsync, rename: the marker exists whole or not at all)."""
    tmp = path / f"{MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"step {step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MARKER)


def _discard(path: Path) -> None:
    """Delete a checkpoint directory so that no kill on the way leaves it looking complete:
    it is renamed away first (``*.deleting``, which no lookup matches: atomic), then loses
    its marker, then is deleted."""
    if not path.exists():
        return
    trash = path.with_name(path.name + _DELETING)
    shutil.rmtree(trash, ignore_errors=True)  # left by an interrupted deletion
    path.rename(trash)
    (trash / MARKER).unlink(missing_ok=True)
    shutil.rmtree(trash, ignore_errors=True)
    if trash.exists():
        logger.warning("could not delete all of %s; remove it by hand", trash)


def _sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (sharded with FSDP)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's weights and AdamW state); a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _check_finite(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise, on every rank alike, when a weight, buffer or optimizer state tensor of any
    rank holds NaN or inf: such a checkpoint is never written (nor does pruning then delete
    an older, good one). Each rank checks what it holds (of a DTensor, under FSDP, its
    shard: every element is on some rank); one all-reduce of a count over all ranks makes
    the verdict common, and each rank names its own bad tensors (else "on other ranks")."""
    named = [(n, _local(t)) for n, t in model.state_dict().items() if t.is_floating_point()]
    named += [(f"optimizer state {k} of {n}", _local(v)) for n, p in model.named_parameters()
              for k, v in optimizer.state.get(p, {}).items()
              if isinstance(v, torch.Tensor) and v.is_floating_point()]
    device = _local(next(model.parameters())).device
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
    checkpoint of ``step`` is complete, so the newest complete one always survives, and each
    deletion unmarks first (``_discard``), so a kill while pruning leaves no half-deleted
    checkpoint that looks complete."""
    saved = root / f"step_{step:08d}"
    if not keep or not _is_complete(saved):
        return
    for old in [p for p in complete_checkpoints(root) if checkpoint_step(p) <= step][:-keep]:
        if old != saved:
            _discard(old)


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_XXXXXXXX`` checkpoint directory."""
    return int(_STEP_DIR.match(path.name).group(1))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root`` (those holding the marker), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and _is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def newer_checkpoints(root: Path, step: int) -> list[Path]:
    """Complete checkpoints under ``root`` past ``step``, oldest first."""
    return [p for p in complete_checkpoints(root) if checkpoint_step(p) > step]


def _finish_interrupted_saves(root: Path) -> None:
    """A ``step_X.partial`` holding the marker was written whole, and its save was killed
    while it replaced an older ``step_X`` (a re-save of that step): finish the replacement."""
    for partial in sorted(root.glob("step_*.partial")):
        if _STEP_DIR.match(partial.stem) and _is_complete(partial):
            final = partial.with_name(partial.stem)
            _discard(final)
            partial.rename(final)
            logger.warning("%s: finished an interrupted save (its files were complete in %s)", final, partial.name)


def _earlier_hint(path: Path) -> str:
    """How to go on without checkpoint ``path``: the newest complete one before it, if any."""
    match = re.match(r"^step_(\d{8})", path.name)
    earlier = [p for p in complete_checkpoints(path.parent)
               if p != path and (match is None or checkpoint_step(p) < int(match.group(1)))]
    if earlier:
        return (f"Resume from an earlier step with --resume {earlier[-1]} (or --resume latest: the newest "
                f"checkpoint that loads)")
    return f"There is no earlier complete checkpoint in {path.parent}: restore it, or start fresh (no --resume)"


def resume_candidates(resume: str, root: Path) -> list[Path]:
    """The checkpoints ``resume`` (see :attr:`CheckpointConfig.resume`) may start from, in
    the order to try them. Call on rank 0 only: with ``"latest"`` it finishes an interrupted
    re-save in ``root`` and returns the complete checkpoints newest first, naming in the log
    the incomplete ones newer than those; with a path, that checkpoint, which must be
    complete (else ``CheckpointError``)."""
    if not resume:
        return []
    if resume != "latest":
        path = Path(resume)
        if not _is_complete(path):
            why = (f"no {MARKER} marker: its save or deletion was interrupted" if path.is_dir()
                   else "no such directory")
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a complete checkpoint ({why}); pass a "
                                  f"step_XXXXXXXX directory or 'latest'. {_earlier_hint(path)}")
        return [path]
    if not root.is_dir():
        return []
    _finish_interrupted_saves(root)
    complete = complete_checkpoints(root)[::-1]
    newest = complete[0].name if complete else ""
    for path in sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.name > newest):
        if not _is_complete(path):
            logger.warning("skipping %s: incomplete (no %s marker: its save or deletion was interrupted)",
                           path, MARKER)
    return complete


def resume(spec: str, root: Path, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer,
           config: Optional[dict[str, Any]] = None) -> Optional[tuple[Path, dict[str, Any]]]:
    """Load the checkpoint ``spec`` (``checkpoint.resume``) names; collective (every rank,
    same arguments). Returns (its path, its ``extra``), or None: nothing to resume.

    Rank 0 lists the candidates (:func:`resume_candidates`) and every rank loads each in
    turn (``config``: see :func:`load_checkpoint`) until all ranks loaded the same one.
    With ``"latest"`` a checkpoint that fails to load on any rank is skipped, named in the
    log with why; with a path, that failure is the error. ``CheckpointError`` is raised
    alike on every rank; an unexpected exception on one rank is re-raised there and named
    on the others, so no rank is left waiting.
    """
    box: list[Any] = [None]
    if layout.rank == 0:
        try:
            box = [(resume_candidates(spec, root), None)]
        except CheckpointError as exc:
            box = [(None, str(exc))]
    dist.broadcast_object_list(box, src=0)
    candidates, error = box[0]
    if error is not None:
        raise CheckpointError(error)
    skipped = []
    for path in candidates:
        extra, reason = _load_agreed(path, layout, model, optimizer, config)
        if reason is None:
            return path, extra
        if spec != "latest":
            raise CheckpointError(reason)
        if layout.rank == 0:
            logger.warning("skipping %s: %s", path, reason)
        skipped.append(f"{path.name}: {reason}")
    if skipped:
        raise CheckpointError(f"no complete checkpoint in {root} loads (newest first): {' | '.join(skipped)}. "
                              f"Fix or move them away, then resume again or start fresh")
    return None


def _load_agreed(path: Path, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: Optional[dict[str, Any]]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Every rank loads ``path``; returns (``extra``, None) when all did, else (None, why
    not: the ranks' errors). Collective: one all-gather of the outcomes."""
    extra, outcome, bug = None, None, None
    try:
        extra = load_checkpoint(path, layout, model, optimizer, config)
    except CheckpointError as exc:
        outcome = ("error", str(exc))
    except Exception as exc:  # a bug: re-raised below, once the other ranks know
        outcome, bug = ("bug", f"{type(exc).__name__}: {exc}"), exc
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    if bug is not None:
        raise bug
    bugs = [(rank, o[1]) for rank, o in enumerate(outcomes) if o is not None and o[0] == "bug"]
    if bugs:
        raise RuntimeError(f"loading {path} failed on rank {bugs[0][0]} ({bugs[0][1]}); see that rank's traceback")
    errors = {o[1] for o in outcomes if o is not None}
    if not errors:
        return extra, None
    if len(errors) == 1:
        return None, errors.pop()
    return None, " / ".join(f"rank {rank}: {o[1]}" for rank, o in enumerate(outcomes) if o is not None)


def _shards_for(path: Path, saved_ep: int, num_experts: int, experts: range) -> list[Path]:
    """The expert shard files of a checkpoint saved at EP ``saved_ep`` that hold ``experts``."""
    per_shard = num_experts // saved_ep
    first, last = experts.start // per_shard, (experts.stop - 1) // per_shard
    return [path / f"experts-{p:03d}-of-{saved_ep:03d}.pt" for p in range(first, last + 1)]


def load_checkpoint(path: Path, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Load weights, optimizer state and (same world size only) RNG states; return ``extra``.

    The format is the one ``meta.json`` names (none: native). Native loading is local (no
    collective): each rank reads ``dense.pt`` and the expert shards that cover its experts,
    whatever EP size they were saved at. DCP loading is collective (every rank, same
    ``path``): each rank reads the tensors of its experts, whatever (EP, DP) layout they
    were saved at, and its errors are raised alike on every rank. Raises
    ``CheckpointError`` naming the checkpoint, the file and an earlier checkpoint to resume
    from when a file is missing, empty or damaged; and, when the tensors do not fit the
    model, naming the ``[model]`` and ``[moe]`` values that differ between the checkpoint's
    config and ``config`` (this run's ``JobConfig.to_dict()``). A failed load may leave the
    model and optimizer partly loaded: load another checkpoint, or stop.
    """
    meta = _read_meta(path)
    if meta["format"] == "native" and _sharded(model):
        raise CheckpointError(f"cannot resume from checkpoint {path}: it is in the native format (its meta.json), "
                              "whose replicated dense weights do not load into a model sharded with FSDP "
                              "(parallel.fsdp=true). Resume it with parallel.fsdp=false and save it again with "
                              "checkpoint.format='dcp', which then loads under FSDP; or start fresh in another "
                              "checkpoint.dir")
    if meta["format"] == "dcp":
        extra = _load_dcp(path, meta, layout, model, optimizer, config)
    else:
        extra = _load_native(path, meta, layout, model, optimizer, config)
    _load_rng(path, meta, layout)
    return extra


def _load_native(path: Path, meta: dict[str, Any], layout: Layout, model: nn.Module,
                 optimizer: torch.optim.Optimizer, config: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Weights and optimizer state of a native checkpoint; returns its ``extra``."""
    dense = _read_part(path, "dense.pt", ("model", "optimizer", "param_groups", "extra"))
    extra = dense["extra"]
    if not (isinstance(extra, dict) and isinstance(extra.get("step"), int) and "data" in extra):
        raise _damaged(path, "dense.pt", "holds no step and data position")
    model_state, optim_state = dict(dense["model"]), dict(dense["optimizer"])
    diffs = _config_diff(meta.get("config"), config)
    owners = _expert_modules(model)
    if any(not hasattr(m, "first_expert") for m in owners.values()):
        raise _not_this_model(path, diffs, "a native checkpoint holds the built-in model's MoE layers, and this "
                                           "model's experts are not those")
    if owners:
        num_experts = next(iter(owners.values())).num_local_experts * layout.ep_size
        if num_experts % meta["ep_size"]:
            raise _not_this_model(path, diffs, f"saved at EP {meta['ep_size']}, which does not divide this "
                                               f"model's {num_experts} experts")
        mine = range(min(m.first_expert for m in owners.values()),
                     max(m.first_expert + m.num_local_experts for m in owners.values()))
        for shard in _shards_for(path, meta["ep_size"], num_experts, mine):
            if diffs and not shard.is_file():
                raise _not_this_model(path, diffs, f"no shard {shard.name} for its experts")
            part = _read_part(path, shard.name, ("model", "optimizer"))
            model_state.update(part["model"])
            optim_state.update(part["optimizer"])
    try:
        model.load_state_dict(model_state, strict=True)
        _load_optimizer(model, optimizer, optim_state, dense["param_groups"], warn=layout.rank == 0)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise _not_this_model(path, diffs, _summary(exc)) from None
    return extra


def _load_dcp(path: Path, meta: dict[str, Any], layout: Layout, model: nn.Module,
              optimizer: torch.optim.Optimizer, config: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Weights and optimizer state of a DCP checkpoint (``ep_moe.checkpoint.load_checkpoint``:
    collective, its errors alike on every rank); returns its ``extra`` (from ``meta.json``).
    The optimizer keeps this run's hyper-parameters, as :func:`_load_optimizer` does."""
    extra = meta.get("extra")
    if not (isinstance(extra, dict) and isinstance(extra.get("step"), int) and "data" in extra):
        raise _damaged(path, "meta.json", "holds no step and data position (extra)")
    if not (path / dcp_checkpoint.METADATA).is_file():
        raise _damaged(path, dcp_checkpoint.METADATA, "is missing")
    diffs = _config_diff(meta.get("config"), config)
    current = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        dcp_checkpoint.load_checkpoint(path, model, optimizer)
    except ValueError as exc:  # raised on every rank alike
        # ep_moe's message less its advice (the trainer gives its own) and, where the config
        # values that differ are named, less its own naming of them
        detail = re.sub(r"; (load an earlier checkpoint|build the model)[^;]*$", "",
                        str(exc).replace(f"checkpoint {path} ", "it ", 1))
        if diffs:
            misfit = re.search(r"its tensors do not fit this model \((.*)\)$", detail)
            raise _not_this_model(path, diffs, _summary(misfit.group(1) if misfit else detail)) from None
        raise CheckpointError(f"cannot resume from checkpoint {path}: {_summary(detail)}. "
                              f"{_earlier_hint(path)}") from None
    finally:  # the checkpoint's param groups came with its state: this run's config wins
        saved = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        for group, own in zip(optimizer.param_groups, current):
            group.update(own)
    if layout.rank == 0:
        _warn_hyper(saved, current)
    return extra


def _load_rng(path: Path, meta: dict[str, Any], layout: Layout) -> None:
    """This rank's RNG states, when the checkpoint was saved at this world size."""
    if meta["world_size"] == layout.world_size:
        name = f"rng-{layout.rank:05d}.pt"
        try:
            _set_rng_state(_read_part(path, name, ("cpu",)))
        except (TypeError, RuntimeError) as exc:
            raise _damaged(path, name, f"holds no RNG state ({_summary(exc)})") from None
    else:
        logger.warning("checkpoint %s was saved by %s ranks, this run has %s: RNG states are not "
                       "restored and the data order differs from the original run",
                       path, meta["world_size"], layout.world_size)


def _summary(exc: BaseException, lines: int = 3) -> str:
    """The first few non-empty lines of ``exc``'s message, joined: torch's errors run long."""
    text = [line.strip() for line in str(exc).splitlines() if line.strip()]
    more = f" (and {len(text) - lines} more)" if len(text) > lines else ""
    return "; ".join(text[:lines])[:600] + more


def _gist(exc: BaseException) -> str:
    """The first sentence of ``exc``'s message: torch's advice after it (``weights_only=False``)
    does not apply to a damaged file."""
    text = str(exc).strip()
    return (text.splitlines()[0].split(". ")[0] if text else "no message")[:200]


def _damaged(path: Path, name: str, problem: str) -> CheckpointError:
    return CheckpointError(f"cannot resume from checkpoint {path}: its file {name} {problem}. {_earlier_hint(path)}")


def _read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of checkpoint ``path``, checked for the fields loading needs."""
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _damaged(path, file.name, "is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        problem = "is empty (0 bytes)" if file.stat().st_size == 0 else f"is not valid JSON ({exc})"
        raise _damaged(path, file.name, problem) from None
    sizes = ("step", "world_size", "ep_size")
    if not (isinstance(meta, dict) and all(isinstance(meta.get(k), int) and meta[k] >= 0 for k in sizes)
            and meta["ep_size"] > 0):
        raise _damaged(path, file.name, f"lacks {', '.join(sizes)} (non-negative integers)")
    meta.setdefault("format", "native")  # saved before there was a choice
    if meta["format"] not in FORMATS:
        raise _damaged(path, file.name, f"names the format {meta['format']!r}, not one of "
                                        f"{', '.join(map(repr, FORMATS))}")
    return meta


def _read_part(path: Path, name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``torch.load`` of file ``name`` of checkpoint ``path``: a dict holding ``keys``."""
    file = path / name
    try:
        if file.stat().st_size == 0:
            problem = "is empty (0 bytes)"
        else:
            part = torch.load(file, map_location="cpu", weights_only=True)
            if isinstance(part, dict) and all(k in part for k in keys):
                return part
            problem = f"does not hold a checkpoint part (the keys {', '.join(keys)})"
    except FileNotFoundError:
        problem = "is missing"
    except Exception as exc:  # a damaged file fails in many ways: zip reader, unpickler, EOF
        problem = f"cannot be read: it is truncated or not a checkpoint file ({type(exc).__name__}: {_gist(exc)})"
    raise _damaged(path, name, problem)


_UNSET = object()


def _config_diff(saved: Any, current: Optional[dict[str, Any]]) -> list[str]:
    """``section.key`` with both values, for each ``[model]`` and ``[moe]`` value in which
    the checkpoint's config (from its meta.json) and this run's differ."""
    if not isinstance(saved, dict) or current is None:
        return []
    diffs = []
    for section in ("model", "moe"):
        old, new = _flat(saved.get(section) or {}, section), _flat(current.get(section) or {}, section)
        for key in sorted(old.keys() | new.keys()):
            before, now = old.get(key, _UNSET), new.get(key, _UNSET)
            if before != now:
                diffs.append(f"{key}={_shown(before)} in the checkpoint, {_shown(now)} in this run")
    return diffs


def _flat(table: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``table`` with nested tables (an HF model's ``model.hf_config``) as dotted keys."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}.{key}"))
        else:
            flat[f"{prefix}.{key}"] = value
    return flat


def _shown(value: Any) -> str:
    return "unset" if value is _UNSET else repr(value)


def _not_this_model(path: Path, diffs: list[str], detail: str) -> CheckpointError:
    """The error for a checkpoint whose tensors do not fit the model (``detail``), naming
    the config values that differ (``diffs``) first."""
    if diffs:
        return CheckpointError(
            f"cannot resume from checkpoint {path}: it was saved with another model config ({'; '.join(diffs)}), "
            f"so its tensors do not fit this model ({detail}). Resume with the checkpoint's [model] and [moe] "
            f"values (its meta.json holds its config), or start fresh in another checkpoint.dir")
    return CheckpointError(f"cannot resume from checkpoint {path}: its tensors do not fit this model ({detail}); "
                           f"resume with the config it was saved with, or start fresh in another checkpoint.dir")


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
        _warn_hyper(param_groups, current)
    optimizer.load_state_dict({"state": state, "param_groups": current})


def _warn_hyper(saved_groups: list[dict[str, Any]], current_groups: list[dict[str, Any]]) -> None:
    """Log the optimizer hyper-parameters in which the checkpoint's param groups differ from
    this run's (which are used)."""
    def plain(value: Any) -> Any:  # DCP gives a tuple back as a list
        return tuple(value) if isinstance(value, list) else value

    changed = sorted({f"{k}={plain(saved[k])!r} -> {plain(now[k])!r}"
                      for saved, now in zip(saved_groups, current_groups)
                      for k in saved.keys() & now.keys() if k not in _NOT_HYPER and plain(saved[k]) != plain(now[k])})
    if changed:
        logger.warning("optimizer hyper-parameters differ from the checkpoint's; using this run's "
                       "config: %s", ", ".join(changed))


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
