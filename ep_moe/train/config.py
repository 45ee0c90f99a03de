"""The trainer's configuration: a TOML file (a preset of ``ep_moe/configs/train/`` by name,
such as ``--config gpu``, or a file of yours) plus command-line overrides.

A config file has one table per component; every key is optional and defaults to the
field default documented on the dataclasses below (``[model]`` and ``[data]`` are owned by
``model.py`` and ``data.py``, ``[checkpoint]`` by ``checkpoint.py``; ``[moe]`` holds the
keyword arguments of ``ep_moe.MoEConfig``, whose ``hidden_size`` comes from ``model.dim``).

Overrides, applied in order after the file:

- ``--set SECTION.KEY=VALUE`` (repeatable): VALUE is parsed as a TOML value, and taken as a
  plain string when it does not parse: ``--set moe.num_experts=16``,
  ``--set training.lr=1e-3``, ``--set data.path=corpus.txt``.
- shorthands for the common ones: ``--steps``, ``--ep-size``, ``--hf-model``, ``--data``,
  ``--eval-data``, ``--resume``, ``--checkpoint-dir``, ``--export-hf``, ``--metrics-file``,
  ``--tensorboard``. Without ``--config`` the preset is ``tiny``, or ``hf`` with
  ``--hf-model``.

Every value (file or override) must have its field's type, checked before anything is
built: an integer where the field is an int (``steps = 1e3`` is an error), a number where
it is a float (integers are converted), true/false for a bool, a string for a str (a
string of digits needs TOML quotes: ``--set "logging.sample_prompt='42'"``). ``[moe]`` is
checked by ``MoEConfig``.

Every numeric field has a range, in one table per module (``RANGES`` here, ``MODEL_RANGES``
in ``model.py``, ``MoEConfig``'s rules in ``ep_moe/config.py``): finite, and within bounds
past which a value is absurd and would fail far from its cause (``training.seed`` at most
2**44 - 1, which data.py's generator seeds need; ``model.vocab_size`` at most 2**24;
``data.synthetic_bytes`` at most 2**28: more is a token file's job). Then the values
together: a config whose parameters, gradients, AdamW state and logits
(:func:`memory_needs`, a floor of each phase's peak) cannot fit this host's physical memory,
or the total memory of the GPU it trains on, is refused (:func:`check_memory`) before
anything is allocated: the built-in model's host memory here, the rest by the trainer once it
has resolved the device and counted an HF model's parameters.

Errors are ``ConfigError``s, raised before any process group or model is built. Each names
the key, who set it (the file, or the command-line option: ``--set training.stepz=10``,
``--steps 0``) and the fix: an unknown key lists the section's keys, the closest first; a
value of the wrong type and a value outside a field's choices (``training.dtype='fp16'``)
get different messages; a value out of range names the range (``allowed: 0 <
training.lr <= 10``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import torch

from ep_moe import MoEConfig
from ep_moe.configs import preset_names, resolve_preset
from ep_moe.train.checkpoint import CheckpointConfig
from ep_moe.train.data import DataConfig
from ep_moe.train.errors import ConfigError
from ep_moe.train.model import ModelConfig, Range, check_ranges

DEFAULT_CONFIG = "tiny"
"""The preset (``ep_moe/configs/train/``) when no ``--config`` is given."""
DEFAULT_HF_CONFIG = "hf"
"""The preset of ``--hf-model DIR`` when no ``--config`` is given."""

SEED_MULTIPLIER = 1_000_003
"""``data.TokenBatches`` seeds epoch ``e``'s window order with ``seed * 1_000_003 + e``
(the validation split with ``seed + 1``): a ``torch.Generator`` seed, at most 2**64 - 1."""
MAX_SEED = 2**44 - 1
"""The largest ``training.seed``: ``(MAX_SEED + 1) * SEED_MULTIPLIER`` leaves room for
8.5e17 epochs below 2**64 (2**63 - 1 overflowed at step 1)."""
MAX_SYNTHETIC_BYTES = 2**28
"""The largest embedded corpus: it is generated in Python on every rank, about 10 MB/s
(2**28 bytes take half a minute; 1e11 took hours, silently)."""
_INT31 = 2**31 - 1

RANGES: dict[str, Range] = {
    "training.steps": Range(1, _INT31, integer=True, below="must be positive"),
    "training.batch_size": Range(1, 2**20, integer=True, below="must be positive"),
    "training.seq_len": Range(1, 2**24, integer=True, below="must be positive"),
    "training.lr": Range(0, 10, lo_open=True, fix="AdamW's usual peak is 1e-4 to 3e-3"),
    "training.min_lr_ratio": Range(0, 1, natural=True),
    "training.warmup_steps": Range(0, _INT31, integer=True),
    "training.weight_decay": Range(0, None, fix="the usual value is 0.1; also training.lr * training.weight_decay "
                                                "must be < 1"),
    "training.betas": Range(0, 1, natural=True, fix="the usual betas are [0.9, 0.95]"),
    "training.grad_clip": Range(0, None, below="must be >= 0 (0 disables it)"),
    "training.max_skipped_steps": Range(0, _INT31, integer=True),
    "training.seed": Range(0, MAX_SEED, integer=True,
                           fix=f"the data order seeds a torch.Generator with seed * {SEED_MULTIPLIER:_} + epoch, "
                               "which must fit in 64 bits: pick a smaller seed"),
    "parallel.ep_size": Range(0, 2**16, integer=True, below="must be >= 0 (0: all ranks)"),
    "parallel.autotune_timeout_s": Range(0, 7 * 86400, lo_open=True,
                                         fix="seconds the ranks wait for rank 0's kernel tuning; the default is 900"),
    "logging.log_interval": Range(1, _INT31, integer=True),
    "logging.eval_interval": Range(0, _INT31, integer=True, below="must be >= 0 (0 disables evaluation)"),
    "logging.eval_batches": Range(1, 2**20, integer=True),
    "logging.sample_tokens": Range(0, 2**16, integer=True, fix="the sample is greedy, one forward per token"),
    "data.synthetic_bytes": Range(4096, MAX_SYNTHETIC_BYTES, integer=True,
                                  fix="the embedded corpus is a toy generated in Python on every rank (2**28 bytes "
                                      "take half a minute); for more data use a token file: data.path='train.bin' "
                                      "(uint16 ids), or text"),
}
"""One range per numeric field of the trainer's config dataclasses here (``[training]``,
``[parallel]``, ``[logging]``), checked by their ``__post_init__``, and of
``data.synthetic_bytes`` (checked when the embedded corpus is used); ``[model]``'s are
``model.MODEL_RANGES``. Errors name the key, the value, the range and the fix."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Optimisation: batch, schedule, optimizer, precision, device."""

    steps: int = 300
    """Optimizer steps in the whole run (a resumed run continues up to this)."""
    batch_size: int = 16
    """Sequences per rank per step; the global batch is ``batch_size * world_size``."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``lr * min_lr_ratio`` on the last step."""
    warmup_steps: int = 20
    """Linear warm-up steps from ``lr / warmup_steps`` to ``lr``."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not norms, not the router bias)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (dense and all expert shards) to this; 0 disables."""
    max_skipped_steps: int = 0
    """A step whose loss (on any rank) or global gradient norm is NaN or infinite is skipped
    (no optimizer update) up to this many times in a run; the next one stops the run with an
    error naming the step. 0: stop at the first."""
    seed: int = 0
    """Seeds initialisation, the data order and the embedded corpus; 0 to ``MAX_SEED``
    (2**44 - 1: the data order's generator seeds are ``seed * 1_000_003 + epoch``)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA (NCCL, Triton kernels) when a GPU is visible, else CPU (gloo, torch)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """The precision regime's storage: ``float32`` keeps fp32 master weights, gradients and
    AdamW state (with ``dtype = 'bfloat16'``: computed under bf16 autocast); ``bfloat16``
    is pure bf16, as Hugging Face fine-tuning often runs: parameters, gradients and AdamW
    state in bf16, no autocast (needs ``dtype = 'bfloat16'``). The optimizer step is fused
    either way on CUDA."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: ``bfloat16`` autocasts attention and projections (weights and optimizer
    stay fp32); the MoE layers' experts compute in the autocast dtype too, their routers in
    fp32. Under ``parallel.fsdp`` FSDP's mixed precision takes autocast's place (bf16
    weights in the forward and backward, fp32 gradient reduction, weights and AdamW state).
    On CUDA, fp32 matmuls, the Triton expert GEMMs included, use TF32 tensor cores."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward instead of keeping its activations
    (``torch.utils.checkpoint``, non-reentrant; the MoE layer's all-to-alls run again: it
    is recomputed once, on torch < 2.8 twice at EP>1; see the README)."""
    compile: bool = False
    """``torch.compile`` each transformer block: at EP=1 with bf16 experts an HF model's decoder
    layer is one graph with ep_moe's kernels inside; Dynamo breaks the graph at the EP
    exchanges (host sync, collectives), the FP8 GEMMs and the built-in MoE layer's statistics,
    and compiles the rest."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Capture each transformer block's forward and backward in CUDA graphs and replay them
    (``ep_moe/train/graphs.py``): the host stops setting the pace of small models. ``auto``: on
    where it can work (CUDA; EP=1 or a dispatch without host syncs, ``moe.dispatch=
    'all_gather'`` or ``'all_gather_copy_engine'``; neither ``compile`` nor
    ``activation_checkpointing`` nor ``parallel.fsdp``), else off with the reason logged;
    ``on``: an error where it cannot work."""

    def __post_init__(self) -> None:
        check_ranges(self, "training", RANGES)
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"training.lr * training.weight_decay = {self.lr * self.weight_decay:g} (training.lr="
                             f"{self.lr}, training.weight_decay={self.weight_decay}) must be < 1: AdamW multiplies "
                             "each weight by 1 - lr * weight_decay every step; lower training.weight_decay")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"training.device={self.device!r}: use 'auto', 'cpu' or 'cuda'")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"training.dtype={self.dtype!r}: use 'float32' or 'bfloat16'")
        if self.param_dtype == "bfloat16" and self.dtype != "bfloat16":
            raise ValueError("training.param_dtype='bfloat16' computes in bf16: set training.dtype='bfloat16' too "
                             "(or training.param_dtype='float32' for fp32 training)")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the ranks are split. Every rank is a data-parallel rank; experts are split over
    EP groups of ``ep_size`` consecutive ranks and held alike by the ``world_size / ep_size``
    ranks at the same place of every EP group (expert data parallel, ``edp``). Dense
    weights are replicated on every rank, or sharded with ``fsdp``."""

    ep_size: int = 0
    """Expert-parallel degree; 0 means every rank (EP = world size)."""
    fsdp: bool = False
    """Shard weights, gradients and AdamW state with FSDP2 (``ep_moe.parallel.apply_fsdp``,
    torchtitan's layout): dense weights over all ranks, each rank's experts over its
    ``edp`` ranks, gradients reduce-scattered in the backward. With ``training.dtype =
    'bfloat16'`` FSDP's mixed precision replaces autocast: bf16 weights in the forward and
    backward, gradients reduced and AdamW in fp32. Needs ``checkpoint.format = 'dcp'``;
    CUDA graphs are off (``training.cuda_graphs = 'on'`` is an error). false: dense weights
    replicated, gradients all-reduced after the backward (``sync_gradients``)."""
    autotune_timeout_s: float = 900.0
    """How long the ranks wait for rank 0's kernel tuning before all fall back to defaults:
    seconds, > 0, at most a week."""

    def __post_init__(self) -> None:
        check_ranges(self, "parallel", RANGES)


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What rank 0 reports and where."""

    log_interval: int = 10
    """Log loss, aux loss, tokens/s and expert load every this many steps, and at the first
    and last step of the run."""
    metrics_file: str = ""
    """One JSON line per logged step and per evaluation, written by rank 0: a fresh run
    truncates the file, a resumed run drops the records past its starting step and appends.
    Empty for none."""
    tensorboard_dir: str = ""
    """Rank 0 also writes every logged step and evaluation as TensorBoard scalars (loss, aux
    loss, lr, grad norm, tokens/s, expert load, validation loss) into this directory (needs
    ``pip install tensorboard``; a resumed run drops the events past its starting step).
    Empty for none."""
    progress_bar: bool = True
    """Show a tqdm bar on rank 0 (when its stderr is a terminal)."""
    eval_interval: int = 100
    """Evaluate on held-out data every this many steps and at the end; 0 disables (and then
    the validation split may be shorter than one sequence)."""
    eval_batches: int = 4
    """Batches per rank in one evaluation."""
    sample_prompt: str = ""
    """After training, greedily continue this prompt (byte-level data only) and log it."""
    sample_tokens: int = 32
    """Tokens to generate for the sample."""

    def __post_init__(self) -> None:
        check_ranges(self, "logging", RANGES)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything one training run reads."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``ep_moe.MoEConfig`` other than ``hidden_size``; with
    ``model.hf``, only :data:`HF_MOE_KEYS` (``expert_precision`` among them)."""
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def moe_config(self) -> MoEConfig:
        """The built-in model's MoE layer config, its hidden size tied to the model's."""
        if "hidden_size" in self.moe:
            raise ValueError("moe.hidden_size is set from model.dim; remove it from [moe]")
        return MoEConfig(hidden_size=self.model.dim, **self.moe)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for logs and checkpoints); with ``model.hf``, ``[model]`` holds
        only it (the built-in model's defaults describe nothing of this run)."""
        record = dataclasses.asdict(self)
        if self.model.hf:
            record["model"] = {"hf": self.model.hf}
        return record


_SECTIONS = {f.name: f for f in dataclasses.fields(JobConfig)}
_MOE_KEYS = sorted(f.name for f in dataclasses.fields(MoEConfig) if f.name != "hidden_size")


def _describe(annotation: Any) -> str:
    """What a value of ``annotation`` looks like in TOML, for error messages."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _describe(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])} values"
        return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
    names = {int: "an integer", float: "a number", str: "a string (quote it)", bool: "true or false"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


class _WrongType(Exception):
    pass


class _WrongValue(Exception):
    """The right type, but not one of the values a ``Literal`` field allows."""


def _coerce(value: Any, annotation: Any) -> Any:
    """``value`` as a value of ``annotation`` (int -> float, list -> tuple), or raise
    ``_WrongType`` (or ``_WrongValue``: a value of an allowed type that is not among a
    ``Literal``'s choices). Driven by the annotation alone, so a new config field is checked too."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin is Literal:
        # Literal[...] members are str/int/bool here: compare type and value, so True != 1.
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise _WrongValue if any(type(value) is type(a) for a in args) else _WrongType
    if origin in (Union, types.UnionType):
        wrong_value = False
        for arm in args:
            try:
                return _coerce(value, arm)
            except _WrongValue:
                wrong_value = True
            except _WrongType:
                pass
        raise _WrongValue if wrong_value else _WrongType
    if annotation is type(None):
        if value is None:
            return value
        raise _WrongType
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _WrongType
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0]) for v in value)
        if len(value) != len(args):
            raise _WrongType
        return tuple(_coerce(v, a) for v, a in zip(value, args))
    if origin is not None:  # dict[...], list[...]: the container type only
        if isinstance(value, origin):
            return value
        raise _WrongType
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _WrongType
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _WrongType
    if isinstance(annotation, type):
        if isinstance(value, annotation):
            return value
        raise _WrongType
    return value  # an annotation this checker does not know: leave it to the dataclass


