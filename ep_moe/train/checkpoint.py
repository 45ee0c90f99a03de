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

Steps have any number of digits: names are ``step_{step:08d}`` (at least 8 digits, more
past step 99999999), and checkpoints are ordered by the number, not the name. A
checkpoint whose name disagrees with the step in its ``meta.json`` (renamed or copied by
hand) is refused, naming both (``latest`` skips it).

Only what this trainer wrote is ever deleted or renamed: pruning and a re-save's
replacement touch a ``step_N`` entry of ``dir`` only when it is a real directory (checked
with ``os.lstat``: never through a symlink) under its own name that holds ``meta.json`` or
the ``COMPLETE`` marker; the cleanup of an interrupted save or deletion touches
``step_N.partial`` and ``step_N.deleting`` only when they are real directories. Anything
else under those names (a symlink to an archived checkpoint, a stray file) is left alone
with a warning naming it, and does not count toward ``keep``; where it stands in the way
of a save (``step_N`` or ``step_N.partial`` of the step being saved) the save refuses,
alike on every rank, naming it and the fix. Reading through a link is fine: ``--resume``
loads a linked checkpoint.

One trainer at a time per ``dir``: rank 0 holds ``{dir}/.lock`` (:func:`lock_checkpoint_dir`)
for the run, a file holding its host and pid under an exclusive ``flock``, its modification
time refreshed every ``LOCK_HEARTBEAT_S``. A second trainer refuses to start, naming the
holder; a lock left by a process of this host that no longer runs, or one of another host
not refreshed for ``LOCK_STALE_S`` (a job preempted there and restarted here), is taken over
with a warning; it is deleted when the run closes.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

try:
    import fcntl
except ImportError:  # not POSIX: the lock is the file and its pid alone
    fcntl = None

from ep_moe import checkpoint as dcp_checkpoint
from ep_moe.parallel import is_expert_param
from ep_moe.train import errors
from ep_moe.train.errors import CheckpointError, ConfigError, UserError

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
"""A checkpoint directory's name: ``step_`` and its step, of any width (written with at least 8 digits)."""
_STEP_ENTRY = re.compile(r"^step_(\d+)(\.partial|\.deleting)?$")
"""The names the trainer gives the entries of ``dir``: a checkpoint, a save in progress, a deletion."""
MARKER = "COMPLETE"
"""The file that makes a checkpoint directory complete: written last, removed first."""
_DELETING = ".deleting"
"""Suffix of a checkpoint directory being deleted (renamed so, after its marker is gone)."""
# param_group entries that are not hyper-parameters of the run: which parameters, the lr the
# schedule sets every step, and implementation choices that follow the device.
_NOT_HYPER = frozenset({"params", "lr", "initial_lr", "fused", "foreach", "capturable", "differentiable"})
FORMATS = ("dcp", "native")
"""The values of ``checkpoint.format``."""
LOCK = ".lock"
"""The lock file of ``dir`` (:func:`lock_checkpoint_dir`)."""
LOCK_HEARTBEAT_S = 30.0
"""How often the holder of a lock refreshes its file's modification time."""
LOCK_STALE_S = 300.0
"""A lock of another host not refreshed for this long belongs to a run that is gone (its
heartbeat stopped; ten missed beats, room for clocks that disagree by minutes)."""
_T = TypeVar("_T")


def step_dir_name(step: int) -> str:
    """The name of the checkpoint directory of ``step``: ``step_`` and at least 8 digits."""
    return f"step_{step:08d}"


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
    final = root / step_dir_name(step)
    partial = final.with_name(final.name + ".partial")
    meta = {"format": format, "step": step, "world_size": layout.world_size, "ep_size": layout.ep_size,
            **({"extra": extra} if format == "dcp" else {}), **meta}
    meta_json = json.dumps(meta, indent=1)  # not JSON: raises here on every rank, before any collective
    _check_finite(step, model, optimizer)

    def prepare() -> None:
        _in_the_way(final, step, root)  # a re-save replaces only a checkpoint this trainer wrote
        _discard(partial, step, root)  # an interrupted save of this step
        for trash in root.glob(f"step_*{_DELETING}"):  # an interrupted deletion
            if _mine(trash):
                shutil.rmtree(trash, ignore_errors=True)
        partial.mkdir(parents=True)

    def finish() -> None:
        (partial / "meta.json").write_text(meta_json)
        _mark_complete(partial, step)
        _discard(final, step, root)  # a re-save of this step: the old one stops counting before it goes
        partial.rename(final)
        _prune(root, keep, step)

    on_rank0(layout.rank, prepare, f"preparing the checkpoint of step {step}")  # every rank waits for it
    if format == "dcp":
        dcp_checkpoint.save_checkpoint(partial, model, optimizer)  # collective
    else:
        _save_native(partial, layout, model, optimizer, extra)
    torch.save(_rng_state(), partial / f"rng-{layout.rank:05d}.pt")
    dist.barrier()
    on_rank0(layout.rank, finish, f"completing the checkpoint of step {step}")
    return final


