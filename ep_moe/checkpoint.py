"""Distributed checkpoints (``torch.distributed.checkpoint``, DCP) of models with MoE layers,
saved at one (EP, DP) layout and loaded at another.

What DCP needs from a state dict, and where ep_moe gives it:

- **One key per tensor, the same on every rank that holds it.** ``MoELayer.state_dict()``
  keys each expert weight by its *global* id (``...experts.gate_up.{g}``), so
  ``get_model_state_dict`` / ``set_model_state_dict`` of torch.distributed.checkpoint.state_dict
  take the model as it is (the helpers here key the model as they do, from
  ``model.state_dict()`` directly, and load it through ``load_state_dict``: see
  :func:`load_moe_state_dict` for why). The optimizer state of a stacked expert parameter
  is keyed by the parameter (``state["...experts.gate_up"]``) but holds other experts on
  every EP rank, so DCP would keep one rank's copy. :func:`moe_state_dict` splits it per
  global expert (``state["...experts.gate_up.{g}"]``, the keys of the model's state dict;
  per-parameter scalars such as AdamW's ``step`` copied to each) and
  :func:`load_moe_state_dict` stacks it back.
- **Replicas write once.** Dense tensors (equal on every rank) and each expert (equal on
  every rank of its expert-data-parallel group) appear under one key on several ranks;
  DCP writes one copy of each.
- **Resharding.** Loading, each rank asks for the keys of the experts it holds now, so a
  checkpoint written at EP 4 loads at EP 2 or 1 (and back) with no conversion.

A checkpoint is a directory. DCP writes ``.metadata`` last, through a temporary file
renamed into place, once every rank has written its data: :func:`is_complete` is true
exactly when a save finished. :func:`save_checkpoint` first removes the ``.metadata`` of an
earlier save to the same directory, so a re-save killed midway leaves no checkpoint that
looks complete over mixed files; :func:`load_checkpoint` refuses a directory without it, and
:func:`latest_checkpoint` passes over it to the complete one before.

Usage (every rank, same arguments)::

    save_checkpoint(f"ckpt/step_{step:08d}", model, optimizer, extra={"step": torch.tensor(step)})
    ...  # later, maybe at another EP size: build the model and optimizer, then
    extra = {"step": torch.tensor(0)}
    load_checkpoint(path, model, optimizer, extra=extra)   # extra["step"] loaded in place

or with DCP directly: ``dcp.save(moe_state_dict(model, optimizer), checkpoint_id=path)``;
``state = moe_state_dict(model, optimizer); dcp.load(state, checkpoint_id=path);
load_moe_state_dict(model, optimizer, state)``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from ep_moe.distributed import gathered_expert_rows, is_expert_param
from ep_moe.layer import MoELayer

logger = logging.getLogger(__name__)

METADATA = ".metadata"
"""The file DCP writes last: a checkpoint directory without it is incomplete."""
CONFIGS_KEY = "moe_configs"
"""State-dict key of the MoE layers' configs (JSON), compared on load."""
_NOT_COMPARED = frozenset({"ep_size"})
"""MoEConfig fields a checkpoint may differ in: the layout it was saved at."""
_SHOWN = 4
"""Keys named per kind of mismatch in an error (then how many more)."""

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class _StackedExperts:
    """One stacked expert parameter of an experts module: row j is expert ``global_ids[j]``."""

    key: str
    """The parameter's key in the torch state-dict APIs."""
    global_ids: range
    """The experts of this rank, in row order."""
    num_experts: int
    """The layer's experts over all ranks (E)."""


def _api_key(model: nn.Module, name: str) -> str:
    """``name`` (of ``model.named_modules()`` or ``named_parameters()``) as the torch
    state-dict APIs key it: without the ``module.`` of DistributedDataParallel and the
    ``_orig_mod.`` of torch.compile."""
    kept, obj = [], model
    for part in name.split(".") if name else []:
        if not ((isinstance(obj, DistributedDataParallel) and part == "module") or part == "_orig_mod"):
            kept.append(part)
        obj = getattr(obj, part)
    return ".".join(kept)