class Origins:
    """Where each value was set, for error messages: the config file, or the command-line
    option (``--set training.lr=1e-3``, ``--steps 7``) that set it last."""

    def __init__(self, default: str) -> None:
        self.default = default
        """Blamed for keys set nowhere else (and for defaults): normally the config file."""
        self._by_key: dict[str, str] = {}

    def set(self, key: str, origin: str) -> None:
        """Record that ``key`` (``section.name``) was set by ``origin``."""
        self._by_key[key] = origin

    def of(self, key: str) -> str:
        """Who set ``key``."""
        return self._by_key.get(key, self.default)

    def blame(self, section: str, table: dict[str, Any], message: str) -> str:
        """Who set the keys of ``table`` that ``message`` (a dataclass's error) names: the
        command line first; the default source when it names none that was set."""
        named = [self.of(f"{section}.{key}") for key in table
                 if re.search(rf"\b(?:{section}|MoEConfig|ExpertsOptions)\.{re.escape(key)}\b", message)]
        named.sort(key=lambda origin: not origin.startswith("--"))
        return named[0] if named else self.default


def _keys_listed(key: str, known: list[str]) -> str:
    """``known``, the closest matches to ``key`` first, then the rest in order."""
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    return ", ".join(close + [k for k in sorted(known) if k not in close])


