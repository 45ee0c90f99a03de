"""JSON files of the autotuner: the user cache, shipped configs and model shape presets.

The only module of :mod:`ep_moe.autotune` that touches the file system.

Cache layout: one file per :class:`CacheKey` under ``$EP_MOE_CACHE_DIR`` (default
``~/.cache/ep_moe/autotune/``), named ``<projection>-e<E>-n<N>-k<K>-top<k>-<dtype>-<device>-
<digest>.json`` where the digest hashes every key field. A file holds::

    {"schema_version": 1, "digest": ..., "key": {every CacheKey field},
     "buckets": {"<routed rows>": {"configs": {pass: KernelConfig}, "timings": {pass: [best
                 candidates, fastest first]}, "default_ms": {pass: ms}}},
     "versions": {...}, "write_id": ..., "updated": ...}

Writes go to a temp file in the same directory, are fsynced and ``os.replace``d under a
``filelock.FileLock`` on ``<file>.lock``, so readers never see half a file and need no
lock. A file that fails validation is ignored with a warning and replaced by the next
write. Only regular files are opened, never through a symlink, and at most
:data:`MAX_FILE_BYTES` of one are read: any other entry named like a cache file (a FIFO, a
device, a socket, a directory, a symlink, a larger file) is foreign, skipped with a warning
and never opened, so nothing in the directory can block a reader or exhaust its memory. A
directory that cannot be written turns this cache into an in-memory one, with
one warning. Every wait for a lock is bounded (:data:`DEFAULT_LOCK_TIMEOUT` unless the caller
gives another bound): a lock held longer, by a process tuning that key or one stopped while
holding it, gives :class:`CacheLockTimeout` (``get_or_tune``) or a warning and the
in-memory fallback (``store``, ``merge``). ``clear`` deletes only files this cache wrote
(name and schema, regular files) and their lock files; anything else in the directory is
left alone, and nothing outside it is touched.

Shipped configs are cache files copied into ``ep_moe/autotune/shipped/<device dir>/`` (see
that directory's README), package data, so a wheel carries them; they match on everything but
the torch/triton versions and SM count.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import hashlib
import json
import logging
import os
import re
import socket
import stat
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import filelock
import torch
import triton

from ep_moe import _version
from ep_moe.autotune.space import DeviceLimits, GemmProblem, ModelShape, Table, TunedBucket
from ep_moe.configs import resolve_preset
from ep_moe.kernels.config import PASSES
from ep_moe.kernels.grouped_gemm import KERNEL_VERSION

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Layout version of cache files; files of any other version are ignored."""


ENV_CACHE_DIR = "EP_MOE_CACHE_DIR"
ENV_SHIPPED_DIR = "EP_MOE_SHIPPED_DIR"

MAX_FILE_BYTES = 16 << 20
"""Most bytes read from one file (a file tuned for every bucket holds tens of KiB): a
larger entry is not a cache file and is not read."""

DEFAULT_LOCK_TIMEOUT = 600.0
"""Seconds a wait for a cache file's lock lasts at most unless the caller says otherwise (as
long as :func:`ep_moe.autotune.warmup`'s default timeout): the lock is held while a key is
tuned, which takes minutes on a GPU."""

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
"""Tuned kernel configs shipped with the package (package data), one directory per device."""


