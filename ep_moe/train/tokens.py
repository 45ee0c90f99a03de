"""Text data for the trainer: finding the documents, tokenizing them once, caching the ids.

A text source (``data.path`` or ``data.eval_path`` when it is not a token file) is one of:

- a text file (``.txt``, ``.md``, any suffix not a token file's): one document;
- a ``.jsonl`` file: one JSON object per line, the document under ``data.text_field``;
- a folder: every ``.txt`` and ``.jsonl`` file under it, recursively, in sorted order;
- a glob pattern (``data/*.jsonl``, ``shards/**/*.txt``): its matches, sorted;
- a folder written by ``datasets``' ``save_to_disk`` (it holds ``state.json``, or
  ``dataset_dict.json`` for a ``DatasetDict``, whose ``"train"`` split is read): one
  document per row, the text in column ``data.text_field``.

Without a tokenizer (the built-in byte-level model) the tokens are the UTF-8 bytes of the
documents, joined with ``b"\\n"``; a single text file is exactly its bytes. This is cheap
and is done in memory on every run.

With a Hugging Face tokenizer the documents are tokenized once, each followed by the
tokenizer's EOS id, into a token cache: ``<key>.tokens`` (raw uint16 ids when the
vocabulary fits, else uint32, native byte order), ``<key>.starts`` (raw int64 offset of
each document's first token) and ``<key>.json`` (counts, the largest id, the inputs),
written to temporary files and renamed, the JSON last. The key hashes the tokenizer
(its serialized state and EOS id), ``data.text_field``, a format version and every input
file's resolved path, size and mtime, so a changed file or tokenizer gets a new entry and a
second run with the same inputs reads the old one. Entries live in ``data.cache_dir``,
by default next to the data (``<file>.ep_moe-tokens/`` beside a file,
``<folder>/.ep_moe-tokens/`` inside a folder, in the fixed leading folder of a glob), or
in ``~/.cache/ep_moe/tokens`` when that cannot be written. Old entries are never deleted;
remove the folder to reclaim them.

torchrun starts every rank at once and each builds its data before any process group
exists, so the cache takes a ``filelock.FileLock`` per entry: the first rank tokenizes,
the others wait on the lock and then read the finished entry. The training ids are
memory-mapped from the cache, never read whole; a :class:`MappedFile` keeps the mapped file
open, so that a cache truncated while the run reads it is named in a ``DataError`` (the
trainer checks at the start and before each epoch) rather than killing the process with
SIGBUS.

A text file is read in pieces of about 1 MiB, each cut before a line that starts with a
non-space character (a word boundary for common tokenizers), so a file of any size
tokenizes in bounded memory; a file below that size is tokenized whole.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import tempfile
from array import array
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import filelock
import torch
from tqdm import tqdm

from ep_moe.train.errors import DataError

logger = logging.getLogger("ep_moe.train.data")

TOKEN_SUFFIXES = {".bin": "uint16", ".u16": "uint16", ".u32": "uint32", ".i32": "int32"}
"""Suffixes of flat token files and their id type; any other file is text."""
TEXT_SUFFIXES = (".txt", ".jsonl")
"""The files a folder contributes."""
CACHE_FOLDER = ".ep_moe-tokens"
"""The cache folder's name inside a data folder."""
CACHE_VERSION = 1
"""Part of every cache key: bump it when the cache layout or the tokenization changes."""
PIECE_BYTES = 1 << 20
"""A text file is tokenized in pieces of about this many bytes."""
BATCH_PIECES = 1000
BATCH_BYTES = 16 << 20
"""One ``encode_batch`` call takes up to this many pieces or bytes of text."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja")
"""Files of a Hugging Face tokenizer, any of which a model folder may hold."""
_ARRAY_CODES = {"uint16": "H", "uint32": "I"}
_TORCH_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


def _fallback_cache_dir() -> Path:
    """Where token caches go when the data's own folder cannot be written."""
    return Path.home() / ".cache" / "ep_moe" / "tokens"


# --- memory-mapped files ----------------------------------------------------------------