def _unknown_keys(section: str, unknown: list[str], known: list[str], origins: Origins) -> ConfigError:
    """The error for keys of ``[section]`` that no field has, each with who set it."""
    first = unknown[0]
    close = difflib.get_close_matches(first, known, n=1, cutoff=0.6)
    hint = f"did you mean {section}.{close[0]}? " if close else ""
    where = "; ".join(f"{origins.of(f'{section}.{k}')}: unknown key {section}.{k}" for k in unknown)
    return ConfigError(f"{where}; {hint}[{section}] takes {_keys_listed(first, known)}")


def _section(name: str, cls: type, table: dict[str, Any], origins: Union[Origins, str]):
    """Build the dataclass ``cls`` of table ``[name]``, checking every value against its
    field's annotation first (so a wrong type fails here, naming the field, not later).
    ``origins``: who set each key (a plain string blames one source for all)."""
    origins = Origins(origins) if isinstance(origins, str) else origins
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise _unknown_keys(name, unknown, known, origins)
    hints = typing.get_type_hints(cls)  # resolves the string annotations of `from __future__`
    checked = {}
    for key, value in table.items():
        where = origins.of(f"{name}.{key}")
        try:
            checked[key] = _coerce(value, hints[key])
        except _WrongValue:
            raise ConfigError(f"{where}: {name}.{key}={value!r} is not an allowed value: use "
                              f"{_describe(hints[key])}") from None
        except _WrongType:
            raise ConfigError(f"{where}: {name}.{key}={value!r} ({type(value).__name__}) has the wrong type: "
                              f"expected {_describe(hints[key])}") from None
    try:
        return cls(**checked)
    except ValueError as exc:
        raise ConfigError(f"{origins.blame(name, table, str(exc))}: {exc}") from None


