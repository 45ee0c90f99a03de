"""The training loop behind ``ep_moe/train/train.py``: set up ranks, build, train, log, checkpoint.

Parallelism: every rank is a data-parallel rank with its own batches; the experts of each
MoE layer are split over EP groups of ``ep_size`` consecutive ranks. One mesh
(``ep_moe.parallel.init_parallel_mesh``, built once) gives every group: EP for the layers,
``edp`` (the replicas of a rank's experts) and ``dp_shard`` (all ranks). Two ways to hold the
rest (``parallel.fsdp``):

- replicated (the default): dense weights on every rank; after ``backward``,
  ``ep_moe.parallel.sync_gradients`` sums dense gradients over all ranks and expert gradients
  over the expert-data-parallel group, and the clip's multiply divides them by the number of
  ranks;
- FSDP2: ``ep_moe.parallel.apply_fsdp`` shards dense weights over all ranks and each rank's
  experts over its ``edp`` ranks, before the optimizer is built, and the backward's
  reduce-scatters leave the gradients averaged (no ``sync_gradients``).
  Under ``training.dtype = 'bfloat16'`` FSDP's ``MixedPrecisionPolicy`` (bf16 weights in
  compute, fp32 reduction) replaces autocast, as in torchtitan.

Every rank seeds alike before building the model, so replicas start equal (the layer draws
experts per global id, so the weights do not depend on the EP size or on FSDP either).

Exact resume: batches are a pure function of (seed, step, rank), and checkpoints hold
weights, AdamW state, the data position and RNG states, so a resumed run logs the same
losses as an uninterrupted one (bit for bit on CPU). A run resumed at or past
``training.steps`` trains nothing and says so in a warning (naming the step and
``training.steps``: raise ``--steps`` to go on); it is no error (exit status 0: a finished
job resubmitted unchanged is fine), and an HF model is still exported when
``checkpoint.export_hf`` asks.

Output paths are checked before step 1, in seconds (:func:`check_output_path`): the
checkpoint directory, which every rank writes, on every rank before the process group
starts; the metrics file, the TensorBoard folder and the HF export, which rank 0 alone
writes, by rank 0 once the process group is up, its verdict broadcast
(``checkpoint.on_rank0``) so that every rank fails alike. Rank 0 then locks the checkpoint
directory for the run (``checkpoint.lock_checkpoint_dir``: a second trainer on it refuses
to start), and, once the starting step is known, refuses entries it did not write that
stand where this run saves (a stray file ``step_N``). Memory-mapped data is checked before
each epoch (``data.TokenBatches``), every rank agreeing on the outcome, so a truncated file
stops the run naming it, not with SIGBUS.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ep_moe.kernels.fp8 import fp8_supported
from ep_moe.layer import moe_layers, update_expert_biases
from ep_moe.parallel import (
    ParallelMesh,
    apply_fsdp,
    init_parallel_mesh,
    is_expert_param,
    sync_gradients,
)
from ep_moe.train.checkpoint import (
    DirLock,
    Layout,
    complete_checkpoints,
    entries_in_the_way,
    lock_checkpoint_dir,
    newer_checkpoints,
    on_rank0,
    resume,
    save_checkpoint,
)
from ep_moe.train.config import JobConfig, ModelSize, TrainingConfig, check_memory
from ep_moe.train.data import TokenBatches, TokenStreams, build_token_streams, is_token_data, load_tokenizer
from ep_moe.train.errors import ConfigError, DataError
from ep_moe.train.graphs import GraphedBlocks, graphs_unsupported
from ep_moe.train.hf_model import HFModelSpec, build_hf_model, inspect_hf_model
from ep_moe.train.model import MoETransformer
from ep_moe.train.report import RunSummary, config_lines

logger = logging.getLogger("ep_moe.train")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job and the groups it belongs to."""

    rank: int
    world_size: int
    device: torch.device
    ep_size: int
    ep_rank: int
    ep_group: Optional[ProcessGroup]
    """The layer's all-to-all group; None at EP=1."""
    edp_group: Optional[ProcessGroup]
    """Replicas of this rank's experts; None when there are none."""
    mesh: ParallelMesh
    """The one mesh every group above comes from (and FSDP's axes under ``parallel.fsdp``)."""
    fsdp: bool = False
    """Whether the model is sharded with FSDP2 (``parallel.fsdp``)."""


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size as torchrun sets them (0 and 1 without it),
    known before any process group exists."""
    if "RANK" not in os.environ:
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def check_parallel(job: JobConfig, world_size: int, num_experts: int) -> int:
    """The EP size ``job`` asks for on ``world_size`` ranks; ``ConfigError`` unless it
    divides the world size and ``num_experts`` (of each MoE layer), or when
    ``training.device='cuda'`` and no GPU is visible. Needs no process group, so every rank
    fails alike before one."""
    if job.training.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device='cuda' but no CUDA GPU is visible; use 'auto' or 'cpu'")
    ep_size = job.parallel.ep_size or world_size
    experts = f"the model's {num_experts} experts (model.hf)" if job.model.hf else f"moe.num_experts ({num_experts})"
    if world_size % ep_size or num_experts % ep_size:
        raise ConfigError(f"parallel.ep_size={ep_size} must divide the world size ({world_size}) and "
                          f"{experts}; pass --ep-size with a common divisor")
    return ep_size


def check_expert_precision(job: JobConfig, device: torch.device) -> None:
    """``ConfigError`` when ``moe.expert_precision='fp8'`` asks for FP8 experts that ``device``
    cannot run (:func:`ep_moe.kernels.fp8.fp8_supported`), the built-in model's or an HF
    model's (``model.hf``, whose ``[moe]`` takes the key too): one line on every rank before
    the process group, not a traceback from the layer's construction or the first step."""
    if job.moe.get("expert_precision") != "fp8":
        return
    ok, why = fp8_supported(device)
    if not ok:
        raise ConfigError(f"moe.expert_precision='fp8': {why}; or train the experts in bf16 "
                          f"(moe.expert_precision='bf16', the default)")