def on_rank0(rank: int, action: Callable[[], _T], what: str) -> Optional[_T]:
    """Run ``action`` on rank 0 alone and return its result there (None elsewhere);
    collective: every rank returns once rank 0 is done, or raises alike when it raised (a
    ``UserError`` with its message on every rank; anything else is re-raised on rank 0
    with its traceback and named on the others, ``what`` saying what failed). So no rank
    is left waiting on rank 0's file-system work."""
    result: Optional[_T] = None
    error: Optional[BaseException] = None
    box: list[Any] = [None]
    if rank == 0:
        try:
            result = action()
        except Exception as exc:
            error = exc
            kind = None
            if isinstance(exc, UserError):
                kind = type(exc).__name__ if type(exc).__name__ in _USER_ERRORS else "UserError"
            box = [(kind, str(exc), f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        kind, message, described = box[0]
        if kind is not None:
            raise _USER_ERRORS[kind](message)
        raise RuntimeError(f"{what} failed on rank 0 ({described}); see its traceback")
    return result


_USER_ERRORS = {cls.__name__: cls for cls in (errors.UserError, errors.ConfigError, errors.DataError,
                                              errors.CheckpointError)}


# --- one trainer per directory ------------------------------------------------------------------

class DirLock:
    """The lock of a checkpoint directory held by this process (:func:`lock_checkpoint_dir`):
    a daemon thread refreshes the file's modification time every ``LOCK_HEARTBEAT_S``, so
    that trainers on other hosts can tell a live holder from a dead one."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: Optional[int] = fd
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name=f"lock heartbeat {path}", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                os.utime(self._fd)
            except (OSError, TypeError):  # released meanwhile, or a platform without utime on fds
                return

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Delete the lock file (while still holding it) and let go; idempotent."""
        if self._fd is None:
            return
        self._stop.set()
        self._heartbeat.join()
        try:
            if _same_file(self.path, self._fd):
                os.unlink(self.path)
        except OSError as exc:
            logger.warning("could not delete the lock file %s (%s); the next run takes it over", self.path, exc)
        finally:
            os.close(self._fd)
            self._fd = None


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not deleted or replaced since)."""
    try:
        st, open_st = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (open_st.st_dev, open_st.st_ino)


def _read_holder(fd: int, wait_s: float) -> Optional[dict[str, Any]]:
    """The lock file's ``{"host", "pid", ...}``, waiting up to ``wait_s`` for a holder that
    created it to write it; None when it is empty or not such a record."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = json.loads(os.pread(fd, 65536, 0).decode("utf-8"))
            if isinstance(holder, dict) and isinstance(holder.get("pid"), int):
                return holder
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _in_use(root: Path, path: Path, holder: Optional[dict[str, Any]], note: str = "") -> ConfigError:
    who = "its holder did not write its host and pid" if holder is None else (
        f"host {holder.get('host', '?')}, pid {holder['pid']}"
        + (f", since {holder['since']}" if holder.get("since") else ""))
    return ConfigError(f"checkpoint.dir={str(root)!r} is in use by another trainer ({who}; lock file {path}): pass "
                       f"another checkpoint.dir (--checkpoint-dir), or stop that run first{note}")


def lock_checkpoint_dir(root: Path) -> DirLock:
    """Take the checkpoint directory ``root`` for this run (rank 0; :meth:`DirLock.release`
    at the end), or raise a ``ConfigError`` naming the trainer that holds it and the fix.

    The lock is ``{root}/.lock``: a file holding the holder's host, pid and start time,
    under an exclusive ``flock`` for as long as the holder lives (the kernel drops it when
    the process dies, however it dies). Taken when no other process holds the ``flock``
    and the file names no live holder: a file left by a process of this host that no
    longer runs is taken over with a warning; one of another host (whose processes cannot
    be seen from here) is refused unless its heartbeat stopped ``LOCK_STALE_S`` ago (then
    taken over with a warning), naming the file to delete once that run is gone. On a file
    system without ``flock`` the pid check alone decides.
    """
    path = root / LOCK
    host, pid = socket.gethostname(), os.getpid()
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                         0o644)
        except OSError as exc:
            what = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
            raise ConfigError(f"checkpoint.dir={str(root)!r}: its lock file {path} {what}: remove it, or pass "
                              f"another checkpoint.dir (--checkpoint-dir)") from None
        try:
            flocked = fcntl is not None
            if flocked:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a live process holds it
                    raise _in_use(root, path, _read_holder(fd, wait_s=2.0)) from None
                except OSError:  # no flock on this file system: the pid decides
                    flocked = False
            if not _same_file(path, fd):  # its holder released (deleted) it meanwhile: take the new one
                os.close(fd)
                continue
            holder = _read_holder(fd, wait_s=0.0 if flocked else 1.0)
            if holder is not None and holder["pid"] != pid:
                if holder.get("host") != host:
                    silent_s = time.time() - os.fstat(fd).st_mtime
                    if silent_s < LOCK_STALE_S:
                        raise _in_use(root, path, holder, f"; if that run is gone, delete {path} (it is taken over "
                                                          f"{LOCK_STALE_S - silent_s:.0f} s from now anyway)")
                    logger.warning("taking over the lock %s of host %s, pid %d, not refreshed for %.0f s: that run "
                                   "is gone", path, holder.get("host"), holder["pid"], silent_s)
                elif not flocked and _pid_alive(holder["pid"]):
                    raise _in_use(root, path, holder, f"; if that run is gone, delete {path}")
                else:
                    logger.warning("taking over the stale lock %s of pid %d on this host (%s), which no longer runs%s",
                                   path, holder["pid"], host,
                                   " (that pid is now another process)" if _pid_alive(holder["pid"]) else "")
            record = {"host": host, "pid": pid, "since": datetime.datetime.now().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
            os.fsync(fd)
            return DirLock(path, fd)
        except BaseException:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise
    raise ConfigError(f"checkpoint.dir={str(root)!r}: its lock file {path} keeps being replaced by another process: "
                      f"pass another checkpoint.dir (--checkpoint-dir), or stop the other trainers on it")


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


def _discard(path: Path, step: Optional[int] = None, root: Optional[Path] = None) -> None:
    """Delete a checkpoint directory so that no kill on the way leaves it looking complete:
    it is renamed away first (``*.deleting``, which no lookup matches: atomic), then loses
    its marker, then is deleted. Only a directory this trainer wrote (:func:`_not_mine`),
    never through a link: anything else under its name, or under the ``.deleting`` name,
    raises a ``CheckpointError`` naming it (``step``, ``root``: the save it is in the way of)."""
    if not os.path.lexists(path):
        return
    trash = path.with_name(path.name + _DELETING)
    _in_the_way(path, step, root)
    if os.path.lexists(trash):
        _in_the_way(trash, step, root)
    shutil.rmtree(trash, ignore_errors=True)  # left by an interrupted deletion
    path.rename(trash)
    (trash / MARKER).unlink(missing_ok=True)
    shutil.rmtree(trash, ignore_errors=True)
    if trash.exists():
        logger.warning("could not delete all of %s; remove it by hand", trash)


def _not_mine(path: Path) -> Optional[str]:
    """Why the entry ``path`` of a checkpoint directory is not one this trainer wrote (and
    so is never deleted nor renamed), or None when it is: a real directory (``os.lstat``:
    not a symlink) under the trainer's own name for its step; a ``step_N`` checkpoint also
    holds ``meta.json`` or the ``COMPLETE`` marker (``.partial`` and ``.deleting`` need not:
    a kill leaves them with any subset of their files)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return f"a symlink (to {os.readlink(path)})"
    if not stat.S_ISDIR(mode):
        return "a file" if stat.S_ISREG(mode) else "not a directory"
    match = _STEP_ENTRY.match(path.name)
    if match is None:
        return "not named like a checkpoint"
    own = step_dir_name(int(match.group(1))) + (match.group(2) or "")
    if path.name != own:
        return f"a directory not named as the trainer names it ({own})"
    if match.group(2) is None and not any(_is_regular(path / name) for name in ("meta.json", MARKER)):
        return f"a directory without meta.json or {MARKER}"
    return None


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


_warned: set[str] = set()
"""Entries already named in a warning by this process (each is named once)."""


def _mine(path: Path) -> bool:
    """Whether this trainer wrote ``path`` (:func:`_not_mine`); else warns, once per entry,
    that it is left alone."""
    why = _not_mine(path)
    if why is None:
        return True
    if str(path) not in _warned:
        _warned.add(str(path))
        logger.warning("leaving %s alone: it is %s, not a checkpoint directory this trainer wrote (pruning, re-saves "
                       "and cleanups delete or rename only those; it does not count toward checkpoint.keep)", path, why)
    return False


def _in_the_way(path: Path, step: Optional[int], root: Optional[Path]) -> None:
    """Raise a ``CheckpointError`` when ``path`` exists but is not a checkpoint directory
    this trainer wrote, and the save of ``step`` needs its name."""
    if not os.path.lexists(path):
        return
    why = _not_mine(path)
    if why is None:
        return
    where = root if root is not None else path.parent
    doing = f"cannot save the checkpoint of step {step}" if step is not None else "cannot delete an old checkpoint"
    raise CheckpointError(f"{doing}: {path} is in the way: it is {why}, not a checkpoint directory this trainer "
                          f"wrote; move it out of checkpoint.dir={str(where)!r}, or pass another checkpoint.dir "
                          f"(--checkpoint-dir)")


def entries_in_the_way(root: Path, saves: Callable[[int], bool]) -> list[tuple[Path, int, str]]:
    """The entries of ``root`` under the names of checkpoints and saves in progress
    (``step_N``, ``step_N.partial``) that the trainer did not write, for steps ``N`` that
    ``saves(N)``: a save of ``N`` would refuse. Each with its step and what it is."""
    found = []
    if not root.is_dir():
        return found
    for path in sorted(root.iterdir()):
        match = _STEP_ENTRY.match(path.name)
        if match is None or match.group(2) == _DELETING or not saves(int(match.group(1))):
            continue
        why = _not_mine(path)
        if why is not None:
            found.append((path, int(match.group(1)), why))
    return found


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
    saved = root / step_dir_name(step)
    if not keep or not _is_complete(saved):
        return
    mine = [p for p in complete_checkpoints(root) if checkpoint_step(p) <= step and _mine(p)]
    for old in mine[:-keep]:
        if old != saved:
            _discard(old)


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_XXXXXXXX`` checkpoint directory (any number of digits)."""
    return int(_STEP_DIR.match(path.name).group(1))


def _by_step(path: Path) -> tuple[int, str]:
    return checkpoint_step(path), path.name


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root`` (those holding the marker; a symlink to
    one too: read-only use), oldest first (by step)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and _is_complete(p)]
    return sorted(found, key=_by_step)