def _check_moe(table: dict[str, Any], dim: int, origins: Origins) -> None:
    """Build ``MoEConfig`` from ``[moe]`` once, turning its errors into config errors that
    name the key, who set it and the fix (an unknown key lists the valid ones)."""
    if "hidden_size" in table:
        raise ConfigError(f"{origins.of('moe.hidden_size')}: moe.hidden_size is set from model.dim; "
                          f"remove it from [moe]")
    try:
        MoEConfig(hidden_size=dim, **table)
    except TypeError:  # a keyword MoEConfig does not take, or a required one missing
        unknown = sorted(set(table) - set(_MOE_KEYS))
        if unknown:
            raise _unknown_keys("moe", unknown, _MOE_KEYS, origins) from None
        required = [f.name for f in dataclasses.fields(MoEConfig) if f.name != "hidden_size"
                    and f.default is dataclasses.MISSING and f.name not in table]
        raise ConfigError(f"{origins.default}: [moe] needs {', '.join(f'moe.{k}' for k in required)}: set "
                          f"them in the file or with --set moe.{required[0]}=...") from None
    except ValueError as exc:
        raise ConfigError(f"{origins.blame('moe', table, str(exc))}: {exc}") from None


def build_job_config(raw: dict[str, Any], source: Union[Origins, str] = "config") -> JobConfig:
    """Turn the nested dict of a TOML file (after overrides) into a validated ``JobConfig``;
    raise ``ConfigError`` naming the key, who set it (``source``: the file, or an
    :class:`Origins` that knows the command-line overrides) and the fix."""
    origins = Origins(source) if isinstance(source, str) else source
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(_SECTIONS), n=1, cutoff=0.6)
        keys = [f"{t}.{k}" for t in unknown for k in (raw[t] if isinstance(raw[t], dict) else [""])]
        hint = f"did you mean [{close[0]}]? " if close else ""
        raise ConfigError(f"{origins.of(keys[0])}: unknown table(s) {', '.join(f'[{t}]' for t in unknown)}; "
                          f"{hint}the tables are {', '.join(f'[{t}]' for t in _SECTIONS)}")
    kwargs: dict[str, Any] = {}
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{origins.of(name)}: [{name}] must be a table, got {table!r}; set its keys "
                              f"as {name}.KEY")
        kwargs[name] = dict(table) if name == "moe" else _section(name, _SECTIONS[name].default_factory,
                                                                    table, origins)
    job = JobConfig(**kwargs)
    object.__setattr__(job, "_origins", origins)  # not a field: for the trainer's checks (_origins_of)
    if "hf" in raw.get("model", {}) and not job.model.hf:
        raise ConfigError(f"{origins.of('model.hf')}: model.hf is empty: pass the Hugging Face model folder with "
                          "--hf-model DIR (or use a config of the built-in model, such as --config tiny)")
    if job.model.hf:
        _check_hf(raw, job, origins)
    else:
        _check_moe(job.moe, job.model.dim, origins)  # now, not after process-group setup
    _check_combined(job, origins)
    return job


HF_MOE_KEYS = ("dispatch", "backend", "all_gather_row_bound", "expert_precision")
"""The ``[moe]`` keys of an HF model (``model.hf``): how ep_moe runs its experts
(``ep_moe.integrations.transformers.ExpertsOptions``; ``expert_precision='fp8'``: e4m3
expert GEMMs, refused before the process group on a device without FP8); the rest of the
experts' shape comes from its config.json."""