def resolve_device(job: JobConfig) -> torch.device:
    """The device this rank trains on: ``cuda:LOCAL_RANK`` under ``training.device='cuda'``,
    or ``'auto'`` with a GPU visible; else the CPU. Touches no device."""
    if job.training.device == "cuda" or (job.training.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(job: JobConfig, num_experts: int, model_size: Optional[ModelSize] = None) -> Ranks:
    """Start torch.distributed (NCCL on CUDA, gloo on CPU) and build the EP groups (under
    ``parallel.fsdp``: the ``ParallelMesh`` they come from).

    Under torchrun the rendezvous comes from its environment; run as a plain script, the
    process forms a group of one, so the same code path serves both. The config is checked
    (:func:`check_parallel`), then the memory the run needs on the host and the device
    (``config.check_memory``; ``model_size``: an HF model's, None for the built-in model),
    before the process group starts and before anything is allocated on the device.
    """
    world = rank_and_world()[1]
    ep_size = check_parallel(job, world, num_experts)
    device = resolve_device(job)
    check_expert_precision(job, device)
    check_memory(job, world_size=world, ranks_per_host=max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
                 on_host=device.type == "cpu", device=device, model=model_size)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
        # TF32 tensor cores for fp32 matmuls, dense and grouped (the Triton kernels read this).
        torch.set_float32_matmul_precision("high")
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_parallel_mesh(ep_size, num_experts=num_experts, device_type=device.type)
    groups = mesh.groups()
    return Ranks(rank=rank, world_size=world, device=device, ep_size=ep_size, ep_rank=rank % ep_size,
                 ep_group=groups.ep_group if ep_size > 1 else None,
                 edp_group=groups.edp_group if groups.edp_size > 1 else None, mesh=mesh, fsdp=job.parallel.fsdp)


def destroy_distributed() -> None:
    """Destroy the process group once nothing built on it is left: call after dropping the
    trainer. Its model, mesh and groups sit in reference cycles, which only the collector
    frees; a gloo group that outlives ``destroy_process_group`` is torn down at interpreter
    exit, which can abort the process ("terminate called without an active exception")."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def mixed_precision_policy(dtype: str, param_dtype: str = "float32"):
    """FSDP's ``MixedPrecisionPolicy`` for ``training.dtype``: bf16 weights in the forward
    and backward with gradients reduced in fp32 (torchtitan's), or None (fp32 throughout, or
    pure bf16 parameters under ``param_dtype='bfloat16'``, which need no cast).
    Forward inputs are not cast: the blocks' activations are bf16 already (from the bf16
    embedding), and the rotary tables stay fp32, as under autocast."""
    if dtype != "bfloat16" or param_dtype == "bfloat16":
        return None
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def build_optimizer(model: torch.nn.Module, tcfg: TrainingConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norm weights) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tcfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=tcfg.betas, fused=device.type == "cuda")


def _all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean over all ranks (gloo has no AVG op, so SUM then divide)."""
    dist.all_reduce(values)
    return values / dist.get_world_size()


def clip_gradients(model: torch.nn.Module, max_norm: float, ep_group: Optional[ProcessGroup],
                   loss: torch.Tensor, grad_scale: float = 1.0) -> tuple[torch.Tensor, bool]:
    """Global gradient norm over dense weights and every expert shard, after the gradient
    sync; clip to ``max_norm`` (0: no clipping). Dense gradients are equal on every rank;
    expert norms are summed (squared) over ``ep_group``, whose ranks hold disjoint experts.

    ``grad_scale``: the gradients are ``1 / grad_scale`` times what is meant (summed over
    the data-parallel ranks, ``sync_gradients(average=False)``): the norm is taken of the
    scaled gradients and the scale is applied in the clip's multiply, one pass over them.

    Also returns whether this step is finite on every rank: the grad norm is global
    already, and this rank's ``loss`` (a 0-dim tensor) is folded in through one
    one-element all-reduce over all ranks, so every rank reaches the same verdict (a NaN
    on one rank stops or skips the step everywhere, no rank is left waiting). One host
    read per step; gradients are left unscaled and unclipped when the step is not finite.

    A model sharded with FSDP (DTensor gradients, ``ep_moe.parallel.apply_fsdp``): every
    element of every gradient lives on exactly one rank (dense ones sharded over all ranks,
    experts over ``edp`` within disjoint EP shards), so the squared norms of the local shards
    summed over all ranks are the global squared norm, each gradient counted once; that sum
    and the loss check are one two-element all-reduce. ``ep_group`` is not used then."""
    params = [p for p in model.parameters() if p.grad is not None]
    if any(isinstance(p.grad, DTensor) for p in params):
        return _clip_sharded_gradients(params, max_norm, loss, grad_scale)
    dense = torch.nn.utils.get_total_norm([p.grad for p in params if not is_expert_param(p)])
    expert_sq = torch.nn.utils.get_total_norm([p.grad for p in params if is_expert_param(p)]).square()
    if ep_group is not None:
        dist.all_reduce(expert_sq, group=ep_group)
    total = (dense.square() + expert_sq).sqrt() * grad_scale
    bad = torch.logical_not(torch.isfinite(loss.detach().float()) & torch.isfinite(total))
    bad = bad.to(total.dtype).reshape(1)
    dist.all_reduce(bad)  # > 0 when any rank saw a non-finite loss or norm
    finite = not bool(bad)  # the one host read
    if finite and (max_norm > 0 or grad_scale != 1.0):
        factor = torch.full_like(total, grad_scale)
        if max_norm > 0:  # as torch.nn.utils.clip_grads_with_norm_
            factor = factor * (max_norm / (total + 1e-6)).clamp(max=1.0)
        _scale_gradients([p.grad for p in params], factor)
    return total, finite