@dataclass(frozen=True, kw_only=True)
class CacheKey:
    """Everything that changes the best config of one problem; one cache file per key.

    Checked at construction as :class:`GemmProblem` checks its fields (``ValueError``), so
    that no key puts a path separator, ``..``, NUL or a line break into its file name.
    """

    kernel_version: int
    projection: str
    passes: tuple[str, ...]
    num_local_experts: int
    n: int
    k: int
    top_k: int
    dtype: str
    device_name: str
    num_sms: int
    capability: tuple[int, int]
    triton_version: str
    torch_version: str

    def __post_init__(self) -> None:
        self.problem()  # the problem's fields name the file: ValueError if one is not safe there

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CacheKey":
        """Inverse of :meth:`to_dict` (lists come back as tuples); ``ValueError`` for fields
        no :class:`GemmProblem` may have, ``TypeError`` for fields a key does not have."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def digest(self) -> str:
        """Hash of every field: 16 hex digits of SHA-256 over the canonical JSON."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def stem(self) -> str:
        """Readable part of the file name: the problem, without device or versions."""
        return (f"{self.projection}-e{self.num_local_experts}-n{self.n}-k{self.k}"
                f"-top{self.top_k}-{self.dtype}")

    def file_name(self) -> str:
        """``<stem>-<device>-<digest>.json``."""
        return f"{self.stem()}-{device_dir_name(self.device_name)}-{self.digest()}.json"

    def problem(self) -> GemmProblem:
        """The problem this key was made from."""
        return GemmProblem(projection=self.projection, num_local_experts=self.num_local_experts,
                           n=self.n, k=self.k, top_k=self.top_k, dtype=self.dtype)


def make_key(problem: GemmProblem, dev: DeviceLimits) -> CacheKey:
    """The cache key of ``problem`` on a device with limits ``dev``, for the installed
    torch and triton."""
    return CacheKey(
        kernel_version=KERNEL_VERSION, projection=problem.projection, passes=tuple(PASSES),
        num_local_experts=problem.num_local_experts, n=problem.n, k=problem.k,
        top_k=problem.top_k, dtype=problem.dtype, device_name=dev.name, num_sms=dev.num_sms,
        capability=tuple(dev.capability), triton_version=triton.__version__,
        torch_version=torch.__version__,
    )


def device_dir_name(device_name: str) -> str:
    """File-name-safe form of a device name: ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3``."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", device_name).strip("_") or "unknown"


def cache_dir() -> Path:
    """``$EP_MOE_CACHE_DIR``, else ``~/.cache/ep_moe/autotune``."""
    env = os.environ.get(ENV_CACHE_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ep_moe" / "autotune"


def shipped_dir() -> Path:
    """``$EP_MOE_SHIPPED_DIR``, else the package's :data:`SHIPPED_DIR`."""
    env = os.environ.get(ENV_SHIPPED_DIR)
    return Path(env).expanduser() if env else SHIPPED_DIR


class BadCacheFile(ValueError):
    """A cache file that is not valid JSON of the current schema for the expected key."""


def parse_record(data: Any, key: CacheKey | None = None) -> Table:
    """The table of a decoded cache file; raises :class:`BadCacheFile` saying what is wrong.

    With ``key`` the file must be for exactly that key.
    """
    if not isinstance(data, dict):
        raise BadCacheFile("not a JSON object")
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:  # not True, 1.0 or "1"
        raise BadCacheFile(f"schema_version {version!r}, expected {SCHEMA_VERSION}")
    if not isinstance(data.get("key"), dict):
        raise BadCacheFile("no key object")
    if key is not None and data.get("key") != key.to_dict():
        raise BadCacheFile("its key differs from the expected one (edited or foreign file)")
    buckets = data.get("buckets")
    if not isinstance(buckets, dict) or not buckets:
        raise BadCacheFile("no buckets")
    try:
        table = {int(b): TunedBucket.from_dict(entry) for b, entry in buckets.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BadCacheFile(f"malformed bucket: {e!r}") from None
    if any(b <= 0 for b in table):
        raise BadCacheFile("non-positive bucket")
    return table


def _record(key: CacheKey, table: Table, write_id: str) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "digest": key.digest(),
        "key": key.to_dict(),
        "buckets": {str(b): table[b].to_dict() for b in sorted(table)},
        "versions": {"ep_moe": _version.__version__, "torch": torch.__version__, "triton": triton.__version__},
        "write_id": write_id,
        "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "written_by": f"{socket.gethostname()}:{os.getpid()}",
    }