def _check_hf(raw: dict[str, Any], job: JobConfig, origins: Origins) -> None:
    """``model.hf`` takes the model's shape from the folder's config.json: the built-in
    model's keys are an error (naming who set them), ``[moe]`` takes ``HF_MOE_KEYS`` only,
    and the data must be given (the embedded corpus is bytes, not the model's tokens)."""
    hf = f"model.hf={job.model.hf!r} ({origins.of('model.hf')})"
    others = sorted(set(raw.get("model", {})) - {"hf"})
    if others:
        raise ConfigError(f"{origins.of(f'model.{others[0]}')}: {', '.join(f'model.{k}' for k in others)} "
                          f"describe the built-in model, but {hf} takes its shape from the folder's config.json: "
                          "remove them (--config hf is a config for HF models)")
    moe_table = dict(job.moe)
    unknown = sorted(set(moe_table) - set(HF_MOE_KEYS))
    if unknown:
        raise ConfigError(f"{origins.of(f'moe.{unknown[0]}')}: {', '.join(f'moe.{k}' for k in unknown)} "
                          f"describe the built-in model's MoE layers, but {hf} takes its experts from the "
                          f"folder's config.json: remove them; [moe] takes {', '.join(HF_MOE_KEYS)} with model.hf")
    try:
        from ep_moe.integrations.transformers import ExpertsOptions
    except ImportError as exc:
        raise ConfigError(f"{hf} needs the transformers extra ({exc}): pip install 'ep-moe[transformers]'") from None
    _section("moe", ExpertsOptions, moe_table, origins)
    if job.checkpoint.format == "native":
        raise ConfigError(f"{origins.of('checkpoint.format')}: checkpoint.format='native' saves the built-in model's "
                          f"MoE layers; {hf} saves in checkpoint.format='dcp' (the default), which also loads at any "
                          "(EP, DP) layout")
    if not job.data.path:
        raise ConfigError(f"{hf} needs data in the model's tokens: pass --data (text, .jsonl, a folder or glob of "
                          "them, a dataset saved with save_to_disk, or a token file)")


def _check_combined(job: JobConfig, origins: Origins) -> None:
    """Values that are each valid but do not work together, named with who set them; the
    embedded corpus's size (``data.py`` checks only its floor); and, for the built-in
    model, the host memory the run needs (:func:`check_memory`, from the torchrun
    environment's world and local sizes; the trainer checks again, the device too, once it
    has resolved the device and counted an HF model)."""
    if not job.data.path:
        problem = RANGES["data.synthetic_bytes"].problem("data.synthetic_bytes", job.data.synthetic_bytes)
        if problem is not None:
            raise ConfigError(f"{origins.of('data.synthetic_bytes')}: data.synthetic_bytes={job.data.synthetic_bytes} "
                              f"{problem}")
    if job.parallel.fsdp:
        fsdp = f"parallel.fsdp=true ({origins.of('parallel.fsdp')})"
        if job.checkpoint.format == "native":
            raise ConfigError(f"{origins.of('checkpoint.format')}: checkpoint.format='native' cannot save the "
                              f"sharded weights of {fsdp}: its files hold replicated dense weights. Use "
                              "checkpoint.format='dcp' (the default), which loads with or without FSDP at any "
                              "(EP, DP) layout, or set parallel.fsdp=false")
        if job.training.cuda_graphs == "on":
            raise ConfigError(f"{origins.of('training.cuda_graphs')}: training.cuda_graphs='on' does not work with "
                              f"{fsdp}: FSDP gathers each block's weights before it runs and frees them after, "
                              "outside what a CUDA graph can capture; set training.cuda_graphs='auto' (off under "
                              "FSDP) or 'off', or set parallel.fsdp=false")
    if not job.model.hf:  # an HF model's shape is in its config.json: the trainer counts it
        check_memory(job, world_size=_env_int("WORLD_SIZE"), ranks_per_host=_env_int("LOCAL_WORLD_SIZE"),
                     on_host=job.training.device == "cpu", origins=origins)


def _env_int(name: str) -> int:
    """A positive size torchrun sets (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), 1 without it."""
    try:
        return max(1, int(os.environ.get(name, "1")))
    except ValueError:
        return 1


# --- memory ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSize:
    """The parameters of a model whose shape is not in the config (an HF model, counted on
    the meta device by ``hf_model.inspect_hf_model``), as the memory check needs them."""

    experts: int
    """Parameters of all experts of all MoE layers, before the EP group splits them."""
    dense: int
    """Every other parameter (tied ones once)."""
    vocab_size: int
    """Columns of the logits."""
    built_whole: bool = False
    """Each rank builds the whole model, every expert, before it keeps its own: an HF folder
    without weights, initialised from its config (with weights each rank reads only its own)."""