class MappedFile:
    """A file the run memory-maps (a token file, or a token cache), held open so that its
    size can be checked against the length mapped: reading a page past the end of a file
    that shrank raises SIGBUS, which kills the process without naming the file.

    The descriptor is of the mapped inode (opened just before the mapping), so a file
    replaced by a rename (the old inode stays mapped and whole) is no problem; one
    truncated or rewritten in place is.
    """

    def __init__(self, path: Path, nbytes: int, what: str, fix: str) -> None:
        """``nbytes``: the length that will be mapped; ``what``: the file as messages name it
        (the data option first); ``fix``: what to do when it shrank."""
        self.path = Path(path)
        self.nbytes = nbytes
        self.what = what
        self.fix = fix
        self._fd: Optional[int] = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def problem(self) -> Optional[str]:
        """Why reading the mapping would fail (the file shrank below the mapped length), or None."""
        if self._fd is None:
            return None
        size = os.fstat(self._fd).st_size
        if size >= self.nbytes:
            return None
        return (f"{self.what} shrank to {size} bytes while the run used it, below the {self.nbytes} bytes mapped "
                f"at its start (truncated or rewritten in place); reading past its end would kill the process "
                f"(SIGBUS): {self.fix}")

    def check(self) -> None:
        """Raise a ``DataError`` naming the file when it shrank below the mapped length."""
        problem = self.problem()
        if problem is not None:
            raise DataError(problem)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"MappedFile({str(self.path)!r}, {self.nbytes} bytes)"


# --- the tokenizer ----------------------------------------------------------------------

class TextTokenizer:
    """A Hugging Face tokenizer as the data pipeline uses it: plain ids, no special tokens."""

    def __init__(self, hf_tokenizer: Any, name: str) -> None:
        """``name``: where it was loaded from, for messages."""
        self.hf = hf_tokenizer
        self.name = name

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, without BOS/EOS or other added special tokens."""
        return self.hf(list(texts), add_special_tokens=False, return_attention_mask=False,
                       verbose=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""
        return self.hf.decode(list(ids))

    @property
    def eos_id(self) -> int:
        """The id that ends every document in the token stream."""
        eos = self.hf.eos_token_id
        if eos is None:
            raise DataError(f"the tokenizer in {self.name!r} has no EOS token, which separates the documents "
                            f"of text data: set eos_token in its tokenizer_config.json, or pass a token file")
        return int(eos)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return len(self.hf)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of everything that decides the ids: the serialized tokenizer and its EOS id."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        state = backend.to_str() if backend is not None else json.dumps(sorted(self.hf.get_vocab().items()))
        return hashlib.sha256(f"{type(self.hf).__name__}\n{state}\n{self.eos_id}".encode()).hexdigest()[:16]


def tokenizer_files(folder: str) -> list[str]:
    """The tokenizer files in the HF folder ``folder`` (none: it has no tokenizer, and
    transformers' ``AutoTokenizer`` would build an empty one of the family's class)."""
    return [name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]


def load_tokenizer(model_dir: str) -> TextTokenizer:
    """The tokenizer saved in ``model_dir`` (``AutoTokenizer.from_pretrained``)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("text data for a Hugging Face model needs transformers: "
                        "pip install 'ep-moe[transformers]', or pass a token file") from None
    folder = Path(model_dir)
    if folder.is_dir() and not tokenizer_files(model_dir):
        raise DataError(f"model.hf={model_dir!r} holds no tokenizer files (tokenizer.json, tokenizer_config.json): "
                        f"text data needs the model's tokenizer there (tokenizer.save_pretrained({model_dir!r})), "
                        f"or pass a token file as data.path")
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"the tokenizer in model.hf={model_dir!r} cannot be loaded ({reason}): save a working "
                        f"one there with tokenizer.save_pretrained, or pass a token file as data.path") from None
    return TextTokenizer(hf_tokenizer, model_dir)


# --- finding the documents --------------------------------------------------------------

@dataclass(frozen=True)
class TextSource:
    """The documents named by one data option."""

    option: str
    """``"data.path"`` or ``"data.eval_path"``."""
    spec: str
    """The option's value: a file, folder or glob pattern."""
    files: tuple[tuple[Path, str], ...]
    """Each input file and how it is read (``"text"`` or ``"jsonl"``); for a dataset, the
    files of its folder (``"dataset"``), which only key the cache."""
    dataset: Optional[Path]
    """A ``save_to_disk`` folder, read with ``datasets.load_from_disk``."""
    home: Path
    """The default cache location, next to the data."""

    @property
    def name(self) -> str:
        """The option and its value, as error messages start."""
        return f"{self.option}={self.spec!r}"


