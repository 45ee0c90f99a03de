"""Where kernel configs come from: the per-process table, the lookup chain, and warmup.

Lookup chain for one problem on one device (:func:`get_kernel_configs`; :func:`resolve`
walks steps 2-5):

1. memory: tables installed in this process (by :func:`warmup` or an earlier lookup);
2. the user cache file (:mod:`ep_moe.autotune.cache`);
3. configs shipped with the package (``ep_moe/autotune/shipped/<device>/``);
4. tuning, only at :func:`warmup` or when a caller passes ``allow_tuning=True``;
5. the shape heuristic (:func:`ep_moe.autotune.space.heuristic_table`).

``EP_MOE_DISABLE_AUTOTUNE=1`` skips 2 and 4 (shipped or heuristic only);
``EP_MOE_FORCE_AUTOTUNE=1`` (or ``force=True``) makes tuning points (:func:`warmup`) skip
2 and 3 and retune; lookups that may not tune are unaffected.

:func:`warmup` is the one point where tuning happens: every rank calls it; rank 0 of the
group resolves every problem (cache, else tune) and publishes the tables as JSON in the
job's c10d store; the other ranks wait for them with ``timeout`` and install exactly what
it sent. The only module of :mod:`ep_moe.autotune` that imports ``torch.distributed``.

Timeouts. Rank 0's waits for cache locks and tuning shares end by ``timeout``; its own
tuning of a problem is not interrupted. A rank that hears nothing from rank 0 within
``timeout`` plus a grace gives up, and that is settled in the store by one
compare-and-set against rank 0's publication: whichever comes first is what every rank
takes, so either all install rank 0's tables or all (rank 0 too, once it gets there) take
the heuristic with a warning. Left to torch: every store call here rides on the job's c10d
store. Under torchrun its agent hosts the store, so a rank 0 that stalls or dies never
blocks the others' store calls. With a ``tcp://`` (or ``env://`` outside torchrun)
rendezvous rank 0 hosts the store itself; if it freezes, the others' calls to the store
block until the store's own timeout (``init_process_group(timeout=...)``, 30 minutes by
default) and then raise :class:`WarmupTimeout`. While debugging, launch with torchrun or
give ``init_process_group`` a short timeout (e.g. ``timedelta(seconds=60)``).
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ep_moe.autotune.bench import Tuner, TuneFn, default_device, device_limits
from ep_moe.autotune.cache import (
    DEFAULT_LOCK_TIMEOUT,
    CacheKey,
    check_lock_timeout,
    default_cache,
    load_shipped,
    make_key,
)
from ep_moe.autotune.space import (
    STANDARD_BUCKETS,
    DeviceLimits,
    GemmProblem,
    Table,
    TunedBucket,
    bucket_bounds,
    bucket_for,
    heuristic_table,
    table_misfit,
)
from ep_moe.kernels.config import GemmConfigs

logger = logging.getLogger(__name__)

ENV_DISABLE = "EP_MOE_DISABLE_AUTOTUNE"
ENV_FORCE = "EP_MOE_FORCE_AUTOTUNE"


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        logger.warning("ep_moe autotune: %s=%r is neither on (1, true, yes, on) nor off (0, false, no, "
                       "off); taken as off", name, value)
    return value in ("1", "true", "yes", "on")


MAX_WARMUP_TIMEOUT = 7 * 24 * 3600.0
"""Longest ``timeout`` :func:`warmup` takes (a week; tuning a model takes minutes to hours).
Every wait of a warmup is bounded: an infinite timeout is refused, not taken as no limit."""


def _check_warmup_timeout(timeout: Any) -> None:
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_WARMUP_TIMEOUT):  # NaN fails
        raise ValueError(f"warmup: timeout={timeout!r}: give a finite number of seconds in "
                         f"(0, {MAX_WARMUP_TIMEOUT:.0f}], e.g. 600 (every wait of a warmup is bounded)")


def _publish_grace(timeout: float) -> float:
    """How much longer than ``timeout`` the other ranks wait for rank 0, whose waits for cache
    locks and tuning shares end by ``timeout``: time to publish what it has (a held lock's
    fallback, say) before a peer gives up and settles the exchange as timed out."""
    return min(30.0, 0.5 * timeout)


class WarmupTimeout(RuntimeError):
    """Rank 0 of the warmup group sent no configs within the timeout, and the job's c10d
    store no longer answers (rank 0 hosted it and stalled or died)."""


@dataclass(frozen=True)
class ResolvedConfigs:
    """The configs of one problem on one device, by token bucket, and where they came from.

    ``source`` is one of ``memory``, ``cache``, ``shipped``, ``tuned``, ``heuristic`` or
    ``fallback`` (heuristic after a tuning failure, described by ``error``).
    """

    source: str
    table: Table
    error: str | None = None
    _buckets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _bounds: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.table:
            raise ValueError("ResolvedConfigs.table is empty: it needs at least one bucket")
        buckets = tuple(sorted(self.table))
        object.__setattr__(self, "_buckets", buckets)
        object.__setattr__(self, "_bounds", bucket_bounds(buckets))

    def bucket(self, num_rows: int) -> int:
        """The bucket nearest ``num_rows`` routed rows (log scale)."""
        return self._buckets[bisect.bisect_left(self._bounds, num_rows)]

    def for_rows(self, num_rows: int) -> GemmConfigs:
        """Configs of the bucket nearest ``num_rows``."""
        return self.table[self.bucket(num_rows)].configs

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (what rank 0 publishes)."""
        return {"source": self.source, "error": self.error,
                "table": {str(b): t.to_dict() for b, t in self.table.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ResolvedConfigs":
        """Inverse of :meth:`to_dict`."""
        table = {int(b): TunedBucket.from_dict(t) for b, t in data["table"].items()}
        return cls(source=data["source"], table=table, error=data.get("error"))


# This process's tables, by (problem, device); what get_kernel_configs serves from.
_INSTALLED: dict[tuple[GemmProblem, tuple[str, int]], ResolvedConfigs] = {}
_LIMITS: dict[tuple[str, int], DeviceLimits] = {}


def _device_key(device: torch.device | str | int | None) -> tuple[str, int]:
    if device is None:
        return ("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else ("cpu", -1)
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda", device.index if device.index is not None else torch.cuda.current_device()
    return device.type, -1


def _torch_device(dev_key: tuple[str, int]) -> torch.device:
    return torch.device(dev_key[0], dev_key[1]) if dev_key[1] >= 0 else torch.device(dev_key[0])


def _limits(dev_key: tuple[str, int]) -> DeviceLimits:
    if dev_key not in _LIMITS:
        _LIMITS[dev_key] = device_limits(_torch_device(dev_key))
    return _LIMITS[dev_key]


def _install(problem: GemmProblem, dev_key: tuple[str, int], resolved: ResolvedConfigs) -> None:
    _INSTALLED[(problem, dev_key)] = resolved
    logger.info("ep_moe autotune: %s served from %s (%d buckets)%s", problem, resolved.source,
                len(resolved.table), f": {resolved.error}" if resolved.error else "")


def clear_memory_cache() -> None:
    """Forget every table installed in this process (files are kept)."""
    _INSTALLED.clear()


def get_kernel_configs(problem: GemmProblem, num_rows: int,
                       device: torch.device | str | int | None = None, *,
                       allow_tuning: bool = False,
                       lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> GemmConfigs:
    """Kernel configs (forward, dX, dW) for ``problem`` at ``num_rows`` routed rows.

    Cheap enough for every layer call: after the first lookup of a (problem, device) it is
    a dict lookup and a bisect over the token buckets. The first lookup walks the chain of
    the module docstring without tuning (unless ``allow_tuning``; tune at :func:`warmup`
    instead) and logs which source served. With ``allow_tuning`` a failure of tuning, or a
    cache lock held longer than ``lock_timeout`` seconds, gives the heuristic with a
    warning, as at :func:`warmup`; a ``lock_timeout`` that is not finite seconds >= 0
    raises ``ValueError``.
    """
    dev_key = _device_key(device)
    resolved = _INSTALLED.get((problem, dev_key))
    if resolved is None:
        if allow_tuning:
            check_lock_timeout(lock_timeout)  # not a tuning failure: the caller's to fix
            resolved = _resolve_or_fallback(problem, _torch_device(dev_key), STANDARD_BUCKETS, False, None,
                                            lock_timeout)
        else:
            resolved = resolve(problem, _torch_device(dev_key))
        _install(problem, dev_key, resolved)
    return resolved.for_rows(num_rows)


def resolve(problem: GemmProblem, device: torch.device | None = None, *, tune: bool = False,
            force: bool = False, buckets: tuple[int, ...] = STANDARD_BUCKETS,
            tuner: TuneFn | None = None, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> ResolvedConfigs:
    """Walk the lookup chain for ``problem`` on ``device``, skipping memory.

    With ``tune`` a cache file missing some of ``buckets`` is completed by ``tuner``
    (single flight across processes; a lock held longer than ``lock_timeout`` seconds
    raises :class:`~ep_moe.autotune.cache.CacheLockTimeout`). Errors of tuning propagate;
    :func:`warmup` and :func:`get_kernel_configs` turn them into a fallback.
    """
    dev_key = _device_key(device)
    dev = _limits(dev_key)
    key = make_key(problem, dev)
    disabled = _env_flag(ENV_DISABLE)
    force = force and tune and not disabled
    cached = None if disabled or force else _fitting(default_cache().load(key), problem, dev, "cache")
    if cached and (not tune or set(buckets) <= cached.keys()):
        return ResolvedConfigs("cache", cached)
    shipped = None if force or cached else _fitting(load_shipped(key), problem, dev, "shipped configs")
    if shipped:
        return ResolvedConfigs("shipped", shipped)
    if tune and not disabled:
        tuner = tuner or Tuner(device=_torch_device(dev_key))
        table, source = default_cache().get_or_tune(
            key, buckets, lambda missing: tuner(problem, dev, missing), force=force,
            lock_timeout=lock_timeout)
        return ResolvedConfigs(source, table)
    if cached:
        return ResolvedConfigs("cache", cached)
    return ResolvedConfigs("heuristic", heuristic_table(problem, dev))


def _fitting(table: Table | None, problem: GemmProblem, dev: DeviceLimits, where: str) -> Table | None:
    """``table`` if every config of it fits the device, else None with a warning."""
    misfit = table and table_misfit(table, problem, dev)
    if misfit:
        logger.warning("ep_moe autotune: ignoring the %s of %s: %s", where, problem, misfit)
        return None
    return table


def collect_problems(model_or_shapes: Any) -> list[GemmProblem]:
    """The distinct problems of a module (submodules with ``gemm_problems()``) or an
    iterable of :class:`GemmProblem`, in first-seen order."""
    if isinstance(model_or_shapes, torch.nn.Module):
        found = [p for m in model_or_shapes.modules()
                 if callable(getattr(m, "gemm_problems", None)) for p in m.gemm_problems()]
    elif isinstance(model_or_shapes, GemmProblem):
        found = [model_or_shapes]
    else:
        found = list(model_or_shapes)
    for p in found:
        if not isinstance(p, GemmProblem):
            raise TypeError(f"model_or_shapes: expected an nn.Module or GemmProblems, got an item "
                            f"of type {type(p).__name__}; build problems with GemmProblem(...)")
    return list(dict.fromkeys(found))


def target_buckets(problem: GemmProblem, num_tokens: int | Iterable[int] | None) -> tuple[int, ...]:
    """Buckets warmup tunes for ``num_tokens`` tokens per rank: the power of two nearest
    tokens x top_k for each; None: ``STANDARD_BUCKETS``."""
    if num_tokens is None:
        return STANDARD_BUCKETS
    tokens = [num_tokens] if isinstance(num_tokens, int) else list(num_tokens)
    if not tokens or any(t < 1 for t in tokens):
        raise ValueError(f"num_tokens={num_tokens!r}: give tokens per rank (>= 1), or None "
                         f"for the standard buckets {STANDARD_BUCKETS}")
    return tuple(sorted({bucket_for(t * problem.top_k) for t in tokens}))


def _resolve_or_fallback(problem: GemmProblem, device: torch.device, buckets: tuple[int, ...],
                         force: bool, tuner: TuneFn | None, timeout: float) -> ResolvedConfigs:
    """:func:`resolve` with tuning; any failure becomes the heuristic with a warning."""
    try:
        return resolve(problem, device, tune=True, force=force, buckets=buckets, tuner=tuner,
                       lock_timeout=timeout)
    except Exception as e:  # noqa: BLE001 - any tuning failure must leave every rank on the fallback
        error = f"{type(e).__name__}: {e}"
        logger.warning("ep_moe autotune: tuning %s failed (%s); using heuristic configs", problem, error)
        return ResolvedConfigs("fallback", heuristic_table(problem, _limits(_device_key(device))), error)


def warmup(model_or_shapes: Any, group: dist.ProcessGroup | None = None, timeout: float = 600.0,
           num_tokens: int | Iterable[int] | None = None, force: bool = False, *,
           tuner: TuneFn | None = None,
           device: torch.device | None = None,
           split_tuning: bool | None = None) -> dict[GemmProblem, ResolvedConfigs]:
    """Resolve (tuning where needed) the kernel configs of every problem, on every rank alike.

    Call on every rank of ``group`` at one point, outside kernel launches and graph
    capture. Without torch.distributed (or with one rank) this process resolves each
    problem itself. Otherwise rank 0 of ``group`` (default: the world) resolves them (cache,
    shipped, else tune, writing the cache) and publishes the tables; the other ranks never
    tune and install exactly what it sent. A failure on rank 0 leaves every rank on the
    same heuristic configs, with a warning. If rank 0 sends nothing within ``timeout``
    seconds (plus a grace), every rank, rank 0 included once it gets there, takes the
    heuristic with a warning; :class:`WarmupTimeout` only if the store itself stops
    answering (see the module docstring for what is left to torch). On other nodes, local rank 0
    (``LOCAL_RANK``) writes the tables into its node's cache when its key matches.

    With ``split_tuning`` (default: on for CUDA devices with the world group under
    torchrun), the ranks on rank 0's node first tune disjoint shares of the problems on
    their own GPUs (``problems[LOCAL_RANK::LOCAL_WORLD_SIZE]``, written to the shared node
    cache under its file lock), so a node tunes about LOCAL_WORLD_SIZE times faster; rank
    0 then reads every table from the cache (tuning whatever a share failed to deliver)
    and publishes as above, so all ranks still install exactly rank 0's tables.

    Args:
        model_or_shapes: a module whose submodules have ``gemm_problems()``, or problems.
        group: process group whose rank 0 tunes; default the world.
        timeout: seconds rank 0 may wait for cache locks and tuning shares in all; the
            other ranks wait for it that long plus a grace (at most 30 s) to publish. Finite,
            in (0, :data:`MAX_WARMUP_TIMEOUT`]; anything else (NaN, <= 0, inf) raises
            ``ValueError`` on every rank.
        num_tokens: tokens per rank to tune for (int or several); the bucket is the
            power of two nearest tokens x top_k. None: the standard buckets.
        force: retune even if cached (also ``EP_MOE_FORCE_AUTOTUNE=1``).
        tuner: called as ``tuner(problem, limits, buckets)`` on rank 0 to tune what the
            cache lacks; default :class:`~ep_moe.autotune.bench.Tuner` on ``device``.
        device: device to tune on and install for; default the current one.
        split_tuning: spread the tuning over the GPUs of rank 0's node (see above);
            None: on for CUDA, the world group and torchrun's ``LOCAL_WORLD_SIZE`` > 1.

    Returns:
        The installed configs of each problem.
    """
    _check_warmup_timeout(timeout)  # bad input fails on every rank, before any tuning or store call
    problems = collect_problems(model_or_shapes)
    buckets = {p: target_buckets(p, num_tokens) for p in problems}
    force = force or _env_flag(ENV_FORCE)  # read once: split tuning turns force off after the shares
    device = device or default_device()
    dev_key = _device_key(device)
    distributed = dist.is_available() and dist.is_initialized()
    if group is not None and not distributed:
        raise ValueError("warmup: group is given but torch.distributed is not initialized; "
                         "call torch.distributed.init_process_group first or pass group=None")
    if not distributed or dist.get_world_size(group) == 1:
        resolved = {p: _resolve_or_fallback(p, device, b, force, tuner, timeout) for p, b in buckets.items()}
    else:
        if split_tuning is None:
            split_tuning = device.type == "cuda" and group is None
        split = split_tuning and group is None and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
        resolved = _warmup_group(buckets, group, timeout, force, tuner, device, split)
    for p, r in resolved.items():
        _install(p, dev_key, r)
    return resolved


# Warmup calls made so far per group (by its ranks): every rank of a group makes the same
# calls in the same order, so the count names one exchange.
_EXCHANGES: dict[tuple[int, ...], int] = {}


def _exchange_key(ranks: list[int]) -> str:
    count = _EXCHANGES.get(tuple(ranks), 0)
    _EXCHANGES[tuple(ranks)] = count + 1
    group_id = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return f"ep_moe/autotune/warmup/{group_id}/{count}"


def _store_wait(store, keys: list[str], seconds: float) -> None:
    """``store.wait`` with a deadline of ``seconds``, at least 10 ms: a zero timedelta means
    no deadline to FileStore and HashStore."""
    store.wait(keys, datetime.timedelta(seconds=max(seconds, 0.01)))


def _settle(store, key: str, value: dict[str, Any]) -> dict[str, Any]:
    """Set ``key`` to ``value`` unless it holds a value already, and return what it holds:
    the first writer wins (the store's compare-and-set), so every rank reads the same."""
    return json.loads(store.compare_set(key, "", json.dumps(value)))


def _await_root(store, key: str, root: int, timeout: float, grace: float) -> dict[str, Any]:
    """What rank 0 published under ``key``, waited for ``timeout + grace`` seconds. After
    that this rank settles the exchange as timed out, unless rank 0 published first: every
    rank, rank 0 included, then reads the same outcome. :class:`WarmupTimeout` only when the
    store itself does not answer."""
    rank = dist.get_rank()
    try:
        try:
            _store_wait(store, [key], timeout + grace)
            return json.loads(store.get(key))
        except RuntimeError:  # DistStoreError: the wait timed out (or the store is gone: see below)
            gave_up = {"ok": False, "timed_out": True,
                       "error": f"rank {rank} got no configs from rank {root} within timeout={timeout}s "
                                f"(+{grace}s) and gave up for every rank (rank {root} stalled, or its "
                                f"tuning took longer; what it tuned stays in its cache for the next run)"}
            return _settle(store, key, gave_up)
    except RuntimeError as e:
        raise WarmupTimeout(
            f"ep_moe warmup: rank {rank} got no configs from rank {root} within timeout={timeout}s, and "
            f"the job's c10d store does not answer: it is hosted by rank {root} (a tcp:// or env:// "
            f"init outside torchrun), which stalled or died. Launch with torchrun (its agent hosts the "
            f"store), or give init_process_group a shorter timeout while debugging. Cause: {e}") from e


def _warmup_group(buckets, group, timeout, force, tuner, device, split):
    """Rank 0 resolves and publishes JSON in the job's c10d store; the others wait for it
    with ``timeout`` (plus a grace). The store (not a collective on ``group``) carries it, so
    the wait has its own deadline whatever the group's backend, and nothing is pickled.
    Rank 0's result and a peer's timeout are settled by one compare-and-set, so every rank
    takes the same one: rank 0's tables, or the heuristic if any rank gave up first."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    is_root = dist.get_rank() == ranks[0]
    key = _exchange_key(ranks)
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store of init_process_group
    deadline = time.monotonic() + timeout  # rank 0's waits for locks and shares end by it
    tuned_by_shares: set[int] = set()
    if split:
        tuned_by_shares = _tune_node_share(buckets, key, store, is_root, force, tuner, device, deadline)
    if is_root:
        payload = _settle(store, key, _root_payload(buckets, device, force, tuner, deadline, tuned_by_shares))
    else:
        payload = _await_root(store, key, ranks[0], timeout, _publish_grace(timeout))
    if not payload["ok"]:
        reason = payload["error"] if payload.get("timed_out") else f"rank 0 failed ({payload['error']})"
        logger.warning("ep_moe autotune: %s; every rank uses heuristic configs", reason)
        dev = _limits(_device_key(device))
        return {p: ResolvedConfigs("fallback", heuristic_table(p, dev), payload["error"]) for p in buckets}
    resolved = {}
    for item in payload["problems"]:
        problem = GemmProblem(**item["problem"])
        resolved[problem] = ResolvedConfigs.from_dict(item["resolved"])
        if resolved[problem].source == "fallback":
            logger.warning("ep_moe autotune: tuning %s failed on rank 0 (%s); every rank uses "
                           "heuristic configs", problem, resolved[problem].error)
    if not is_root and _is_other_node_leader(payload["host"]):
        _write_node_cache(payload["problems"], device, timeout)
    return resolved


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _tune_node_share(buckets, key, store, is_root, force, tuner, device, deadline) -> set[int]:
    """Split tuning: each rank on rank 0's node tunes ``problems[LOCAL_RANK::LOCAL_WORLD_SIZE]``
    into the node cache and reports which of them it tuned; rank 0 waits for the shares (at
    most ``timeout``; it tunes anything missing itself afterwards) and returns the indices
    of the problems tuned (empty elsewhere). Ranks on other nodes only pass through, and so
    does a rank that does not hear from rank 0 by the deadline."""
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if is_root:
        store.set(f"{key}/host", socket.gethostname())
    else:
        try:
            _store_wait(store, [f"{key}/host"], _left(deadline))
        except RuntimeError:
            return set()  # rank 0 is late: the exchange that follows settles what every rank takes
        if store.get(f"{key}/host").decode() != socket.gethostname():
            return set()
    problems = list(buckets)
    tuned = [i for i in range(local_rank, len(problems), local_world)
             if _resolve_or_fallback(problems[i], device, buckets[problems[i]], force, tuner,
                                     _left(deadline)).source == "tuned"]
    store.set(f"{key}/share/{local_rank}", json.dumps(tuned))
    if not is_root:
        return set()
    shares = [f"{key}/share/{i}" for i in range(local_world)]
    try:
        _store_wait(store, shares, _left(deadline))
    except RuntimeError:
        logger.warning("ep_moe autotune: not every local rank finished its tuning share within "
                       "the timeout; rank 0 tunes what is missing")
    return {i for share in shares if store.check([share]) for i in json.loads(store.get(share))}


def _root_payload(buckets, device, force, tuner, deadline, tuned_by_shares: set[int]) -> dict[str, Any]:
    """What rank 0 publishes: plain JSON-able data, never our objects. Problems a split
    tuning share tuned in this warmup are reported as ``tuned`` (rank 0 reads them back
    from the cache, even with ``force``; it retunes the others)."""
    try:
        dev = _limits(_device_key(device))
        items = []
        for i, (p, b) in enumerate(buckets.items()):
            r = _resolve_or_fallback(p, device, b, force and i not in tuned_by_shares, tuner, _left(deadline))
            if i in tuned_by_shares and r.source == "cache":
                r = dataclasses.replace(r, source="tuned")
            items.append({"problem": asdict(p), "key": make_key(p, dev).to_dict(), "resolved": r.to_dict()})
        return {"ok": True, "host": socket.gethostname(), "problems": items}
    except Exception as e:  # noqa: BLE001 - reported to every rank, which then falls back
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _is_other_node_leader(root_host: str) -> bool:
    return os.environ.get("LOCAL_RANK") == "0" and socket.gethostname() != root_host


def _write_node_cache(items: list[dict[str, Any]], device: torch.device, lock_timeout: float) -> None:
    """Local rank 0 of another node: add rank 0's tables whose key matches this node's to its
    cache (buckets the node has of its own are kept; a lock held ``lock_timeout`` seconds
    skips that file with a warning)."""
    dev = _limits(_device_key(device))
    cache = default_cache()
    for item in items:
        key = CacheKey.from_dict(item["key"])
        resolved = ResolvedConfigs.from_dict(item["resolved"])
        if resolved.source in ("cache", "tuned") and make_key(key.problem(), dev) == key:
            have = cache.load(key) or {}
            if any(have.get(b) != t for b, t in resolved.table.items()):
                cache.merge(key, resolved.table, lock_timeout)