BUILD, STEP, LOSS = "building the model", "the optimizer step", "the loss"
"""The phases of a rank's run whose peaks :func:`memory_needs` bounds from below."""


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one rank holds at least during one phase of its run (:data:`BUILD`,
    :data:`STEP` or :data:`LOSS`)."""

    phase: str
    parts: dict[str, int]
    """What is alive then: parameters, gradients, optimizer (AdamW's two states), logits,
    rotary tables."""
    groups: dict[str, int]
    """The same bytes by what the config sets (each parameter group with its gradients and
    optimizer state, the logits; the rotary tables left out): what an error blames."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _parameter_groups(job: JobConfig, world_size: int, model: Optional[ModelSize] = None, *,
                      sharded: bool = True, whole: bool = False) -> dict[str, int]:
    """Parameters of one rank by group: the experts split over the EP group
    (``parallel.ep_size``, 0: the world; ``whole``: not yet split) and, under
    ``parallel.fsdp`` once ``sharded``, the experts sharded over their ``edp`` replicas (the
    world at EP=1) and the rest over the world, as ``ep_moe.parallel.apply_fsdp`` shards
    them. The built-in model's groups come from its config (embedding and output head,
    attention, routers, experts); an HF model's (``model``) are its experts and the rest."""
    ep = job.parallel.ep_size or world_size
    fsdp = sharded and job.parallel.fsdp
    dense_shard = world_size if fsdp else 1
    expert_shard = max(1, world_size // ep) if fsdp else 1
    if model is not None:
        experts = model.experts if whole else model.experts // ep
        return {"experts": experts // expert_shard, "dense weights": model.dense // dense_shard}
    m, moe = job.model, job.moe_config()
    dim, head = m.dim, m.head_size
    q, kv = m.n_heads * head, m.kv_heads * head
    attention = m.n_layers * (2 * dim * q + 2 * dim * kv + 2 * dim + (2 * head if m.qk_norm else 0)) + dim
    two = moe.num_linears == 2
    per_expert = (moe.gate_up_size * dim if two else 0) + dim * moe.intermediate_size
    if moe.mlp_bias:
        per_expert += (moe.gate_up_size if two else 0) + dim
    shared = 0
    if moe.num_shared_experts:
        inter = moe.shared_intermediate_size or moe.num_shared_experts * moe.intermediate_size
        up = (2 * inter if moe.gated else inter) if two else 0
        shared = (up * dim + (inter if two else dim) * dim +
                  ((up + dim) if moe.mlp_bias else 0)) * m.n_layers
    return {
        "embedding and output head": m.vocab_size * dim * (1 if m.tie_embeddings else 2) // dense_shard,
        "attention": (attention + shared) // dense_shard,
        "routers": m.n_layers * moe.num_experts * dim // dense_shard,
        "experts": m.n_layers * max(1, moe.num_experts // ep) * per_expert // expert_shard,
    }


def _need(phase: str, groups: dict[str, int], width: int, rotary: int, logits: int = 0, *,
          gradients: bool = False, optimizer: bool = False) -> MemoryNeed:
    """The :class:`MemoryNeed` of parameters ``groups`` at ``width`` bytes each (with their
    gradients, their two AdamW states), plus ``rotary`` and ``logits`` bytes."""
    params = sum(groups.values())
    per_param = width * (1 + gradients + 2 * optimizer)
    parts = {"parameters": params * width}
    if gradients:
        parts["gradients"] = params * width
    if optimizer:
        parts["optimizer"] = 2 * params * width
    blamed = {name: count * per_param for name, count in groups.items()}
    if logits:
        parts["logits"] = blamed["logits"] = logits
    if rotary:
        parts["rotary tables"] = rotary
    return MemoryNeed(phase, parts, blamed)


def memory_needs(job: JobConfig, world_size: int = 1, *, on_host: bool = True,
                 where: Literal["host", "device"] = "device", model: Optional[ModelSize] = None) -> list[MemoryNeed]:
    """What one rank holds at least in each phase of its run, in its device's memory or the
    host's (``where``); ``on_host``: it trains on the CPU, whose memory is the host's. A
    parameter takes 2 bytes under ``training.param_dtype='bfloat16'`` (pure bf16), else 4,
    and so do its gradient and each of its two AdamW states. ``model``: an HF model's size
    (None: the built-in model's, from the config).

    - :data:`BUILD`: the built-in model is built in float32 on the host, then moved to its
      device in ``training.param_dtype`` (a CPU rank casts it in place); an HF model is read
      or built on its device in that dtype, every expert first where the folder holds no
      weights (``ModelSize.built_whole``). Unsharded either way: FSDP shards the model after.
    - :data:`STEP`: parameters, gradients and AdamW state, split and sharded as they train.
    - :data:`LOSS`: parameters, AdamW state (held from the second step on, or from a resumed
      checkpoint) and the logits as the loss keeps them: it upcasts them, so float32
      log-probabilities and their gradient, 8 bytes per entry of batch x seq_len x vocabulary
      whatever ``training.dtype``.

    Activations, temporaries, the CUDA context and the allocator's slack are left out: each
    total is a floor of its phase's peak. The host of a GPU rank holds only the built-in
    model's float32 build (an HF model goes to the device as it is read or built)."""
    width = 2 if job.training.param_dtype == "bfloat16" else 4
    rotary = 0 if model is not None else job.model.max_seq_len * job.model.head_size  # cos and sin, head_dim/2 each
    if where == "host" and not on_host:
        if model is not None:
            return []
        return [_need(BUILD, _parameter_groups(job, world_size, sharded=False), 4, 4 * rotary)]
    built_width = 4 if on_host and model is None else width
    whole = model is not None and model.built_whole
    built = _parameter_groups(job, world_size, model, sharded=False, whole=whole)
    trained = _parameter_groups(job, world_size, model)
    tcfg = job.training
    logits = 8 * tcfg.batch_size * tcfg.seq_len * (model.vocab_size if model is not None else job.model.vocab_size)
    held = tcfg.steps > 1 or bool(job.checkpoint.resume)
    return [
        _need(BUILD, built, built_width, built_width * rotary),
        _need(STEP, trained, width, width * rotary, gradients=True, optimizer=True),
        _need(LOSS, trained, width, width * rotary, logits, optimizer=held),
    ]


def memory_estimate(job: JobConfig, world_size: int = 1, model: Optional[ModelSize] = None) -> dict[str, int]:
    """Bytes of one rank's training state on its device by part: its parameters, their
    gradients and AdamW's two states (``training.param_dtype``), the logits as the loss
    keeps them, and the built-in model's rotary tables (:func:`memory_needs`; not all alive
    at once: :func:`estimate_memory_bytes` is the peak). A pure function of the config, the
    world size and an HF model's size."""
    needs = {need.phase: need for need in memory_needs(job, world_size, on_host=False, model=model)}
    return {**needs[STEP].parts, "logits": needs[LOSS].parts["logits"]}


def estimate_memory_bytes(job: JobConfig, world_size: int = 1, model: Optional[ModelSize] = None, *,
                          on_host: bool = True) -> int:
    """What one rank needs at least on its device (the host's memory where ``on_host``): the
    largest total of :func:`memory_needs`."""
    return max(need.total for need in memory_needs(job, world_size, on_host=on_host, model=model))


def host_build_bytes(job: JobConfig, world_size: int = 1) -> int:
    """Bytes of host memory each rank of the built-in model needs whatever its device: the
    model is built in float32 on the host (before it moves to its device, and before FSDP
    shards it)."""
    return memory_needs(job, world_size, on_host=False, where="host")[0].total


def host_memory_bytes() -> Optional[int]:
    """This host's physical memory, None where the OS does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def device_memory_bytes(device: Union[torch.device, str]) -> Optional[int]:
    """The total memory of the CUDA ``device`` (``torch.cuda.get_device_properties``); None
    for another device, or where no GPU is visible. Allocates nothing on the device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def _size_text(num_bytes: float) -> str:
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes / 2**20:.2f} MiB"


_EXPERTS_FIX = "split the experts over more ranks (parallel.ep_size, the world size)"
_GROUP_KEYS = {
    "embedding and output head": (("model.vocab_size", "model.dim"),
                                  "lower model.vocab_size or model.dim (model.tie_embeddings=true halves it)"),
    "attention": (("model.dim", "model.n_layers", "model.n_heads", "model.head_dim"),
                  "lower model.dim, model.n_layers or model.n_heads"),
    "routers": (("moe.num_experts", "model.dim", "model.n_layers"), "lower moe.num_experts"),
    "experts": (("moe.num_experts", "moe.intermediate_size", "model.dim", "model.n_layers", "parallel.ep_size"),
                f"lower moe.num_experts or moe.intermediate_size, or {_EXPERTS_FIX}"),
    "logits": (("training.batch_size", "training.seq_len", "model.vocab_size"),
               "lower training.batch_size or training.seq_len"),
}
"""The built-in model's parts: the keys that size each, and the fix."""
_HF_GROUP_KEYS = {
    "experts": (("model.hf", "parallel.ep_size"), _EXPERTS_FIX),
    "dense weights": (("model.hf",), ""),
    "logits": (("training.batch_size", "training.seq_len", "model.hf"),
               "lower training.batch_size or training.seq_len"),
}
"""An HF model's parts (``model.hf`` sizes the model): the keys that size each, and the fix."""


def _blame(job: JobConfig, group: str, phase: str, model: Optional[ModelSize]) -> tuple[tuple[str, ...], str]:
    """The keys that size ``group`` (the largest of ``phase``'s need) and the fix."""
    keys, fix = (_HF_GROUP_KEYS if model is not None else _GROUP_KEYS)[group]
    if group == "logits":
        return keys, fix
    fixes = [fix] if fix else []
    if phase == BUILD:
        if model is not None and model.built_whole and group == "experts":
            fixes = ["save the model's weights in the model.hf folder (save_pretrained): each rank then reads "
                     "only its own experts"]
        elif model is not None and group == "dense weights":
            fixes = ["train a smaller model: every rank builds the dense weights whole before FSDP shards them"]
        return keys, ", or ".join(fixes)
    fixes.append("shard them over more ranks (the world size)" if job.parallel.fsdp else
                 "shard them over the ranks with parallel.fsdp=true")
    if job.training.param_dtype == "float32":
        fixes.append("keep parameters, gradients and AdamW state in bf16 (training.param_dtype='bfloat16')")
    return (*keys, "parallel.fsdp"), ", or ".join(fixes)


def _refuse_past(job: JobConfig, needs: list[MemoryNeed], capacity: int, origins: Origins,
                 model: Optional[ModelSize], world_size: int, *, ranks: int = 1, device: Optional[str] = None,
                 host_of_gpu_rank: bool = False) -> None:
    """A ``ConfigError`` when the largest of ``needs``, times ``ranks``, exceeds ``capacity``
    (the host's physical memory, or the total memory of ``device``)."""
    if not needs:
        return
    peak = max(needs, key=lambda need: need.total)
    need = peak.total * ranks
    if need <= capacity:
        return
    largest = max(peak.groups, key=peak.groups.get)
    keys, fix = _blame(job, largest, peak.phase, model)
    named = sorted(keys, key=lambda key: not origins.of(key).startswith("--"))
    if peak.phase != BUILD:
        parts = ", ".join(f"{name} {_size_text(size)}" for name, size in peak.parts.items())
        what = f"the training state of one rank at {peak.phase} ({parts}) needs"
    elif host_of_gpu_rank:
        what = "the float32 parameters each rank builds on the host before moving them to its device need"
    else:
        how = (["every expert, before it keeps its own (model.hf holds no weights)"] if model is not None
               and model.built_whole else []) + (["unsharded, before FSDP shards them"] if job.parallel.fsdp else [])
        what = "building the model, the parameters of one rank" + (f" ({'; '.join(how)})" if how else "") + " need"
    if device is None:
        where = "host memory" + (f" per rank, x {ranks} ranks on this host = {_size_text(need)}" if ranks > 1 else "")
        limit = f"this host's {_size_text(capacity)} of physical memory"
    else:
        where, limit = f"memory on {device}", f"{device}'s {_size_text(capacity)} of total memory"
    values = []
    for key in keys:
        value = _value_of(job, key)
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        if key == "parallel.ep_size" and value == 0:
            shown += f" (the world size, {world_size})"
        values.append(f"{key}={shown}")
    raise ConfigError(f"{origins.of(named[0])}: {what} about {_size_text(peak.total)} of {where}, more than {limit}; "
                      f"the {largest} ({', '.join(values)}) take "
                      f"{100 * peak.groups[largest] / max(1, sum(peak.groups.values())):.0f}% of it: {fix}")


def check_memory(job: JobConfig, *, world_size: int = 1, ranks_per_host: int = 1, on_host: bool = True,
                 host_bytes: Optional[int] = None, device: Union[torch.device, str, None] = None,
                 device_bytes: Optional[int] = None, model: Optional[ModelSize] = None,
                 origins: Optional[Origins] = None) -> None:
    """Raise ``ConfigError`` when the run obviously cannot fit: ``ranks_per_host`` ranks each
    needing the peak of :func:`memory_needs` on the host (``on_host``: they train on the
    CPU) past its physical memory (``host_bytes``, default :func:`host_memory_bytes`), or,
    for a rank training on a GPU (not ``on_host``) whose ``device`` is known, the peak on the
    device past its total memory (``device_bytes``, default :func:`device_memory_bytes`).
    No check where a size is unknown. Total memory, not free: the needs are floors, so what
    is refused cannot fit, and the CUDA context and the allocator's slack stay the margin.
    ``model``: an HF model's size (None: the built-in model's). The error names the largest
    part of the peak, its keys and who set them (``origins``, default what
    :func:`build_job_config` recorded), and the fix. The config is checked before its device
    is known (``on_host``: ``training.device='cpu'``), and the trainer checks again with the
    device it resolved and an HF model's size, before building anything on the device."""
    origins = origins or _origins_of(job)
    host_bytes = host_memory_bytes() if host_bytes is None else host_bytes
    if host_bytes is not None:
        _refuse_past(job, memory_needs(job, world_size, on_host=on_host, where="host", model=model), host_bytes,
                     origins, model, world_size, ranks=ranks_per_host, host_of_gpu_rank=not on_host)
    if on_host or (device is None and device_bytes is None):
        return
    device_bytes = device_memory_bytes(device) if device_bytes is None else device_bytes
    if device_bytes is not None:
        _refuse_past(job, memory_needs(job, world_size, on_host=False, where="device", model=model), device_bytes,
                     origins, model, world_size, device=str(device) if device is not None else "the device")


def _origins_of(job: JobConfig) -> Origins:
    """Who set ``job``'s values, as :func:`build_job_config` recorded them (the file when
    ``job`` was built otherwise)."""
    return getattr(job, "_origins", None) or Origins("config")


def _value_of(job: JobConfig, key: str) -> Any:
    section, _, name = key.partition(".")
    table = getattr(job, section)
    return table.get(name, "?") if isinstance(table, dict) else getattr(table, name)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict[str, Any], assignment: str, origins: Optional[Origins] = None) -> None:
    """Apply one ``SECTION.KEY=VALUE`` to the nested dict in place (and note in
    ``origins`` that ``--set`` set it)."""
    key, sep, value = assignment.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name or not section:
        raise ConfigError(f"--set {assignment!r}: expected SECTION.KEY=VALUE, e.g. --set moe.num_experts=16")
    table = raw.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"--set {assignment!r}: {section} is not a table in the config file")
    table[name] = _parse_value(value.strip())
    if origins is not None:
        origins.set(f"{section}.{name}", f"--set {assignment.strip()}")