def _is_glob(spec: str) -> bool:
    return any(ch in spec for ch in "*?[")


def _glob_home(spec: str) -> Path:
    """The leading folders of a pattern, up to its first component with a wildcard."""
    fixed = []
    for part in Path(spec).parts[:-1]:
        if _is_glob(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _read_as(file: Path, fmt: str) -> str:
    if fmt in ("text", "jsonl"):
        return fmt
    return "jsonl" if file.suffix.lower() == ".jsonl" else "text"


def find_text_source(spec: str, option: str, fmt: str) -> TextSource:
    """Resolve a data option that is not a token file into its documents' files; raise a
    ``DataError`` naming the option when it names nothing readable."""
    path = Path(spec)
    name = f"{option}={spec!r}"
    if fmt in TOKEN_SUFFIXES.values():
        raise DataError(f"{name} is not a file: data.format={fmt!r} reads one flat token file")
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            # Every file of the folder keys the cache, except the cache's own.
            files = tuple((f, "dataset") for f in sorted(path.rglob("*"))
                          if f.is_file() and CACHE_FOLDER not in f.relative_to(path).parts)
            return TextSource(option, spec, files, path, path / CACHE_FOLDER)
        found = sorted(f for f in path.rglob("*") if f.suffix.lower() in TEXT_SUFFIXES and f.is_file())
        if not found:
            raise DataError(f"{name} is a folder without .txt or .jsonl files (searched recursively): "
                            f"put the text there, or pass a file or a glob pattern")
        files, home = tuple((f, _read_as(f, fmt)) for f in found), path / CACHE_FOLDER
    elif path.is_file():
        files, home = ((path, _read_as(path, fmt)),), path.with_name(path.name + CACHE_FOLDER)
    elif _is_glob(spec):
        found = sorted(Path(m) for m in glob.glob(spec, recursive=True) if Path(m).is_file())
        if not found:
            raise DataError(f"{name} matches no file: check the pattern (quote it so the shell leaves it alone)")
        tokens = [f for f in found if f.suffix.lower() in TOKEN_SUFFIXES]
        if tokens and fmt == "auto":
            raise DataError(f"{name} matches token file {str(tokens[0])!r}: a glob reads text and .jsonl files; "
                            f"pass one token file, or set data.format='text' to read the matches as text")
        files, home = tuple((f, _read_as(f, fmt)) for f in found), _glob_home(spec) / CACHE_FOLDER
    else:
        raise DataError(f"{name} is not a file, a folder or a glob pattern with matches: pass a text, .jsonl or "
                        f"token file, a folder of .txt/.jsonl files, or a pattern such as 'data/*.jsonl'")
    for file, _ in files:
        if file.stat().st_size == 0:
            if file == path:
                raise DataError(f"{name} is empty (0 bytes): pass a file that holds text")
            raise DataError(f"{name}: {str(file)!r} is empty (0 bytes): fill it or remove it")
    return TextSource(option, spec, files, None, home)


# --- reading the documents --------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """Part of a document: a whole one, or a slice of a large text file."""

    text: str
    first: bool
    """It starts a document."""
    last: bool
    """It ends a document."""
    progress: int
    """How far it moves the progress bar: bytes of a file, or one dataset row."""


def _open(file: Path, source: TextSource):
    try:
        return open(file, "rb")
    except OSError as exc:
        raise DataError(f"{source.name}: {str(file)!r} cannot be read ({exc.strerror}): fix its permissions, "
                        f"or leave it out") from None


def _cut(data: bytes) -> int:
    """Where a piece of text ends: after the last newline that a non-space byte follows
    (0: none yet)."""
    end = len(data) - 1
    while (newline := data.rfind(b"\n", 0, end)) >= 0:
        if data[newline + 1] not in b" \t\r\n\x0b\x0c":
            return newline + 1
        end = newline
    return 0


def _text_pieces(file: Path, source: TextSource, errors: str) -> Iterator[_Piece]:
    """A text file as one document, in pieces of about ``PIECE_BYTES``. ``errors``: how
    bytes that are not UTF-8 decode (``"strict"`` raises a ``DataError``)."""
    with _open(file, source) as f:
        pending, first, offset = b"", True, 0
        while True:
            block = f.read(PIECE_BYTES)
            pending += block
            end = _cut(pending) if block else len(pending)
            if end or not block:
                try:
                    text = pending[:end].decode("utf-8", errors)
                except UnicodeDecodeError as exc:
                    raise DataError(f"{source.name}: {str(file)!r} is not UTF-8 text (byte {offset + exc.start}): "
                                    f"convert it to UTF-8, or if it holds token ids set data.format") from None
                yield _Piece(text, first, not block, end)
                pending, first, offset = pending[end:], False, offset + end
            if not block:
                return


def _jsonl_pieces(file: Path, source: TextSource, field: str) -> Iterator[_Piece]:
    """A ``.jsonl`` file: each non-blank line one document, its text under ``field``."""
    fix = f"each line must be a JSON object holding the text under data.text_field={field!r}"
    documents = 0
    with _open(file, source) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{source.name}: {file}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where} is not JSON ({exc.msg}): {fix}") from None
            except UnicodeDecodeError:
                raise DataError(f"{where} is not UTF-8: {fix}") from None
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{where} has no key data.text_field={field!r} (it holds {keys or 'nothing'}): "
                                f"set data.text_field to the key that holds the text")
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"{where}: data.text_field={field!r} is not a string but {type(text).__name__}: "
                                f"set data.text_field to the key that holds the text")
            documents += 1
            yield _Piece(text, True, True, len(line))
    if not documents:
        raise DataError(f"{source.name}: {str(file)!r} holds no documents (only blank lines): {fix}")