class ForeignFile(BadCacheFile):
    """An entry the cache does not open: not a regular file (a symlink, FIFO, device, socket
    or directory), or larger than :data:`MAX_FILE_BYTES`."""


def printable(text: str) -> str:
    """``text`` as one printable line: bytes of a file name that are not UTF-8 as ``\\xNN``,
    other characters that are not printable escaped (``\\n``, ``\\x1b``)."""
    return "".join(c if c.isprintable()
                   else f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff"  # os.fsdecode's escapes
                   else c.encode("unicode_escape").decode("ascii") for c in text)


_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(path: Path, mode: int) -> str:
    """What the entry ``path`` of ``mode`` is, for a message: the cache opens regular files only."""
    if stat.S_ISLNK(mode):
        try:
            target = printable(os.readlink(path))
        except OSError:  # gone meanwhile
            target = "?"
        return f"a symlink to {target}: the cache opens regular files only, never through a link"
    what = next((name for is_kind, name in _KINDS if is_kind(mode)), "an odd entry")
    return f"{what}, not a regular file"


def _irregular(path: Path) -> str | None:
    """What ``path`` is, if it exists and is not a regular file (:func:`_not_regular`); else None."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(mode) else _not_regular(path, mode)


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _read_bytes(path: Path) -> bytes | object:
    """The bytes of the regular file ``path``; :data:`_ABSENT` if there is no such entry;
    :class:`ForeignFile` if it is not a regular file or is larger than
    :data:`MAX_FILE_BYTES`; :class:`BadCacheFile` if unreadable.

    Nothing else is opened: the entry is checked with ``lstat`` first, then opened without
    following a symlink and without blocking, and checked again on the open descriptor (an
    entry swapped meanwhile); at most ``MAX_FILE_BYTES + 1`` bytes are read.
    """
    too_large = f"larger than {MAX_FILE_BYTES >> 20} MiB, the most a cache file may have"
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ForeignFile(_not_regular(path, st.st_mode))
        if st.st_size > MAX_FILE_BYTES:
            raise ForeignFile(f"a file of {st.st_size} bytes, {too_large}")
        with open(os.open(path, _OPEN_FLAGS), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ForeignFile(_not_regular(path, mode))
            data = f.read(MAX_FILE_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return _ABSENT
    except OSError as e:
        raise BadCacheFile(f"unreadable: {e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ForeignFile(f"a file {too_large}")
    return data


_ABSENT = object()
"""What :func:`_read_json` returns for a file that does not exist (a file may hold ``null``)."""


def _refuse_constant(name: str) -> None:
    raise BadCacheFile(f"holds {name}, which is not JSON (a NaN or infinite timing)")


def _read_json(path: Path) -> Any:
    """Decoded JSON of the regular file ``path`` (read by :func:`_read_bytes`);
    :data:`_ABSENT` if there is no such file; :class:`ForeignFile` or :class:`BadCacheFile`
    if it is not one the cache opens, unreadable, or not strict JSON (``NaN`` and
    ``Infinity`` are not JSON)."""
    raw = _read_bytes(path)
    if raw is _ABSENT:
        return _ABSENT
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise BadCacheFile(f"unreadable: {e}") from None
    except BadCacheFile:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an over-long number, too deep nesting
        raise BadCacheFile(f"not valid JSON (truncated or corrupt): {e}") from None


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


TuneBuckets = Callable[[tuple[int, ...]], Table]
"""Tunes the given buckets of one key's problem and returns their table."""


class CacheLockTimeout(RuntimeError):
    """A cache file's lock stayed held longer than the caller's bound (not an OSError: the
    directory is fine, another process holds the lock)."""


class CacheDirError(RuntimeError):
    """The cache directory cannot be listed: it is a file, or unreadable."""