def _stacked_experts(model: nn.Module) -> dict[str, _StackedExperts]:
    """The stacked expert parameters of ``model``, by key: those of every experts module
    (:class:`~ep_moe.experts.GroupedExperts`, or another that tells its ``global_ids()`` and
    ``num_global_experts``, as :func:`ep_moe.integrations.transformers.expert_parallel` has
    a transformers experts module tell them)."""
    found, covered = {}, set()
    for name, module in model.named_modules():
        if not callable(getattr(module, "global_ids", None)):
            continue
        for leaf, param in module.named_parameters():
            if is_expert_param(param):
                key = _api_key(model, f"{name}.{leaf}" if name else leaf)
                found[key] = _StackedExperts(key, module.global_ids(), module.num_global_experts)
                covered.add(id(param))
    stray = [name for name, param in model.named_parameters() if is_expert_param(param) and id(param) not in covered]
    if stray:
        raise ValueError(f"expert parameters {stray} are in no experts module (GroupedExperts): which global experts "
                         "their rows hold is unknown, so their checkpoint keys cannot be made unique per expert; "
                         "keep expert parameters in an experts module, or do not tag them with mark_expert_param")
    return found


def _moe_configs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each MoE layer's config as JSON values (dtypes as strings), by the layer's key."""
    return {_api_key(model, name): json.loads(json.dumps(dataclasses.asdict(m.config), default=str))
            for name, m in model.named_modules() if isinstance(m, MoELayer)}


def moe_state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """The state of ``model`` (and ``optimizer``) with a unique key per tensor, for ``dcp.save``
    and as the target of ``dcp.load`` (call on every rank).

    Returns ``{"model": ..., "optimizer": ..., "moe_configs": ...}``. The model's part is
    ``model.state_dict()`` keyed as ``get_model_state_dict(model)`` keys it (without the
    ``module.`` and ``_orig_mod.`` of wrappers; computed here, so that the per-expert keys of
    any experts module work, not only those whose attributes resolve them), each stacked expert
    tensor that the module's state dict holds whole split per global expert here. The optimizer's
    part is ``get_optimizer_state_dict(model, optimizer)`` with each stacked expert
    parameter's state split per global expert (see the module docstring); it is absent
    when ``optimizer`` is None. The tensors share memory with the model and the
    optimizer: ``dcp.load`` into this dict, then :func:`load_moe_state_dict`. An empty
    optimizer state is initialised first (a step with zero gradients and learning rate,
    as ``get_optimizer_state_dict`` does), so that there are tensors to load into.
    """
    experts = _stacked_experts(model)
    model_state = _rekey(model.state_dict(), {name: _api_key(model, name) for name, _ in model.named_modules()})
    for key in sorted(experts.keys() & model_state.keys()):  # a module that does not split its own
        stacked = gathered_expert_rows(model_state.pop(key))
        for j, g in enumerate(experts[key].global_ids):
            model_state[f"{key}.{g}"] = stacked[j]
    state = {"model": model_state, CONFIGS_KEY: json.dumps(_moe_configs(model), sort_keys=True)}
    if optimizer is not None:
        state["optimizer"] = _split_per_expert(get_optimizer_state_dict(model, optimizer), experts)
    return state


def load_moe_state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                        state_dict: dict[str, Any]) -> None:
    """Load a :func:`moe_state_dict` (as ``dcp.load`` filled it) into ``model`` and
    ``optimizer`` (None: the model only). The optimizer's through ``set_optimizer_state_dict``,
    so it gets the checkpoint's param groups too (learning rate and the other
    hyper-parameters). The model's through ``model.load_state_dict(strict=True)`` with each
    key put under the model's own names: ``set_model_state_dict`` would do the same, but
    under a DDP or torch.compile wrapper it looks up each parameter by its own key and finds
    the stacked experts' missing (they are saved per expert)."""
    own_names = {_api_key(model, name): name for name, _ in model.named_modules()}  # a wrapper's inner module wins
    model_state = dict(state_dict["model"])
    own_keys = _rekey(model.state_dict(), {name: _api_key(model, name) for name, _ in model.named_modules()}).keys()
    for key, info in _stacked_experts(model).items():
        if key in own_keys:  # split by moe_state_dict, not by the module: stacked back here
            model_state[key] = torch.stack([model_state.pop(f"{key}.{g}") for g in info.global_ids])
    model.load_state_dict(_rekey(model_state, own_names))
    if optimizer is not None:
        if "optimizer" not in state_dict:
            raise ValueError("state_dict holds no optimizer state: build it with moe_state_dict(model, optimizer), "
                             "or pass optimizer=None")
        set_optimizer_state_dict(model, optimizer, _stack_per_expert(state_dict["optimizer"],
                                                                     _stacked_experts(model)))