def _load_dataset(source: TextSource, field: str) -> Any:
    """The ``save_to_disk`` folder of ``source`` as a ``datasets.Dataset`` (a ``DatasetDict``'s
    ``"train"`` split), checked to hold rows with a ``field`` column."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{source.name} is a Hugging Face datasets folder (save_to_disk), which needs the "
                        f"datasets package: pip install datasets") from None
    try:
        dataset = datasets.load_from_disk(str(source.dataset))
    except (OSError, ValueError) as exc:
        raise DataError(f"{source.name} cannot be loaded with datasets.load_from_disk ({exc}): "
                        f"save it again with save_to_disk") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(f"{source.name} holds the splits {sorted(dataset)} but no 'train': pass the folder "
                            f"of one split, or save the training split as 'train'")
        dataset = dataset["train"]
    if field not in dataset.column_names:
        raise DataError(f"{source.name} has no column data.text_field={field!r} (columns: "
                        f"{', '.join(dataset.column_names)}): set data.text_field to the text column")
    if len(dataset) == 0:
        raise DataError(f"{source.name} holds no rows: pass a dataset with documents")
    return dataset


def _dataset_pieces(source: TextSource, field: str) -> Iterator[_Piece]:
    """Each row of the dataset one document, its text in column ``field``."""
    row = 0
    for rows in _load_dataset(source, field).iter(batch_size=BATCH_PIECES):
        for text in rows[field]:
            if not isinstance(text, str):
                raise DataError(f"{source.name}: row {row} of column data.text_field={field!r} is not a string "
                                f"but {type(text).__name__}: set data.text_field to the text column")
            row += 1
            yield _Piece(text, True, True, 1)


def _pieces(source: TextSource, field: str, errors: str = "strict") -> Iterator[_Piece]:
    """Every document of ``source`` in order, in pieces."""
    if source.dataset is not None:
        yield from _dataset_pieces(source, field)
        return
    for file, kind in source.files:
        if kind == "jsonl":
            yield from _jsonl_pieces(file, source, field)
        else:
            yield from _text_pieces(file, source, errors)


def _progress_total(source: TextSource) -> tuple[Optional[int], str]:
    """The progress bar's total and unit: bytes of the files, or rows of a dataset (a count
    without a total: the dataset is opened only once, by the reader)."""
    if source.dataset is not None:
        return None, "docs"
    return sum(file.stat().st_size for file, _ in source.files), "B"


def _describe(source: TextSource, documents: int, tokens: str) -> str:
    """What a source held, for logs."""
    files = "a dataset" if source.dataset is not None else f"{len(source.files)} file(s)"
    return f"{source.name}: {files}, {documents} documents, {tokens}"


# --- token streams ------------------------------------------------------------------------

@dataclass(frozen=True)
class TextTokens:
    """The token stream of a text source."""

    tokens: torch.Tensor
    """[S] ids: the documents in order (bytes joined by ``\\n``, or ids each ending in EOS)."""
    starts: torch.Tensor
    """[D] int64: where each document's first token is."""
    vocab_size: int
    """Largest id + 1 (256 for bytes)."""
    description: str
    """What was read, for logs."""
    mapped: tuple[MappedFile, ...] = ()
    """The memory-mapped files ``tokens`` reads (the token cache), to check while training."""