def newer_checkpoints(root: Path, step: int) -> list[Path]:
    """Complete checkpoints under ``root`` past ``step``, oldest first."""
    return [p for p in complete_checkpoints(root) if checkpoint_step(p) > step]


def _finish_interrupted_saves(root: Path) -> None:
    """A ``step_X.partial`` holding the marker was written whole, and its save was killed
    while it replaced an older ``step_X`` (a re-save of that step): finish the replacement."""
    for partial in sorted(root.glob("step_*.partial")):
        if _STEP_DIR.match(partial.stem) and _is_complete(partial):
            final = partial.with_name(partial.stem)
            blocker = partial if _not_mine(partial) is not None else (
                final if os.path.lexists(final) and _not_mine(final) is not None else None)
            if blocker is not None:
                logger.warning("not finishing the interrupted save %s: %s is %s, not a checkpoint directory this "
                               "trainer wrote, so both are left alone", partial, blocker.name, _not_mine(blocker))
                continue
            _discard(final)
            partial.rename(final)
            logger.warning("%s: finished an interrupted save (its files were complete in %s)", final, partial.name)


def _earlier_hint(path: Path) -> str:
    """How to go on without checkpoint ``path``: the newest complete one before it, if any."""
    match = re.match(r"^step_(\d+)", path.name)
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
    newest = checkpoint_step(complete[0]) if complete else -1
    for path in sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and checkpoint_step(p) > newest),
                       key=_by_step):
        if not path.is_dir():
            logger.warning("skipping %s: %s, not a checkpoint", path, _not_mine(path))
        elif not _is_complete(path):
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
    named = _STEP_DIR.match(path.name)
    if named is not None and int(named.group(1)) != meta["step"]:
        raise CheckpointError(f"cannot resume from checkpoint {path}: its name says step {int(named.group(1))} but its "
                              f"meta.json says step {meta['step']} (renamed or copied by hand?); give it the name of "
                              f"its step ({step_dir_name(meta['step'])}) or move it away. {_earlier_hint(path)}")
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