def _read_toml(path: Path) -> dict[str, Any]:
    """The config file as a nested dict; a file that is not TOML names its line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not a valid TOML file ({exc}); fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot be read ({exc})") from None


def parse_args(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> JobConfig:
    """Read ``--config`` (default: the tiny preset), apply the overrides, validate.

    Raises ``ConfigError`` (before anything is built) for an unknown key, a wrong type or
    value, naming who set it: the file, or the command-line option."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help=f"a TOML file, or a preset: {', '.join(preset_names('train'))} (default: "
                             f"{DEFAULT_CONFIG}, or {DEFAULT_HF_CONFIG} with --hf-model)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable")
    shorthands = {
        "--steps": ("training.steps", int),
        "--ep-size": ("parallel.ep_size", int),
        "--hf-model": ("model.hf", str),
        "--data": ("data.path", str),
        "--eval-data": ("data.eval_path", str),
        "--export-hf": ("checkpoint.export_hf", str),
        "--resume": ("checkpoint.resume", str),
        "--checkpoint-dir": ("checkpoint.dir", str),
        "--metrics-file": ("logging.metrics_file", str),
        "--tensorboard": ("logging.tensorboard_dir", str),
    }
    for flag, (key, typ) in shorthands.items():
        parser.add_argument(flag, type=typ, default=None, help=f"same as --set {key}=...")
    args = parser.parse_args(argv)
    if args.config is None:
        args.config = DEFAULT_HF_CONFIG if args.hf_model else DEFAULT_CONFIG
    try:
        config_file = resolve_preset("train", args.config, f"--config {args.config}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    raw = _read_toml(config_file)
    origins = Origins(str(config_file))
    for assignment in args.overrides:
        apply_override(raw, assignment, origins)
    for flag, (key, _) in shorthands.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            section, name = key.split(".")
            raw.setdefault(section, {})[name] = value
            origins.set(key, f"{flag} {value}")
    return build_job_config(raw, origins)