def byte_tokens(source: TextSource, field: str) -> TextTokens:
    """The UTF-8 bytes of the documents joined by ``b"\\n"``; a single text file is exactly
    its bytes (not-UTF-8 bytes included)."""
    data, starts = bytearray(), []
    for piece in _pieces(source, field, errors="surrogateescape"):
        if piece.first:
            if starts:
                data += b"\n"
            starts.append(len(data))
        data += piece.text.encode("utf-8", "surrogateescape")
    if not data:
        raise DataError(f"{source.name} holds only empty documents: pass some text")
    return TextTokens(torch.frombuffer(data, dtype=torch.uint8), torch.tensor(starts, dtype=torch.int64), 256,
                      _describe(source, len(starts), f"{len(data)} bytes"))


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _cache_folder(source: TextSource, cache_dir: str) -> Path:
    """``data.cache_dir``, else next to the data, else (with a warning) the fallback."""
    if cache_dir:
        folder = Path(cache_dir).expanduser()
        if not _writable(folder):
            raise DataError(f"data.cache_dir={cache_dir!r} cannot be written: pass a writable folder, or '' for "
                            f"the default next to the data")
        return folder
    if _writable(source.home):
        return source.home
    fallback = _fallback_cache_dir()
    logger.warning("cannot write the token cache next to the data (%s); using %s (set data.cache_dir to choose)",
                   source.home, fallback)
    if not _writable(fallback):
        raise DataError(f"{source.name}: neither {str(source.home)!r} nor {str(fallback)!r} can be written for the "
                        f"token cache: set data.cache_dir to a writable folder")
    return fallback


def _cache_key(source: TextSource, tokenizer: TextTokenizer, field: str) -> dict[str, Any]:
    """Everything the cached ids depend on."""
    files = []
    for file, kind in source.files:
        stat = file.stat()
        files.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns, kind])
    return {"version": CACHE_VERSION, "tokenizer": tokenizer.fingerprint, "eos_id": tokenizer.eos_id,
            "text_field": field, "files": files}


@dataclass(frozen=True)
class _Entry:
    """The files of one cache entry."""

    stem: Path

    @property
    def tokens(self) -> Path:
        return self.stem.with_suffix(".tokens")

    @property
    def starts(self) -> Path:
        return self.stem.with_suffix(".starts")

    @property
    def meta(self) -> Path:
        return self.stem.with_suffix(".json")

    @property
    def lock(self) -> Path:
        return self.stem.with_suffix(".lock")

    def read_meta(self) -> Optional[dict[str, Any]]:
        """The entry's metadata when it is complete (its files have the sizes it records), else None."""
        try:
            meta = json.loads(self.meta.read_text())
            itemsize = torch.empty((), dtype=_TORCH_DTYPES[meta["dtype"]]).element_size()
            if (self.tokens.stat().st_size == meta["tokens"] * itemsize
                    and self.starts.stat().st_size == meta["documents"] * 8):
                return meta
        except (OSError, ValueError, KeyError):
            pass
        return None

    def open(self, meta: dict[str, Any], source: TextSource) -> tuple[torch.Tensor, torch.Tensor, MappedFile]:
        """The cached ids and document starts, memory-mapped copy-on-write (read-only on disk),
        and the ids' file held open to check its size (read while training; the starts are
        read only now, to split off the held-out documents)."""
        dtype = _TORCH_DTYPES[meta["dtype"]]
        nbytes = meta["tokens"] * torch.empty((), dtype=dtype).element_size()
        mapped = MappedFile(self.tokens, nbytes, f"{source.name}: its token cache {str(self.tokens)!r}",
                            f"restore it, or delete the cache entry ({self.meta.name} and the files beside it of the "
                            f"same name in {str(self.stem.parent)!r}) so that the next run tokenizes again; then "
                            f"resume with --resume latest")
        tokens = torch.from_file(str(self.tokens), shared=False, size=meta["tokens"], dtype=dtype)
        starts = torch.from_file(str(self.starts), shared=False, size=meta["documents"], dtype=torch.int64)
        mapped.check()
        return tokens, starts, mapped