@dataclass(frozen=True)
class CacheEntry:
    """One file of a cache directory as ``ep-moe cache list`` shows it.

    ``kind`` is ``"cache"`` (a valid file of this cache), ``"invalid"`` (a regular file named
    like one but not valid) or ``"foreign"`` (not named like a cache file, or named like one
    or its lock file but not a regular file of at most :data:`MAX_FILE_BYTES`: never
    opened); ``detail`` says why for the last two.
    """

    path: Path
    kind: str
    detail: str = ""
    record: dict[str, Any] | None = None


@dataclass
class ClearReport:
    """What :meth:`ConfigCache.clear` did: files removed, files left alone (and why), and
    files it could not remove (and the error)."""

    removed: list[Path] = dataclasses.field(default_factory=list)
    kept: list[tuple[Path, str]] = dataclasses.field(default_factory=list)
    failed: list[tuple[Path, str]] = dataclasses.field(default_factory=list)


_FILE_NAME = re.compile(r"(gate_up|down)-e\d+-n\d+-k\d+-top\d+-\w+-[A-Za-z0-9._]+-[0-9a-f]{16}\.json")
"""Names of the files :meth:`CacheKey.file_name` makes."""

LOCK_SUFFIX = ".lock"


def is_cache_file_name(name: str) -> bool:
    """Whether ``name`` has the form of a cache file's name."""
    return _FILE_NAME.fullmatch(name) is not None


def _is_lock_name(name: str) -> bool:
    return name.endswith(LOCK_SUFFIX) and is_cache_file_name(name.removesuffix(LOCK_SUFFIX))


def _locked_message(lock_path: str, timeout: float) -> str:
    return (f"{lock_path} stayed locked for {timeout:g}s: another process is tuning this key, or "
            f"holds the lock while stopped or hung; let it finish, or stop it (a lock goes with "
            f"the process that holds it)")