def _rekey(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state`` with the longest module name that prefixes each key (a key of ``names``,
    which holds the root's ``""``) replaced by its value in ``names``."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        owner = next(i for i in range(len(parts) - 1, -1, -1) if ".".join(parts[:i]) in names)
        renamed = [names[".".join(parts[:owner])]] if names[".".join(parts[:owner])] else []
        out[".".join(renamed + parts[owner:])] = value
    return out


def _split_per_expert(optim_state: dict[str, Any], experts: dict[str, _StackedExperts]) -> dict[str, Any]:
    """``optim_state["state"][key]`` of each stacked expert parameter -> ``[f"{key}.{g}"]`` per
    global expert g: row j of every state tensor, the per-parameter scalars (0-dim, e.g.
    ``step``) as they are."""
    state = dict(optim_state["state"])
    for key, info in experts.items():
        stacked = state.pop(key, None)
        if stacked is None:  # no state (frozen, or a stateless optimizer)
            continue
        rows = len(info.global_ids)
        for name, value in stacked.items():
            if _per_expert(value) and value.shape[0] != rows:
                raise ValueError(f"optimizer state {name!r} of {key} has shape {tuple(value.shape)}, not one row per "
                                 f"local expert ({rows}): it cannot be split per expert for the checkpoint")
        stacked = {name: gathered_expert_rows(value) if _per_expert(value) else value for name, value in stacked.items()}
        for j, g in enumerate(info.global_ids):
            state[f"{key}.{g}"] = {name: value[j] if _per_expert(value) else value for name, value in stacked.items()}
    return {**optim_state, "state": state}


def _stack_per_expert(optim_state: dict[str, Any], experts: dict[str, _StackedExperts]) -> dict[str, Any]:
    """The inverse of :func:`_split_per_expert` for this rank's experts."""
    state = dict(optim_state["state"])
    for key, info in experts.items():
        slices = [state.pop(f"{key}.{g}", None) for g in info.global_ids]
        if all(s is None for s in slices):
            continue
        if any(s is None for s in slices):
            lacking = [g for g, s in zip(info.global_ids, slices) if s is None]
            raise ValueError(f"optimizer state of {key} lacks the experts {lacking}: pass the state of every "
                             f"expert of this rank, {list(info.global_ids)}")
        state[key] = {name: torch.stack([s[name] for s in slices]) if _per_expert(value) else value
                      for name, value in slices[0].items()}
    return {**optim_state, "state": state}


def _per_expert(value: Any) -> bool:
    """Whether an optimizer state entry has a row per expert (``exp_avg``), not one value
    for the whole parameter (``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def is_complete(path: PathLike) -> bool:
    """Whether ``path`` holds a finished DCP checkpoint (its ``.metadata``, written last)."""
    return (Path(path) / METADATA).is_file()


def latest_checkpoint(root: PathLike) -> Optional[Path]:
    """The last complete checkpoint directory directly under ``root`` by name, or None (no
    complete one): name them so that they sort by step (``step_{step:08d}``), and a run
    killed mid-save resumes from the one before."""
    root = Path(root)
    complete = sorted(p for p in root.iterdir() if is_complete(p)) if root.is_dir() else []
    return complete[-1] if complete else None


def save_checkpoint(path: PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    extra: Optional[dict[str, Any]] = None) -> None:
    """Save ``model`` (and ``optimizer``; ``extra``: more state, e.g. the step, under the key
    ``"extra"``) to the directory ``path`` with ``dcp.save``; collective (every rank, same
    ``path``, on a file system every rank sees).

    An earlier checkpoint in ``path`` stops counting first (rank 0 removes its ``.metadata``),
    so the directory is complete again only once this save has finished.
    """
    state = moe_state_dict(model, optimizer)
    if extra is not None:
        state["extra"] = extra
    path = Path(path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / METADATA).unlink(missing_ok=True)
    if dist.is_initialized():
        dist.barrier()  # no rank writes data while the old .metadata still names the old files
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path: PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    extra: Optional[dict[str, Any]] = None) -> None:
    """Load a :func:`save_checkpoint` (any EP size that divides the expert count) into
    ``model`` and ``optimizer``; collective (every rank, same arguments).

    ``extra``: what to read of the saved ``extra``, as DCP loads: tensors are filled in
    place, other values replaced in the dict. Gradients are dropped (the optimizer state
    needs initialising, see :func:`moe_state_dict`).

    Raises ``ValueError`` on every rank alike, before any weight is loaded, when ``path`` is
    not a complete, readable checkpoint or its tensors do not fit the model; the error then names
    the MoE config fields that differ between the checkpoint and the model, and the keys
    that are missing, unexpected or of another shape. Config fields that differ while the
    tensors fit (``top_k``, ``aux_loss_coef``, ...) are logged as a warning. A data file
    that fails to read (truncated, deleted) raises ``ValueError`` on every rank too, naming
    the first failing rank's error; the model and optimizer may then be partly loaded.
    """
    path = Path(path)
    problem, differences, state = None, [], None
    if not path.is_dir():
        problem = f"checkpoint {path} does not exist; pass a directory written by ep_moe.checkpoint.save_checkpoint"
    elif not is_complete(path):
        problem = (f"checkpoint {path} is incomplete: it has no {METADATA}, which DCP writes last, so its save "
                   "was interrupted; load an earlier checkpoint")
    else:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        state = moe_state_dict(model, optimizer)
        if extra is not None:
            state["extra"] = extra
        try:
            saved = FileSystemReader(path).read_metadata().state_dict_metadata
            differences = _config_differences(path, saved, model)
        except (Exception, CheckpointException) as exc:  # a damaged file fails in many ways: unpickler, EOF,
            # a data file missing (reading the configs: DCP's CheckpointException, a BaseException)
            why = (_first_failure(exc) if isinstance(exc, CheckpointException)
                   else f"{type(exc).__name__}: {str(exc)[:200]}")
            problem = f"checkpoint {path} cannot be read ({why}); load an earlier checkpoint"
        else:
            problem = _misfit(path, saved, state, _stacked_experts(model), differences)
    _raise_on_every_rank(problem)
    if differences and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("checkpoint %s was saved with other MoE config values, which this model overrides: %s",
                       path, "; ".join(differences))
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as exc:  # on every rank alike: DCP gathers the ranks' outcomes of each step
        raise ValueError(f"checkpoint {path} cannot be read ({_first_failure(exc)}); load an earlier checkpoint "
                         "(this model and optimizer may be partly loaded)") from None
    load_moe_state_dict(model, optimizer, state)


def _first_failure(exc: CheckpointException) -> str:
    """The lowest failing rank's exception of a DCP ``CheckpointException``, in one line."""
    if not exc.failures:
        return str(exc).strip().splitlines()[0][:200]
    rank = min(exc.failures)
    error = exc.failures[rank][0]
    first = " ".join(str(error).split()).split(". ")[0]  # torch's advice after it does not apply here
    return f"rank {rank}: {type(error).__name__}: {first[:200]}"


def _config_differences(path: Path, saved_metadata: dict[str, Any], model: nn.Module) -> list[str]:
    """``field=saved in the checkpoint, current in this model (MoE layers ...)`` for every
    MoE config field (but the EP size) that differs, and every MoE layer only one of them
    has. Reads the checkpoint's configs on this rank alone (no collective)."""
    saved_state = {CONFIGS_KEY: ""}
    if CONFIGS_KEY not in saved_metadata:
        return []
    with warnings.catch_warnings():  # DCP warns that no_dist loads in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(saved_state, checkpoint_id=path, no_dist=True)
    saved, current = json.loads(saved_state[CONFIGS_KEY]), _moe_configs(model)
    layers: dict[str, list[str]] = {}  # what differs -> the layers where it does
    for layer in sorted(saved.keys() | current.keys()):
        if layer not in current:
            found = ["an MoE layer in the checkpoint, not in this model"]
        elif layer not in saved:
            found = ["an MoE layer in this model, not in the checkpoint"]
        else:
            found = [f"{field}={saved[layer].get(field)!r} in the checkpoint, {current[layer].get(field)!r} "
                     "in this model" for field in sorted(saved[layer].keys() | current[layer].keys())
                     if field not in _NOT_COMPARED and saved[layer].get(field) != current[layer].get(field)]
        for text in found:
            layers.setdefault(text, []).append(repr(layer))
    return [f"{text} (MoE layer{'s' if len(names) > 1 else ''} {', '.join(names)})" for text, names in layers.items()]


def _misfit(path: Path, saved: dict[str, Any], state: dict[str, Any], experts: dict[str, _StackedExperts],
            differences: list[str]) -> Optional[str]:
    """Why the checkpoint's tensors do not fit ``state`` (this rank's :func:`moe_state_dict`),
    or None: keys it lacks, keys of this model's kind it has beyond the model's (another
    layer count, more experts), and shapes that differ; ``saved``: the checkpoint's
    ``state_dict_metadata``."""
    wanted = _tensor_keys(state)
    missing = [k for k in wanted if k not in saved]
    shapes = [f"{k} {tuple(saved[k].size)} in the checkpoint, {tuple(wanted[k])} in this model" for k in wanted
              if isinstance(saved.get(k), TensorStorageMetadata) and tuple(saved[k].size) != wanted[k]]
    expected = set(wanted) | _all_expert_keys(experts)
    unexpected = [k for k in saved if k.startswith("model.") and k not in expected]
    if not (missing or shapes or unexpected):
        return None
    if "optimizer" in state and not any(k.startswith("optimizer.state.") for k in saved):
        return f"checkpoint {path} holds no optimizer state; load it with optimizer=None"
    parts = [f"{what}: {', '.join(keys[:_SHOWN])}{f' (and {len(keys) - _SHOWN} more)' if len(keys) > _SHOWN else ''}"
             for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)) if keys]
    why = f"its tensors do not fit this model ({'; '.join(parts)})"
    if differences:
        return (f"checkpoint {path} was saved from another model config ({'; '.join(differences)}), so {why}; "
                "build the model with the checkpoint's config")
    return f"checkpoint {path} does not fit this model: {why}; build the model it was saved from"


def _tensor_keys(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors of a :func:`moe_state_dict` under the keys DCP gives them, with their shapes."""
    keys = {f"model.{k}": tuple(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    for param, entries in state.get("optimizer", {}).get("state", {}).items():
        keys.update({f"optimizer.state.{param}.{name}": tuple(v.shape) for name, v in entries.items()
                     if isinstance(v, torch.Tensor)})
    return keys


def _all_expert_keys(experts: dict[str, _StackedExperts]) -> set[str]:
    """The model keys of every global expert of ``experts`` (this rank loads its own, the
    other ranks the rest)."""
    return {f"model.{info.key}.{g}" for info in experts.values() for g in range(info.num_experts)}


def _raise_on_every_rank(problem: Optional[str]) -> None:
    """Raise ``ValueError(problem)`` on every rank when any rank has a problem (one
    all-gather of the outcomes when distributed), so that no rank waits in ``dcp.load``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if problem is not None:
            raise ValueError(problem)
        found = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if found:
            raise ValueError(f"rank {found[0][0]}: {found[0][1]}")
    elif problem is not None:
        raise ValueError(problem)