def _clip_sharded_gradients(params: list[torch.nn.Parameter], max_norm: float, loss: torch.Tensor,
                            grad_scale: float) -> tuple[torch.Tensor, bool]:
    """:func:`clip_gradients` of a model sharded with FSDP: the local shards' squared norms and
    this rank's loss verdict summed over all ranks in one all-reduce, then the clip applied
    to the local shards."""
    plain = sum(not isinstance(p.grad, DTensor) for p in params)
    if plain:
        raise ValueError(f"clip_gradients: {plain} of {len(params)} gradients are plain tensors in a model "
                         "sharded with FSDP (DTensor gradients); shard every parameter (apply_fsdp shards the "
                         "whole model) so that each is counted once")
    local = [p.grad.to_local() for p in params]
    sq = torch.nn.utils.get_total_norm(local).square().float()
    bad = torch.logical_not(torch.isfinite(loss.detach().float())).to(sq.dtype).to(sq.device)
    both = torch.stack([sq, bad])
    dist.all_reduce(both)  # [global squared norm, ranks with a non-finite loss]
    total = both[0].sqrt() * grad_scale
    finite = bool(torch.isfinite(total) & (both[1] == 0))  # the one host read
    if finite and (max_norm > 0 or grad_scale != 1.0):
        factor = torch.full_like(total, grad_scale)
        if max_norm > 0:
            factor = factor * (max_norm / (total + 1e-6)).clamp(max=1.0)
        _scale_gradients(local, factor)
    return total, finite


def _scale_gradients(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by the 0-dim ``factor`` (one multi-tensor kernel per device
    and dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, factor.to(device))


_FLAGS = {"checkpoint.dir": "--checkpoint-dir", "logging.metrics_file": "--metrics-file",
          "logging.tensorboard_dir": "--tensorboard", "checkpoint.export_hf": "--export-hf"}
_FOLDERS = {"checkpoint.dir": "a directory for the checkpoints", "logging.tensorboard_dir": "a directory",
            "checkpoint.export_hf": "a folder for the HF export"}


def check_output_path(option: str, value: str, kind: Literal["dir", "file"], probe: bool = False,
                      shown: str = "") -> None:
    """Raise a ``ConfigError`` naming ``option`` (a key of ``_FLAGS``) and the fix unless
    ``value`` is a ``kind`` ("dir" or "file") that can be written, or can be created: an
    existing path of the other kind, a missing one under a file, or one that ``os.access``
    says cannot be written (its nearest existing folder, for a missing one). ``probe``
    (the checkpoint directory): also create the directory and a temporary file in it,
    which catches what ``os.access`` does not see (a read-only mount for root).
    ``shown``: the option's value as messages show it, when ``value`` is derived from it."""
    path, flag = Path(value), _FLAGS[option]
    shown = shown or repr(value)
    fix = f"pass {_FOLDERS[option]} ({flag}; created if missing)" if kind == "dir" else f"pass a file path ({flag})"
    if option == "checkpoint.export_hf":
        fix += ", or '' for no export"
    if path.exists():
        if kind == "dir" and not path.is_dir():
            raise ConfigError(f"{option}={shown} is a file, not a directory: {fix}")
        if kind == "file" and path.is_dir():
            raise ConfigError(f"{option}={shown} is a directory: pass a file path ({flag}), e.g. "
                              f"{str(path / 'metrics.jsonl')!r}")
        if not os.access(path, os.W_OK | (os.X_OK if kind == "dir" else 0)):
            noun = "directory" if kind == "dir" else "file"
            raise ConfigError(f"{option}={shown} cannot be written (permission denied): pass a writable {noun} "
                              f"({flag}), or fix its permissions")
    else:
        folder = path.absolute().parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise ConfigError(f"{option}={shown} cannot be created: {str(folder)!r} is a file, not a directory: pass "
                              f"another path ({flag})")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{option}={shown} cannot be created: {str(folder)!r} is not writable (permission "
                              f"denied): pass another path ({flag}), or fix its permissions")
    if probe:
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=".write-test-", dir=path)
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            raise ConfigError(f"{option}={shown} cannot be written ({exc.strerror}): pass a writable directory "
                              f"({flag}), or fix its permissions") from None


def writes_checkpoint_dir(job: JobConfig) -> bool:
    """Whether the run writes ``checkpoint.dir``: it saves (``checkpoint.interval >= 0``),
    may finish an interrupted save there (``resume='latest'``), or exports into it."""
    ccfg = job.checkpoint
    return ccfg.interval >= 0 or ccfg.resume == "latest" or bool(job.model.hf and ccfg.export_hf == "auto")


def export_path(job: JobConfig) -> str:
    """Where an HF model is exported (``checkpoint.export_hf``; ``auto``: ``{dir}/hf``)."""
    ccfg = job.checkpoint
    return str(Path(ccfg.dir) / "hf") if ccfg.export_hf == "auto" else ccfg.export_hf