def check_lock_timeout(timeout: float) -> None:
    """``ValueError`` unless ``timeout`` is a bound for a wait for a cache lock: finite seconds >= 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(f"lock_timeout={timeout!r}: give seconds >= 0 (a wait for a cache lock is "
                         f"always bounded)")


def _acquire(lock_path: str, timeout: float) -> filelock.FileLock:
    """The acquired lock of ``lock_path``, waiting at most ``timeout`` seconds (else
    :class:`CacheLockTimeout`). Every wait for a cache lock goes through here: none is
    unbounded, and a lock file that is not a regular file (a FIFO, a symlink) is never
    opened (``OSError``)."""
    check_lock_timeout(timeout)
    why = _irregular(Path(lock_path))
    if why is not None:
        raise OSError(f"the lock file {printable(lock_path)} is {why}; remove it")
    lock = filelock.FileLock(lock_path, timeout=timeout)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise CacheLockTimeout(_locked_message(lock_path, timeout)) from None
    return lock


def _checked(tuned: Any, buckets: tuple[int, ...]) -> Table:
    """``tuned`` if it is a table covering ``buckets``; else ``ValueError`` (nothing is written)."""
    if (not isinstance(tuned, dict) or not set(buckets) <= tuned.keys()
            or not all(isinstance(v, TunedBucket) for v in tuned.values())):
        raise ValueError(f"the tuner returned {type(tuned).__name__} "
                         f"{sorted(tuned) if isinstance(tuned, dict) else ''}: expected a table "
                         f"(bucket -> TunedBucket) covering the buckets {list(buckets)}")
    return tuned


class ConfigCache:
    """The tuned configs of one cache directory, falling back to memory if unwritable."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._memory: dict[str, Table] = {}
        self._memory_only = False

    @property
    def memory_only(self) -> bool:
        """True once the directory proved unwritable: tables live in this process only."""
        return self._memory_only

    def path(self, key: CacheKey) -> Path:
        """File of ``key`` (may not exist)."""
        return self.directory / key.file_name()

    def _read(self, key: CacheKey) -> tuple[Table, str | None] | None:
        """(table, write id) of ``key`` from memory or file; None if absent or invalid."""
        if key.digest() in self._memory:
            return self._memory[key.digest()], None
        path = self.path(key)
        try:
            data = _read_json(path)
            if data is _ABSENT:
                return None
            return parse_record(data, key), data.get("write_id")
        except ForeignFile as e:
            logger.warning("ep_moe autotune cache: ignoring %s: %s", path, e)
            return None
        except BadCacheFile as e:
            logger.warning("ep_moe autotune cache: ignoring %s: %s; it will be replaced", path, e)
            return None

    def load(self, key: CacheKey) -> Table | None:
        """The stored table of ``key``, or None (absent, or invalid: warned and ignored)."""
        found = self._read(key)
        return found[0] if found else None

    def store(self, key: CacheKey, table: Table, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        """Write ``table`` as the whole record of ``key`` (atomic, under the key's lock).

        A lock held longer than ``lock_timeout`` seconds leaves the file as it is: the table
        is kept in memory for this process, with a warning.
        """
        try:
            lock = self._lock(key, lock_timeout)
        except CacheLockTimeout as e:
            logger.warning("ep_moe autotune cache: %s; not written, kept in memory for this process", e)
            self._memory[key.digest()] = dict(table)
            return
        if lock is None:
            self._memory[key.digest()] = dict(table)
            return
        try:
            self._write(key, table)
        finally:
            lock.release()

    def merge(self, key: CacheKey, table: Table, lock_timeout: float) -> bool:
        """Add ``table``'s buckets to what the file of ``key`` holds (re-read under the key's
        lock, so buckets another process wrote are kept). Gives up with a warning when the
        lock stays held ``lock_timeout`` seconds; returns whether it wrote."""
        try:
            lock = self._lock(key, lock_timeout)
        except CacheLockTimeout as e:
            logger.warning("ep_moe autotune cache: %s; not updated", e)
            return False
        try:
            now = self._read(key)
            merged = {**(now[0] if now else {}), **table}
            if lock is None:
                self._memory[key.digest()] = merged
            else:
                self._write(key, merged)
            return True
        finally:
            if lock is not None:
                lock.release()

    def _write(self, key: CacheKey, table: Table) -> None:
        """Atomic write (caller holds the lock); an OSError switches to memory-only."""
        # never NaN or Infinity, which no strict JSON reader takes (TunedBucket refuses them already)
        text = json.dumps(_record(key, table, uuid.uuid4().hex), indent=1, sort_keys=True, allow_nan=False)
        try:
            _write_atomic(self.path(key), text)
        except OSError as e:
            self._go_memory_only(e)
            self._memory[key.digest()] = dict(table)

    def _go_memory_only(self, error: OSError) -> None:
        if not self._memory_only:
            logger.warning("ep_moe autotune cache: cannot write to %s (%s); tuned configs are "
                           "kept in memory for this process only. Set %s to a writable directory.",
                           self.directory, error, ENV_CACHE_DIR)
        self._memory_only = True

    def _lock(self, key: CacheKey, timeout: float) -> filelock.FileLock | None:
        """The acquired file lock of ``key``; None in memory-only mode (an unwritable
        directory); :class:`CacheLockTimeout` after ``timeout`` seconds."""
        if self._memory_only:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return _acquire(str(self.path(key)) + LOCK_SUFFIX, timeout)
        except OSError as e:
            self._go_memory_only(e)
            return None

    def get_or_tune(self, key: CacheKey, buckets: Iterable[int], tune: TuneBuckets, *,
                    force: bool = False, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> tuple[Table, str]:
        """The table of ``key`` covering ``buckets``, tuning what is missing: (table, source).

        Single flight: tuning runs under the key's file lock, and the file is re-read once
        the lock is held, so a process that waited on another one tuning the same key reads
        its result (source ``"cache"``) instead of tuning again. ``force`` retunes
        ``buckets`` unless another process rewrote the file while this one waited.
        ``lock_timeout`` seconds bound that wait (:class:`CacheLockTimeout`).
        """
        want = tuple(sorted(set(buckets)))
        before = self._read(key)
        if not force and before and set(want) <= before[0].keys():
            return before[0], "cache"
        lock = self._lock(key, lock_timeout)
        try:
            now = self._read(key)
            # Written by another process while this one waited for the lock?
            fresh = now is not None and now[1] is not None and (before is None or now[1] != before[1])
            if now and set(want) <= now[0].keys() and (fresh or not force):
                return now[0], "cache"
            old = now[0] if now else {}
            missing = want if force else tuple(b for b in want if b not in old)
            table = {**old, **_checked(tune(missing), missing)}
            if lock is None:
                self._memory[key.digest()] = table
            else:
                self._write(key, table)
            return table, "tuned"
        finally:
            if lock is not None:
                lock.release()

    def _names(self) -> list[str]:
        """Names in the directory (none if it does not exist); :class:`CacheDirError` if it
        is not a directory or cannot be listed."""
        try:
            return sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            what = "is a file" if self.directory.exists() else "lies under a file"
            raise CacheDirError(f"the cache directory {self.directory} {what}, not a directory; "
                                f"move that file away, or set {ENV_CACHE_DIR} to a directory") from None
        except OSError as e:
            raise CacheDirError(f"cannot list the cache directory {self.directory}: {e.strerror or e}; "
                                f"check its permissions, or set {ENV_CACHE_DIR} to another directory") from None

    def entries(self) -> list[CacheEntry]:
        """Every entry of the directory but hidden (temp) files and regular lock files,
        classified (see :class:`CacheEntry`); :class:`CacheDirError` if the directory cannot
        be listed."""
        found = []
        for name in self._names():
            if name.startswith("."):
                continue
            path = self.directory / name
            if _is_lock_name(name):
                why = _irregular(path)
                if why is not None:
                    found.append(CacheEntry(path, "foreign", why))
                continue
            if not is_cache_file_name(name):
                found.append(CacheEntry(path, "foreign", "not an ep_moe cache file (not named like one)"))
                continue
            try:
                found.append(CacheEntry(path, "cache", record=_load_record(path)))
            except ForeignFile as e:
                found.append(CacheEntry(path, "foreign", str(e)))
            except BadCacheFile as e:
                found.append(CacheEntry(path, "invalid", str(e)))
        return found

    def files(self) -> list[Path]:
        """Regular files named like cache files (valid or not), sorted by name; none if the
        directory does not exist or is not one."""
        try:
            return [e.path for e in self.entries() if e.kind != "foreign"]
        except CacheDirError:
            return []

    def find(self, name: str) -> Path | None:
        """A cache file by file name, digest, or unique prefix of either."""
        files = self.files()
        exact = [p for p in files if name in (p.name, p.stem, p.stem.rsplit("-", 1)[-1])]
        if exact:
            return exact[0]
        prefix = [p for p in files if p.name.startswith(name) or p.stem.rsplit("-", 1)[-1].startswith(name)]
        return prefix[0] if len(prefix) == 1 else None

    def clear(self, lock_timeout: float = 10.0) -> ClearReport:
        """Delete the files this cache wrote: each valid cache file (name and schema; a
        regular file), under its lock, with its lock file and any temp file a killed writer
        left. Anything else is left alone and reported (foreign or invalid entries: symlinks,
        FIFOs and the like are never opened or followed; a file locked longer than
        ``lock_timeout`` seconds, being tuned). Lock files of absent cache files go too, when
        free and regular files. :class:`CacheDirError` if the directory cannot be listed."""
        report = ClearReport()
        for entry in self.entries():
            if entry.kind != "cache":
                report.kept.append((entry.path, f"{entry.kind}: {entry.detail}"))
                continue
            try:
                self._remove(entry.path, lock_timeout)
                report.removed.append(entry.path)
            except CacheLockTimeout:
                report.kept.append((entry.path, f"locked for {lock_timeout:g}s (being tuned?)"))
            except OSError as e:
                report.failed.append((entry.path, f"{type(e).__name__}: {e.strerror or e}"))
        for name in self._names():
            orphan = self.directory / name.removesuffix(LOCK_SUFFIX)
            if _is_lock_name(name) and not os.path.lexists(orphan):
                try:
                    self._remove(orphan, 0)
                except (CacheLockTimeout, OSError):
                    pass  # held (a key being tuned), not removable or not a regular file: harmless
        self._memory.clear()
        return report

    def _remove(self, path: Path, lock_timeout: float) -> None:
        """Delete ``path``, its writers' leftover temp files and its lock file, holding the
        lock (so no writer is between its temp file and ``os.replace``)."""
        lock_path = str(path) + LOCK_SUFFIX
        lock = _acquire(lock_path, lock_timeout)
        try:
            path.unlink(missing_ok=True)
            for tmp in self.directory.glob(f".{glob.escape(path.name)}.*.tmp"):
                tmp.unlink(missing_ok=True)
            Path(lock_path).unlink(missing_ok=True)
        finally:
            lock.release()


def _load_record(path: Path) -> dict[str, Any]:
    """The decoded record of the cache file ``path``; :class:`ForeignFile` if it is not a
    regular file the cache opens, :class:`BadCacheFile` if it is unreadable, not valid JSON
    of the current schema, or holds another key than its name says (a copy of another
    key's file)."""
    data = _read_json(path)
    if data is _ABSENT:
        raise BadCacheFile("gone")
    parse_record(data)
    try:
        named = CacheKey.from_dict(data["key"]).file_name()
    except TypeError as e:
        raise BadCacheFile(f"its key has other fields than a cache key: {e}") from None
    except ValueError as e:
        raise BadCacheFile(f"its key is not a valid cache key: {e}") from None
    if named != path.name:
        raise BadCacheFile(f"holds the key of {named}, not of its own name")
    return data


def read_file(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(decoded record, None) of a cache file, or (None, what is wrong with it): not a
    regular file, unreadable, not valid JSON of the current schema, or holding another key
    than its name says."""
    try:
        return _load_record(path), None
    except BadCacheFile as e:
        return None, str(e)


_CACHES: dict[Path, ConfigCache] = {}


def default_cache() -> ConfigCache:
    """The :class:`ConfigCache` of :func:`cache_dir`, one per directory per process."""
    directory = cache_dir()
    if directory not in _CACHES:
        _CACHES[directory] = ConfigCache(directory)
    return _CACHES[directory]


_SHIPPED_IGNORED = ("num_sms", "triton_version", "torch_version")


def load_shipped(key: CacheKey) -> Table | None:
    """Shipped table for ``key`` from ``shipped_dir()/<device dir>/``, matching every key
    field but the torch/triton versions and SM count; None if there is none."""
    directory = shipped_dir() / device_dir_name(key.device_name)
    want = {k: v for k, v in key.to_dict().items() if k not in _SHIPPED_IGNORED}
    for path in sorted(directory.glob(f"{key.stem()}-*.json")):
        try:
            data = _read_json(path)
            table = parse_record(data)
        except BadCacheFile as e:
            logger.warning("ep_moe shipped configs: ignoring %s: %s", path, e)
            continue
        have = data.get("key") or {}
        if {k: have.get(k) for k in want} == want:
            return table
    return None


def load_model_shape(name_or_file: str) -> ModelShape:
    """A model's MoE shape from a JSON file path or the name of a preset shipped in
    ``ep_moe/configs/models/`` (:func:`ep_moe.configs.resolve_preset`)."""
    path = resolve_preset("models", name_or_file, f"model {name_or_file!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"model file {path}: not valid JSON: {e}") from None
    return ModelShape.from_dict(data)