def _tokenize_into(entry: _Entry, source: TextSource, tokenizer: TextTokenizer, field: str,
                   key: dict[str, Any]) -> dict[str, Any]:
    """Tokenize every document of ``source`` into ``entry``; return its metadata. The
    files are written under temporary names and renamed, the metadata last."""
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    eos = tokenizer.eos_id
    total, unit = _progress_total(source)
    count = documents = max_id = 0
    temps = {final: final.with_name(f"{final.name}.tmp-{os.getpid()}") for final in (entry.tokens, entry.starts)}
    try:
        with (open(temps[entry.tokens], "wb") as tokens_file, open(temps[entry.starts], "wb") as starts_file,
              tqdm(total=total, unit=unit, unit_scale=True, disable=None, desc=f"tokenizing {source.spec}") as bar):
            batch: list[_Piece] = []

            def flush() -> None:
                nonlocal count, documents, max_id
                ids, starts = [], array("q")
                for piece, piece_ids in zip(batch, tokenizer.encode_batch([p.text for p in batch])):
                    if piece.first:
                        starts.append(count + len(ids))
                    ids += piece_ids
                    if piece.last:
                        ids.append(eos)
                if ids:
                    max_id = max(max_id, max(ids))
                array(_ARRAY_CODES[dtype], ids).tofile(tokens_file)
                starts.tofile(starts_file)
                count, documents = count + len(ids), documents + len(starts)
                bar.update(sum(p.progress for p in batch))
                batch.clear()

            batch_bytes = 0
            for piece in _pieces(source, field):
                batch.append(piece)
                batch_bytes += len(piece.text)
                if len(batch) >= BATCH_PIECES or batch_bytes >= BATCH_BYTES:
                    flush()
                    batch_bytes = 0
            if batch:
                flush()
        meta = {**key, "dtype": dtype, "tokens": count, "documents": documents, "max_id": max_id}
        for final, temp in temps.items():
            os.replace(temp, final)
        temp_meta = entry.meta.with_name(f"{entry.meta.name}.tmp-{os.getpid()}")
        temp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(temp_meta, entry.meta)
        return meta
    finally:
        for temp in temps.values():
            temp.unlink(missing_ok=True)


def cached_tokens(source: TextSource, tokenizer: TextTokenizer, field: str, cache_dir: str) -> TextTokens:
    """The ids of ``source`` from its token cache entry, tokenizing into it first when it
    is missing. Safe when several processes call it at once: one tokenizes, the others
    wait on the entry's lock and read its result."""
    key = _cache_key(source, tokenizer, field)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    entry = _Entry(_cache_folder(source, cache_dir) / digest)
    lock = filelock.FileLock(str(entry.lock))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        logger.info("waiting for another process to tokenize %s into %s", source.name, entry.stem)
        lock.acquire()
    try:
        meta = entry.read_meta()
        if meta is not None:
            logger.info("reusing token cache %s (%d tokens, %d documents)", entry.stem, meta["tokens"],
                        meta["documents"])
        else:
            logger.info("tokenizing %s with %s into %s", source.name, tokenizer.name, entry.stem)
            meta = _tokenize_into(entry, source, tokenizer, field, key)
            logger.info("wrote token cache %s: %d tokens, %d documents", entry.stem, meta["tokens"],
                        meta["documents"])
    finally:
        lock.release()
    tokens, starts, mapped = entry.open(meta, source)
    return TextTokens(tokens, starts, meta["max_id"] + 1,
                      _describe(source, meta["documents"], f"{meta['tokens']} tokens (cache {entry.stem})"), (mapped,))