def tensorboard_writer_class() -> type:
    """``torch.utils.tensorboard.SummaryWriter``, or a ``ConfigError`` naming the install
    command when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("--tensorboard (logging.tensorboard_dir) needs the tensorboard package, which is not "
                          "installed: pip install tensorboard") from None
    return SummaryWriter


class Trainer:
    """Owns the model, optimizer, data and checkpoints of one run; ``train()`` runs it."""

    def __init__(self, job: JobConfig) -> None:
        """Build everything; the config, the data and the checkpoint directory are checked
        before the process group starts, so a bad value or file fails alike on every rank,
        with no collective; rank 0's own output paths and the directory's lock right after,
        its verdict broadcast (every rank fails alike)."""
        self.job = job
        tcfg = job.training
        rank, world = rank_and_world()
        self.hf_spec: Optional[HFModelSpec] = inspect_hf_model(job.model.hf) if job.model.hf else None
        """The HF model folder's config (``model.hf``), or None for the built-in model."""
        streams = self._token_streams()
        self.byte_level = streams.byte_level
        dp = dict(seq_len=tcfg.seq_len, batch_size=tcfg.batch_size, dp_rank=rank, dp_size=world,
                  files=streams.mapped)
        held_out = f"data.val_fraction={job.data.val_fraction} held out"
        self.batches = TokenBatches(streams.train, seed=tcfg.seed, split=f"training split ({held_out})", **dp)
        self.val_batches = None  # evaluation off (logging.eval_interval=0): no validation split needed
        if job.logging.eval_interval:
            self.val_batches = TokenBatches(
                streams.val, seed=tcfg.seed + 1, split=f"validation split ({held_out})",
                hint="raise data.val_fraction, set logging.eval_interval=0 (no evaluation)", **dp)
        writer_class = tensorboard_writer_class() if job.logging.tensorboard_dir else None
        if writes_checkpoint_dir(job):  # every rank writes it: each checks, before the process group
            check_output_path("checkpoint.dir", job.checkpoint.dir, "dir", probe=True)
        num_experts = self.hf_spec.num_experts if self.hf_spec else job.moe_config().num_experts
        self.ranks = init_distributed(job, num_experts, self.hf_spec.size if self.hf_spec else None)
        self.dir_lock: Optional[DirLock] = None
        """Rank 0's lock of ``checkpoint.dir`` for the run (None elsewhere, or when not written)."""
        self.metrics = None
        self.tensorboard = None  # rank 0's SummaryWriter; a resumed run drops the events past its step
        self.summary: Optional[RunSummary] = None
        """What the end-of-run summary reports (set by :meth:`train`)."""
        try:
            self.dir_lock = on_rank0(self.ranks.rank, self._claim_outputs, "checking the output paths")
            self._build(writer_class)
        except BaseException:
            self.close()  # the lock too: a failed start leaves none behind
            raise

    def _build(self, writer_class: Optional[type]) -> None:
        """The rest of ``__init__``, once the process group is up and the outputs are claimed."""
        job, tcfg = self.job, self.job.training
        if self.ranks.rank == 0:
            for line in config_lines(job, self.ranks.world_size, self.ranks.ep_size,
                                     self.hf_spec.config.model_type if self.hf_spec else None,
                                     self.hf_spec.num_experts if self.hf_spec else None):
                logger.info(line)
        self.model = self._build_model()
        if tcfg.compile:
            blocks = self.model.decoder_layers() if self.hf_spec else self.model.layers
            for block in blocks:
                block.compile()  # in place: parameter names and checkpoints stay as they are
        if self.ranks.fsdp:  # sharded before the optimizer sees the parameters (it takes FSDP's DTensors)
            apply_fsdp(self.model, self.ranks.mesh, mp_policy=mixed_precision_policy(tcfg.dtype, tcfg.param_dtype))
        self.optimizer = build_optimizer(self.model, tcfg, self.ranks.device)
        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len * self.ranks.world_size
        self.layout = Layout(rank=self.ranks.rank, world_size=self.ranks.world_size,
                             ep_rank=self.ranks.ep_rank, ep_size=self.ranks.ep_size)
        self.step = 0
        self.skipped_steps = 0  # non-finite steps skipped so far in this run (training.max_skipped_steps)
        self.graphs_off = self._graphs_off_reason()
        self._resume()
        on_rank0(self.ranks.rank, self._check_save_targets, "checking checkpoint.dir")
        self._warmup_kernels()
        self._capture_graphs()
        self.metrics = self._open_metrics()
        if writer_class is not None and self.ranks.rank == 0:
            self.tensorboard = writer_class(job.logging.tensorboard_dir,
                                            purge_step=self.step + 1 if self.step else None)

    # --- setup -------------------------------------------------------------------------

    def _claim_outputs(self) -> Optional[DirLock]:
        """Rank 0 (under :func:`checkpoint.on_rank0`): check the paths only rank 0 writes (the
        metrics file, the TensorBoard folder, the HF export), then lock ``checkpoint.dir``
        (when the run writes it); returns the lock."""
        job = self.job
        if job.logging.metrics_file:
            check_output_path("logging.metrics_file", job.logging.metrics_file, "file")
        if job.logging.tensorboard_dir:
            check_output_path("logging.tensorboard_dir", job.logging.tensorboard_dir, "dir")
        if self.hf_spec is not None and job.checkpoint.export_hf:
            value = job.checkpoint.export_hf
            if value == "auto":  # {dir}/hf
                check_output_path("checkpoint.export_hf", export_path(job), "dir",
                                  shown=f"'auto' ({export_path(job)})")
            else:
                check_output_path("checkpoint.export_hf", value, "dir")
        return lock_checkpoint_dir(Path(job.checkpoint.dir)) if writes_checkpoint_dir(job) else None

    def _check_save_targets(self) -> None:
        """Rank 0 (under :func:`checkpoint.on_rank0`), once the starting step is known: a
        ``ConfigError`` when ``checkpoint.dir`` holds an entry this trainer did not write (a
        stray file, a symlink) under the name of a step this run saves, which the save would
        refuse after all the steps before it."""
        ccfg, total, start = self.job.checkpoint, self.job.training.steps, self.step
        if ccfg.interval < 0:
            return

        def saves(step: int) -> bool:
            return start < step <= total and (step == total or (ccfg.interval > 0 and step % ccfg.interval == 0))

        for path, step, why in entries_in_the_way(Path(ccfg.dir), saves):
            raise ConfigError(f"checkpoint.dir={ccfg.dir!r} holds {path.name} ({why}, not a checkpoint directory this "
                              f"trainer wrote), where this run saves step {step}: move it away, or pass another "
                              f"checkpoint.dir (--checkpoint-dir)")

    def _check_data(self, batches: TokenBatches) -> None:
        """Check the memory-mapped data of ``batches`` (a file that shrank), every rank
        agreeing (one all-gather of the outcomes): a ``DataError`` naming the file, raised
        alike on every rank, rather than SIGBUS on the ranks whose batches reach past its end."""
        problems: list[Optional[str]] = [None] * self.ranks.world_size
        dist.all_gather_object(problems, batches.files_problem())
        found = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if found:
            rank, problem = found[0]
            where = "" if len(found) == self.ranks.world_size else f" (seen by rank {rank})"
            raise DataError(problem + where)

    def _token_streams(self) -> TokenStreams:
        """The data's train and validation tokens, checked against the model's vocabulary: text
        is tokenized with the HF model folder's tokenizer (bytes for the built-in model)."""
        job, spec = self.job, self.hf_spec
        tokenizer = load_tokenizer(spec.path) if spec is not None and not is_token_data(job.data) else None
        streams = build_token_streams(job.data, job.training.seed, tokenizer)
        vocab, option = (spec.vocab_size, f"the vocabulary of model.hf={spec.path!r}") if spec else (
            job.model.vocab_size, "model.vocab_size")
        if streams.vocab_size > vocab:
            fix = ("tokenize the data with this model's tokenizer" if spec else
                   f"set model.vocab_size >= {streams.vocab_size}")
            raise DataError(f"the data ({streams.source}) has token ids up to {streams.vocab_size - 1}, past "
                            f"{option} ({vocab} ids); {fix}")
        if spec is not None and spec.max_positions and job.training.seq_len > spec.max_positions:
            logger.warning("training.seq_len=%d is longer than the max_position_embeddings=%d of model.hf=%r",
                           job.training.seq_len, spec.max_positions, spec.path)
        return streams

    def _build_model(self) -> torch.nn.Module:
        """The built-in model or the HF model, split over the EP group, parameters in
        ``training.param_dtype``; seeded alike on every rank. ``[moe]`` goes to the HF model's
        experts as it is (``HF_MOE_KEYS``: ``moe.expert_precision`` among them)."""
        job, tcfg, ranks = self.job, self.job.training, self.ranks
        dtype = torch.bfloat16 if tcfg.param_dtype == "bfloat16" else torch.float32
        if self.hf_spec is not None:
            model = build_hf_model(self.hf_spec, ranks.ep_group, device=ranks.device, dtype=dtype, seed=tcfg.seed,
                                   **job.moe)
            if tcfg.activation_checkpointing:
                model.enable_activation_checkpointing()
            return model
        torch.manual_seed(tcfg.seed)
        model = MoETransformer(job.model, job.moe_config(), ranks.ep_group).to(ranks.device, dtype)
        model.checkpoint_blocks = tcfg.activation_checkpointing
        return model

    def config_record(self) -> dict:
        """This run's config as checkpoints record it: with an HF model, its config.json's
        architecture values under ``model.hf_config``, so that a checkpoint of another model
        is named as such."""
        record = self.job.to_dict()
        if self.hf_spec is not None:
            record["model"]["hf_config"] = self.hf_spec.architecture()
        return record

    def _resume(self) -> None:
        """Load the checkpoint named by ``checkpoint.resume``, if any (see
        :func:`checkpoint.resume`: the newest that loads, for ``latest``)."""
        ccfg = self.job.checkpoint
        found = resume(ccfg.resume, Path(ccfg.dir), self.layout, self.model, self.optimizer, self.config_record())
        if found is not None:
            _, extra = found
            self.step = int(extra["step"])
            self.batches.load_state_dict(extra["data"])
        if self.ranks.rank != 0:
            return
        if found is not None:
            logger.info("resumed from %s at step %d", found[0], self.step)
        elif ccfg.resume:
            logger.info("no complete checkpoint in %s: starting from step 0", ccfg.dir)
        newer = newer_checkpoints(Path(ccfg.dir), self.step)
        if newer:
            logger.warning("%s holds complete checkpoints past the starting step %d, from another run: %s. "
                           "They are left in place (a checkpoint this run saves at the same step replaces "
                           "it), and resume='latest' would pick %s rather than this run's own checkpoints",
                           ccfg.dir, self.step, ", ".join(p.name for p in newer), newer[-1].name)

    def _warmup_kernels(self) -> None:
        """Tune or load the Triton kernel configs once, before the first step (CUDA only):
        rank 0 tunes or reads its cache and broadcasts, so every rank runs the same kernels."""
        if self.ranks.device.type != "cuda" or self.job.moe.get("backend", "auto") == "torch":
            return
        from ep_moe.autotune import warmup

        tcfg = self.job.training
        start = time.perf_counter()
        # the problems carry the dtype the experts compute in: autocast's, or under FSDP its
        # mixed precision's (whose bf16 weights exist only while a block runs)
        compute = (torch.autocast(self.ranks.device.type, dtype=torch.bfloat16)
                   if self.ranks.fsdp and tcfg.dtype == "bfloat16" else self._autocast())
        with compute:
            resolved = warmup(self.model, timeout=self.job.parallel.autotune_timeout_s,
                              num_tokens=tcfg.batch_size * tcfg.seq_len, device=self.ranks.device)
        if self.ranks.rank == 0:
            sources = sorted({r.source for r in resolved.values()})
            logger.info("kernel configs ready in %.1fs (%d problems, from %s)",
                        time.perf_counter() - start, len(resolved), ", ".join(sources))

    def _graphs_off_reason(self) -> Optional[str]:
        """Why the blocks run eagerly (``training.cuda_graphs``), None when they are graphed;
        raises for ``cuda_graphs='on'`` where graphs cannot work."""
        tcfg = self.job.training
        if tcfg.cuda_graphs == "off":
            return "training.cuda_graphs='off'"
        if self.hf_spec is not None:
            reason = ("the trainer captures the built-in model's blocks; an HF model (model.hf) is not graphed "
                      "(eager, or each decoder layer compiled with training.compile)")
        else:
            reason = graphs_unsupported(moe_layers(self.model)[0].dispatch, self.ranks.device, compile=tcfg.compile,
                                        activation_checkpointing=tcfg.activation_checkpointing, fsdp=self.ranks.fsdp)
        if reason is not None and tcfg.cuda_graphs == "on":
            raise ConfigError(f"training.cuda_graphs='on': {reason} (or set training.cuda_graphs='auto')")
        return reason

    def _capture_graphs(self) -> None:
        """Capture the blocks in CUDA graphs for this run's batch shape (``ep_moe/train/graphs.py``)."""
        if self.graphs_off is not None:
            if self.ranks.rank == 0 and self.ranks.device.type == "cuda":
                logger.info("CUDA graphs off: %s", self.graphs_off)
            return
        tcfg, start = self.job.training, time.perf_counter()
        sample_BLD = torch.randn(tcfg.batch_size, tcfg.seq_len, self.job.model.dim, device=self.ranks.device,
                                 generator=torch.Generator(self.ranks.device).manual_seed(0))  # not the global RNG
        cos_Lh, sin_Lh = self.model.rope_cos[:tcfg.seq_len], self.model.rope_sin[:tcfg.seq_len]
        self.model.graphed_blocks = GraphedBlocks(self.model.layers, sample_BLD, cos_Lh, sin_Lh, self._autocast())
        for layer in moe_layers(self.model):  # the capture's warm-up forwards are no training load
            layer.reset_load_count()
        if self.ranks.rank == 0:
            logger.info("CUDA graphs: %d blocks captured in %.1fs", len(self.model.layers),
                        time.perf_counter() - start)

    def _open_metrics(self):
        """Rank 0's JSONL metrics file: truncated on a fresh start, appended to on resume
        after dropping the records past the resumed step (a crashed run's, which this run
        logs again)."""
        path = self.job.logging.metrics_file
        if not path or self.ranks.rank != 0:
            return None
        file = Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        if self.step and file.is_file():
            kept, dropped = [], 0
            for line in file.read_text(encoding="utf-8").splitlines():
                try:
                    keep = int(json.loads(line)["step"]) <= self.step
                except (ValueError, KeyError, TypeError):  # e.g. a line cut short by a crash
                    keep = False
                if keep:
                    kept.append(line + "\n")
                else:
                    dropped += 1
            if dropped:
                tmp = file.with_name(file.name + ".tmp")
                tmp.write_text("".join(kept), encoding="utf-8")
                os.replace(tmp, file)  # atomic: a crash leaves the old file or the new one
                logger.info("%s: dropped %d records past step %d", file, dropped, self.step)
        return open(file, "a" if self.step else "w", encoding="utf-8")

    # --- one step ----------------------------------------------------------------------

    def _lr(self, step: int) -> float:
        """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
        tcfg = self.job.training
        if step <= tcfg.warmup_steps:
            return tcfg.lr * step / tcfg.warmup_steps
        progress = (step - tcfg.warmup_steps) / max(1, tcfg.steps - tcfg.warmup_steps)
        return tcfg.lr * (tcfg.min_lr_ratio + (1 - tcfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def _autocast(self):
        """The forward's autocast: bf16 under ``training.dtype='bfloat16'``, unless FSDP's
        mixed precision casts the weights instead (``parallel.fsdp``) or the parameters are
        bf16 already (``training.param_dtype='bfloat16'``)."""
        tcfg = self.job.training
        if tcfg.dtype == "bfloat16" and tcfg.param_dtype == "float32" and not self.ranks.fsdp:
            # graph capture needs autocast without its weight-cast cache (the graphs replay the casts)
            return torch.autocast(self.ranks.device.type, dtype=torch.bfloat16,
                                  cache_enabled=self.graphs_off is not None)
        return nullcontext()

    def _loss(self, inputs_BL: torch.Tensor, targets_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token cross-entropy (fp32) and the MoE auxiliary losses of this forward."""
        with self._autocast():
            logits_BLV = self.model(inputs_BL.to(self.ranks.device, non_blocking=True))
        ce = F.cross_entropy(logits_BLV.flatten(0, 1).float(),
                             targets_BL.to(self.ranks.device, non_blocking=True).flatten())
        return ce, self.model.aux_loss()

    def _clip_gradients(self, loss: torch.Tensor, grad_divisor: int) -> tuple[torch.Tensor, bool]:
        """:func:`clip_gradients` of this run: the global grad norm, clipped to
        ``training.grad_clip``, and whether the step is finite on every rank; the gradients
        come summed over ``grad_divisor`` replicas (1 under FSDP: averaged by its
        reduce-scatters), and leave averaged."""
        return clip_gradients(self.model, self.job.training.grad_clip, self.ranks.ep_group, loss,
                              grad_scale=1.0 / grad_divisor)

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step; returns this rank's (loss, aux loss, global grad norm)."""
        if self.batches.needs_check(self.batches.step):  # the first batch, or a new epoch
            self._check_data(self.batches)
        inputs_BL, targets_BL = next(self.batches)
        lr = self._lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ce, aux = self._loss(inputs_BL, targets_BL)
        (ce + aux).backward()
        if self.ranks.fsdp:  # the backward's reduce-scatters averaged them
            divisor = 1
        else:  # summed, not averaged: the clip's multiply divides (one pass over the gradients less)
            divisor = sync_gradients(self.model, self.ranks.ep_group, self.ranks.edp_group, average=False)
        grad_norm, finite = self._clip_gradients(ce + aux, divisor)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self._non_finite_step(step, ce.detach(), aux.detach(), grad_norm)
            return ce.detach(), aux.detach(), grad_norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        update_expert_biases(self.model, dist.group.WORLD)  # no-op unless moe.expert_bias
        return ce.detach(), aux.detach(), grad_norm

    def _non_finite_step(self, step: int, ce: torch.Tensor, aux: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A step whose loss (on some rank) or global grad norm is NaN/inf: skipped, weights
        and optimizer untouched, while ``training.max_skipped_steps`` allows; else raise
        (on every rank alike: the verdict is global), before anything of it is saved."""
        tcfg = self.job.training
        what = (f"step {step}: non-finite loss or gradient norm (this rank: loss {float(ce):.4g}, aux loss "
                f"{float(aux):.4g}; global grad norm {float(grad_norm):.4g})")
        if self.skipped_steps < tcfg.max_skipped_steps:
            self.skipped_steps += 1
            if self.ranks.rank == 0:
                logger.warning("%s: step skipped (%d of training.max_skipped_steps=%d in this run)", what,
                               self.skipped_steps, tcfg.max_skipped_steps)
            return
        last = complete_checkpoints(Path(self.job.checkpoint.dir))
        raise FloatingPointError(
            f"{what}; stopping the run (training.max_skipped_steps={tcfg.max_skipped_steps}, "
            f"{self.skipped_steps} skipped). Nothing past the last checkpoint is saved; the newest complete "
            f"checkpoint in {self.job.checkpoint.dir} is {last[-1].name if last else 'none'}. Lower "
            f"training.lr, raise training.warmup_steps or check the data, then resume from it")

    # --- the loop ----------------------------------------------------------------------

    def train(self) -> None:
        """Train from ``self.step`` to ``training.steps``, logging, evaluating and saving."""
        tcfg, lcfg, ccfg = self.job.training, self.job.logging, self.job.checkpoint
        rank0 = self.ranks.rank == 0
        if self.step >= tcfg.steps:
            if rank0:
                logger.warning("checkpoint step %d >= training.steps=%d: nothing to train; raise --steps "
                               "(training.steps) to train further%s", self.step, tcfg.steps,
                               "; exporting the model as it is" if self.hf_spec is not None and ccfg.export_hf else "")
            if self.hf_spec is not None and ccfg.export_hf:
                self.export_hf()
            return
        if rank0:
            n_params = sum(p.numel() for p in self.model.parameters())
            logger.info("rank 0: %.2fM parameters (its expert shard included); world %d, EP %d, "
                        "%d tokens per step, device %s%s", n_params / 1e6, self.ranks.world_size,
                        self.ranks.ep_size, self.tokens_per_step, self.ranks.device,
                        f"; FSDP: dense weights sharded over {self.ranks.world_size} ranks, experts over "
                        f"edp={self.ranks.world_size // self.ranks.ep_size}" if self.ranks.fsdp else "")
        self.model.train()
        # disable=None: tqdm turns itself off when stderr is not a terminal (logs to a file).
        bar = tqdm(total=tcfg.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=None if rank0 and lcfg.progress_bar else True)
        start = self.step
        self.summary = RunSummary(first_step=start)
        interval_start, interval_steps = time.perf_counter(), 0
        steps_start, paused_total = interval_start, 0.0
        with logging_redirect_tqdm():
            for step in range(start + 1, tcfg.steps + 1):
                loss, aux, grad_norm = self.train_step(step)
                self.step = step
                interval_steps += 1
                bar.update(1)
                last = step == tcfg.steps
                if step % lcfg.log_interval == 0 or last or step == start + 1:
                    elapsed = time.perf_counter() - interval_start
                    record = self._log(step, loss, aux, grad_norm, interval_steps / elapsed)
                    self.summary.loss = record["loss"]
                    bar.set_postfix(loss=f"{record['loss']:.3f}")
                    interval_start, interval_steps = time.perf_counter(), 0
                paused = time.perf_counter()  # evaluation and saving do not count in tokens/s
                if lcfg.eval_interval and (step % lcfg.eval_interval == 0 or last):
                    self._evaluate(step)
                if ccfg.interval >= 0 and (last or (ccfg.interval and step % ccfg.interval == 0)):
                    self._save(step)
                interval_start += time.perf_counter() - paused
                paused_total += time.perf_counter() - paused
            bar.close()
            self.summary.steps = self.step - start
            self.summary.train_seconds = time.perf_counter() - steps_start - paused_total
            if lcfg.sample_prompt and self.byte_level:
                self._sample(lcfg.sample_prompt, lcfg.sample_tokens)
        if self.hf_spec is not None and ccfg.export_hf:
            self.export_hf()
        if rank0:
            self.summary.report(self.tokens_per_step, lcfg.metrics_file)

    def export_hf(self) -> None:
        """Write the HF model as an HF folder (``checkpoint.export_hf``; ``auto``: ``{dir}/hf``)
        that plain transformers loads, with the model folder's tokenizer."""
        path = export_path(self.job)
        start = time.perf_counter()
        self.model.export(path, tokenizer_dir=self.hf_spec.path)
        if self.ranks.rank == 0:
            logger.info("exported the model at step %d as an HF folder: %s (%.1fs)", self.step, path,
                        time.perf_counter() - start)

    def _log(self, step: int, loss: torch.Tensor, aux: torch.Tensor, grad_norm: torch.Tensor,
             steps_per_s: float) -> dict:
        """All-reduce this step's stats; rank 0 logs them and appends them to the metrics file."""
        means = _all_reduce_mean(torch.stack([loss.float(), aux.float()]))
        load_LE = self.model.expert_load().to(self.ranks.device)
        dist.all_reduce(load_LE)  # tokens of every rank per global expert
        loss_v, aux_v = means.tolist()
        record = {"step": step, "loss": loss_v, "aux_loss": aux_v, "lr": self._lr(step),
                  "grad_norm": float(grad_norm), "tokens_per_s": steps_per_s * self.tokens_per_step,
                  "load_min": int(load_LE.min()), "load_max": int(load_LE.max()),
                  "load_mean": float(load_LE.float().mean())}
        if self.ranks.rank == 0:
            logger.info("step %5d/%d | loss %.4f | aux %.4f | lr %.2e | gnorm %.3f | %8.0f tok/s | "
                        "tokens/expert min %d max %d (mean %.0f)", step, self.job.training.steps,
                        loss_v, aux_v, record["lr"], record["grad_norm"], record["tokens_per_s"],
                        record["load_min"], record["load_max"], record["load_mean"])
            self._write_metrics(record)
        return record

    @torch.no_grad()
    def _evaluate(self, step: int) -> None:
        """Mean loss over ``eval_batches`` fixed held-out batches per rank."""
        self._check_data(self.val_batches)
        self.model.eval()
        losses = [self._loss(*self.val_batches.batch(i))[0] for i in range(self.job.logging.eval_batches)]
        self.model.train()
        val = float(_all_reduce_mean(torch.stack(losses).mean()))
        if self.ranks.rank == 0:
            logger.info("step %5d | val loss %.4f", step, val)
            self._write_metrics({"step": step, "val_loss": val})
        if self.summary is not None:
            self.summary.val_loss = val

    def _save(self, step: int) -> None:
        start = time.perf_counter()
        extra = {"step": step, "data": self.batches.state_dict()}
        path = save_checkpoint(Path(self.job.checkpoint.dir), step, self.layout, self.model, self.optimizer,
                               extra, {"config": self.config_record()}, self.job.checkpoint.keep,
                               format=self.job.checkpoint.format)
        if self.ranks.rank == 0:
            logger.info("saved %s in %.1fs", path, time.perf_counter() - start)
        if self.summary is not None:
            self.summary.checkpoint = str(path)

    @torch.no_grad()
    def _sample(self, prompt: str, num_tokens: int) -> None:
        """Greedy continuation of ``prompt`` (every rank runs it: EP forwards are collective)."""
        self.model.eval()
        prompt_L = torch.tensor(list(prompt.encode()), dtype=torch.int64, device=self.ranks.device)
        with self._autocast():
            out_L = self.model.generate(prompt_L, num_tokens)
        self.model.train()
        if self.ranks.rank == 0:
            text = bytes(out_L.tolist()).decode("utf-8", errors="replace")
            logger.info("sample: %r", text)

    def _write_metrics(self, record: dict) -> None:
        """Append ``record`` to the metrics file and write it to TensorBoard, as scalars at its
        step (``val/loss`` for an evaluation, ``train/<name>`` for the rest)."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tensorboard is not None:
            for name, value in record.items():
                if name != "step":
                    tag = "val/loss" if name == "val_loss" else f"train/{name}"
                    self.tensorboard.add_scalar(tag, value, record["step"])
            self.tensorboard.flush()

    def release_graphs(self) -> None:
        """Free the CUDA graphs: the blocks run eagerly from here on. Every reference goes,
        the MoE layers' last losses too (graph outputs, whose autograd node holds the graphs)."""
        if self.ranks.device.type == "cuda":
            torch.cuda.synchronize(self.ranks.device)
        self.model.graphed_blocks = None
        for layer in moe_layers(self.model):
            layer.last_stats = None
        gc.collect()

    def close(self) -> None:
        """Close the metrics file and the TensorBoard writer, free the CUDA graphs (the
        caller then destroys the process group: graphs that captured NCCL collectives and
        are still alive make ``destroy_process_group`` hang, a known torch issue), and
        release the lock of ``checkpoint.dir``. Idempotent; also called by a failed start."""
        if getattr(getattr(self, "model", None), "graphed_blocks", None) is not None:
            self.release_graphs()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.dir_lock is not None:
            self.dir_lock.release()
