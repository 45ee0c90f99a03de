"""Token data for the trainer: the embedded synthetic corpus, text, or token files.

Sources (``[data] path``, and ``eval_path`` for held-out data from other files):

- ``""`` (default): a byte-level corpus generated deterministically from ``seed``, no
  download. Its lines follow a small grammar a model can learn: sums (``"17+25=42"``),
  counting runs (``"7 8 9 10 11"``), sentences over a fixed vocabulary and copy tasks
  (``"copy abcd|abcd"``), so the loss falls quickly from ln(256) = 5.5.
- text: a text file, a ``.jsonl`` file (one document per line, under ``text_field``), a
  folder of ``.txt``/``.jsonl`` files, a glob pattern, or a ``datasets`` ``save_to_disk``
  folder (``tokens.py``). With a tokenizer the documents are tokenized once, each followed
  by EOS, into a memory-mapped token cache that later runs and the other ranks reuse;
  without one (the byte-level model) the tokens are the UTF-8 bytes, vocabulary 256.
- a flat token file: ``.bin``/``.u16`` hold uint16 ids (nanoGPT's ``train.bin``),
  ``.u32`` uint32 and ``.i32`` int32 ids; native byte order, no header. Memory-mapped,
  never read whole, never tokenized. ``[data] format`` names the layout when the suffix
  does not.

Without ``eval_path`` the last ``val_fraction`` of the tokens is held out, cut at a
document boundary so that no document is in both splits (a single document, or a token
file, is cut inside).

Batches pack the stream: it is cut into non-overlapping windows of ``seq_len + 1`` tokens
at stride ``seq_len``, so every token is a target once per epoch. Epoch ``e`` visits the
windows in a permutation seeded by (seed, e); global sample ``i`` of the run is window
``i mod W`` of epoch ``i // W``; step ``s`` takes samples ``[s * B * dp, (s + 1) * B * dp)``
and data-parallel rank ``r`` the ``B`` of them from ``(s * dp + r) * B``. So each rank
reads its own shard, a batch is a pure function of (seed, step, rank), the data position
is just the step, and a resumed run reads exactly the batches an uninterrupted run would.

Memory-mapped files (token files, the token cache) are held open (``tokens.MappedFile``)
and their size is checked against the mapped length when they are mapped and before each
epoch (the first batch, and every step whose samples reach a new epoch, alike on every
rank), so a file truncated while the run reads it stops the run with a ``DataError``
naming it instead of SIGBUS. (A truncation in the middle of an epoch is caught at the
next epoch at the earliest: the check costs one ``fstat`` per file and epoch.)
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch

from ep_moe.train.errors import DataError
from ep_moe.train.tokens import (
    TOKEN_SUFFIXES,
    MappedFile,
    TextTokenizer,
    byte_tokens,
    cached_tokens,
    find_text_source,
    load_tokenizer,
)

__all__ = ["DataConfig", "MappedFile", "TextTokenizer", "TokenBatches", "TokenStreams", "build_token_streams",
           "is_token_data", "load_tokenizer", "load_tokens", "synthetic_corpus"]

Format = Literal["auto", "text", "uint16", "int32", "uint32", "jsonl"]
_FILE_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32, "int32": torch.int32}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from and which of them are held out."""

    path: str = ""
    """A text, ``.jsonl`` or token file, a folder, a glob pattern or a ``save_to_disk``
    folder; empty for the embedded synthetic corpus."""
    format: Format = "auto"
    """``"auto"`` picks by suffix (``.bin``/``.u16`` uint16, ``.u32`` uint32, ``.i32``
    int32, ``.jsonl`` JSON lines, else text); another value reads every file that way."""
    text_field: str = "text"
    """The key of a ``.jsonl`` line, or the dataset column, that holds the text."""
    eval_path: str = ""
    """Held-out data from separate files (any kind ``path`` takes); empty: the last
    ``val_fraction`` of ``path``."""
    cache_dir: str = ""
    """Folder of the token cache of tokenized text; empty: next to the data (or
    ``~/.cache/ep_moe/tokens`` where that cannot be written)."""
    synthetic_bytes: int = 1 << 20
    """Size of the embedded corpus in bytes (= tokens)."""
    val_fraction: float = 0.05
    """Tail of ``path`` held out for evaluation when ``eval_path`` is empty."""

    def __post_init__(self) -> None:
        if self.format not in ("auto", "text", "uint16", "int32", "uint32", "jsonl"):
            raise ValueError(f"data.format={self.format!r}: use 'auto', 'text', 'uint16', 'int32', 'uint32' or 'jsonl'")
        if self.synthetic_bytes < 4096:
            raise ValueError(f"data.synthetic_bytes={self.synthetic_bytes} is too small: use at least 4096")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in (0, 0.5)")
        if not self.text_field:
            raise ValueError("data.text_field is empty: name the key or column that holds the text")
        if self.eval_path and not self.path:
            raise ValueError(f"data.eval_path={self.eval_path!r} needs data.path: the embedded corpus holds out "
                             f"its own tail (data.val_fraction)")


# --- the embedded corpus --------------------------------------------------------------

_NOUNS = ("cat", "dog", "bird", "fox", "horse", "robot", "child", "farmer", "queen", "wizard")
_ADJS = ("small", "big", "red", "quiet", "happy", "old", "clever", "lazy")
_VERBS = ("sees", "follows", "helps", "finds", "paints", "calls", "chases", "likes")
_PLACES = ("in the garden", "near the river", "at home", "on the hill", "in the city")


def _synthetic_line(rng: random.Random) -> str:
    """One line of the embedded grammar; the first word says which task it is."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"add {a}+{b}={a + b}"
    if kind == 1:
        start, length = rng.randrange(200), rng.randrange(4, 9)
        return "count " + " ".join(str(start + i) for i in range(length))
    if kind == 2:
        return (f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
                f"the {rng.choice(_NOUNS)} {rng.choice(_PLACES)}.")
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randrange(3, 8)))
    return f"copy {word}|{word}"


def synthetic_corpus(num_bytes: int, seed: int) -> torch.Tensor:
    """The embedded corpus: ``num_bytes`` uint8 tokens, identical for identical arguments.

    ``random.Random`` with an int seed yields the same stream on every platform and Python
    version, which is what makes the corpus reproducible without shipping it.
    """
    rng = random.Random(seed)
    lines, size = [], 0
    while size < num_bytes:
        line = _synthetic_line(rng) + "\n"
        lines.append(line)
        size += len(line)
    data = "".join(lines).encode("ascii")[:num_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# --- token files --------------------------------------------------------------------------

def _token_format(path: Path, fmt: str) -> Optional[str]:
    """The id type of ``path`` when it is read as a flat token file, else None."""
    if fmt == "auto":
        return TOKEN_SUFFIXES.get(path.suffix.lower())
    return fmt if fmt in _FILE_DTYPES else None


def is_token_data(cfg: DataConfig) -> bool:
    """Whether the data needs no tokenizer: ``data.path`` (and ``data.eval_path``) are flat
    token files, or the path is empty (the embedded corpus is bytes already)."""
    return all(Path(spec).is_file() and _token_format(Path(spec), cfg.format)
               for spec in (cfg.path, cfg.eval_path) if spec)


def load_tokens(path: str, fmt: Format = "auto", option: str = "data.path") -> tuple[torch.Tensor, int]:
    """Read a flat token file; return the 1-D tokens and the vocabulary they need.
    ``option`` names the setting in errors.

    Token files are memory-mapped copy-on-write (``torch.from_file`` with ``shared=False``
    opens the file read-only), so a file of many gigabytes costs no resident memory up
    front. The vocabulary check reads the file once.
    """
    tokens, vocab, _ = _map_tokens(path, fmt, option)
    return tokens, vocab


def _map_tokens(path: str, fmt: Format, option: str) -> tuple[torch.Tensor, int, MappedFile]:
    """:func:`load_tokens`, and the mapped file held open (to check its size while training)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{option}={path!r} is not a file: pass a text file or a flat token file")
    token_format = _token_format(file, fmt)
    if token_format is None:
        raise DataError(f"{option}={path!r} is not a token file (.bin, .u16, .u32, .i32): set data.format to its "
                        f"token type")
    nbytes = os.path.getsize(file)
    if nbytes == 0:
        raise DataError(f"{option}={path!r} is empty (0 bytes): pass a file that holds the tokens")
    dtype = _FILE_DTYPES[token_format]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise DataError(f"{option}={path!r} has {nbytes} bytes, not a multiple of {itemsize} ({token_format}); "
                        f"set data.format to the file's token type")
    mapped = MappedFile(file, nbytes // itemsize * itemsize, f"{option}={path!r}",
                        "restore the file (as it was when the run started), then resume with --resume latest")
    tokens = torch.from_file(str(file), shared=False, size=nbytes // itemsize, dtype=dtype)
    mapped.check()
    lo, hi = _min_max(tokens)
    if lo < 0:
        raise DataError(f"{option}={path!r} holds negative token ids; is it really int32? Set data.format")
    return tokens, hi + 1, mapped


def _min_max(tokens: torch.Tensor, chunk: int = 1 << 22) -> tuple[int, int]:
    """Smallest and largest id, read in chunks: uint16/uint32 have no ``min``/``max``
    kernels, and a whole-file int64 copy of a large memory-mapped file would not fit."""
    lo, hi = 0, 0
    for start in range(0, tokens.numel(), chunk):
        part = tokens[start:start + chunk].to(torch.int64)
        lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    return lo, hi


# --- streams ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenStreams:
    """The train and validation token streams of the configured data."""

    train: torch.Tensor
    """[S_train] token ids."""
    val: torch.Tensor
    """[S_val] token ids: the held-out tail of ``data.path``, or ``data.eval_path``."""
    vocab_size: int
    """Smallest vocabulary that holds every id of both streams."""
    byte_level: bool
    """Tokens are bytes (text without a tokenizer, or the embedded corpus), so text encodes as ``bytes``."""
    eos_id: Optional[int] = None
    """The id that ends each document, when text was tokenized; None for bytes and token files."""
    source: str = ""
    """What was read and held out, one line for logs."""
    mapped: tuple[MappedFile, ...] = ()
    """The memory-mapped files the streams read (token files, token caches), to check while
    training (``TokenBatches(files=...)``)."""


@dataclass(frozen=True)
class _Stream:
    """One data option's tokens."""

    tokens: torch.Tensor
    starts: Optional[torch.Tensor]
    """[D] first token of each document; None for a token file (no document boundaries)."""
    vocab_size: int
    byte_level: bool
    eos_id: Optional[int]
    """The id ending each document of tokenized text."""
    description: str
    mapped: tuple[MappedFile, ...] = ()
    """The memory-mapped files ``tokens`` reads."""


def _load_stream(spec: str, option: str, cfg: DataConfig, tokenizer: Optional[TextTokenizer]) -> _Stream:
    """The tokens named by ``spec``: a token file as it is, text as bytes or tokenized."""
    path = Path(spec)
    if path.is_file() and _token_format(path, cfg.format):
        tokens, vocab, mapped = _map_tokens(spec, cfg.format, option)
        return _Stream(tokens, None, vocab, False, None, f"{option}={spec!r}: {tokens.numel()} tokens", (mapped,))
    source = find_text_source(spec, option, cfg.format)
    if tokenizer is None:
        text = byte_tokens(source, cfg.text_field)
        return _Stream(text.tokens, text.starts, text.vocab_size, True, None, text.description)
    text = cached_tokens(source, tokenizer, cfg.text_field, cfg.cache_dir)
    return _Stream(text.tokens, text.starts, text.vocab_size, False, tokenizer.eos_id, text.description, text.mapped)


def _held_out_start(stream: _Stream, val_fraction: float) -> int:
    """Where the validation tail starts: at the first document that starts at or past
    ``1 - val_fraction`` of the tokens (at least the last document); inside the stream
    when it has no document boundaries to cut at."""
    target = int(stream.tokens.numel() * (1.0 - val_fraction))
    if stream.starts is None or stream.starts.numel() < 2:
        return target
    later = stream.starts[1:]
    index = min(int(torch.searchsorted(later, target)), later.numel() - 1)
    return int(later[index])


def build_token_streams(cfg: DataConfig, seed: int, tokenizer: Optional[TextTokenizer] = None) -> TokenStreams:
    """Load, tokenize or generate the tokens and split off the held-out part.

    ``tokenizer`` encodes text (a Hugging Face model's, from :func:`load_tokenizer`);
    without one, text is bytes. Token files and the embedded corpus ignore it.
    """
    if not cfg.path:
        corpus = synthetic_corpus(cfg.synthetic_bytes, seed)
        split = int(corpus.numel() * (1.0 - cfg.val_fraction))
        return TokenStreams(train=corpus[:split], val=corpus[split:], vocab_size=256, byte_level=True,
                            source=f"embedded synthetic corpus ({corpus.numel()} bytes, seed {seed})")
    train = _load_stream(cfg.path, "data.path", cfg, tokenizer)
    if cfg.eval_path:
        val = _load_stream(cfg.eval_path, "data.eval_path", cfg, tokenizer)
        if val.byte_level != train.byte_level:
            kinds = {True: "text read as bytes (no tokenizer)", False: "token ids"}
            raise DataError(f"data.eval_path={cfg.eval_path!r} holds {kinds[val.byte_level]} but data.path="
                            f"{cfg.path!r} holds {kinds[train.byte_level]}: pass held-out data of the same kind")
        train_tokens, val_tokens = train.tokens, val.tokens
        vocab_size = max(train.vocab_size, val.vocab_size)
        source = f"{train.description}; held out: {val.description}"
        mapped = train.mapped + val.mapped
    else:
        split = _held_out_start(train, cfg.val_fraction)
        train_tokens, val_tokens, vocab_size = train.tokens[:split], train.tokens[split:], train.vocab_size
        source = f"{train.description}; held out: the last {val_tokens.numel()} tokens"
        if train.starts is not None and train.starts.numel() > 1:
            source += f" ({int((train.starts >= split).sum())} documents)"
        mapped = train.mapped
    return TokenStreams(train=train_tokens, val=val_tokens, vocab_size=vocab_size, byte_level=train.byte_level,
                        eos_id=train.eos_id, source=source, mapped=mapped)


# --- batches --------------------------------------------------------------------------------

class TokenBatches:
    """Deterministic (input, target) batches of one data-parallel rank from a packed token stream.

    ``tokens`` is [S] (any integer dtype, possibly memory-mapped), cut into ``W`` windows
    of ``seq_len + 1`` tokens at stride ``seq_len``; the module docstring says which
    window each sample of each step and rank reads.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, split: str = "data", hint: str = "",
                 files: Sequence[MappedFile] = ()) -> None:
        """``split`` names the stream and ``hint`` adds a remedy, in the error raised when
        ``tokens`` is too short for one window. ``files``: the memory-mapped files behind
        ``tokens`` (``TokenStreams.mapped``), checked before the first batch and before
        each epoch (:meth:`needs_check`)."""
        if tokens.numel() <= seq_len + 1:
            raise DataError(f"the {split} has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}: "
                            f"{hint + ', ' if hint else ''}lower training.seq_len or use more data")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.num_windows = (tokens.numel() - 1) // seq_len
        """Windows per epoch."""
        self.step = 0
        self._orders: dict[int, torch.Tensor] = {}
        self.files = tuple(files)
        self._checked_epoch = -1
        """The last epoch whose files were checked (-1: none yet)."""

    def _order(self, epoch: int) -> torch.Tensor:
        """The window order of ``epoch``; the last two epochs' are kept (a step may span two)."""
        if epoch not in self._orders:
            if len(self._orders) == 2:
                del self._orders[min(self._orders)]
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(self.num_windows, generator=gen)
        return self._orders[epoch]

    def windows(self, step: int) -> list[int]:
        """The windows this rank reads at ``step``: window ``w`` is tokens ``[w * seq_len,
        (w + 1) * seq_len]``."""
        first = (step * self.dp_size + self.dp_rank) * self.batch_size
        return [int(self._order(sample // self.num_windows)[sample % self.num_windows])
                for sample in range(first, first + self.batch_size)]

    def _last_epoch(self, step: int) -> int:
        """The epoch of the last sample any rank reads at ``step`` (alike on every rank)."""
        return ((step + 1) * self.batch_size * self.dp_size - 1) // self.num_windows

    def needs_check(self, step: int) -> bool:
        """Whether ``step`` is the first batch read, or reaches an epoch whose files were not
        checked yet: the points where :meth:`batch` checks the memory-mapped files. Alike on
        every rank, so a trainer can agree on the outcome (:meth:`files_problem`) first."""
        return bool(self.files) and self._last_epoch(step) > self._checked_epoch

    def files_problem(self) -> Optional[str]:
        """Why a memory-mapped file cannot be read to its mapped length (it shrank), or None."""
        for file in self.files:
            problem = file.problem()
            if problem is not None:
                return problem
        return None

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of ``step``: inputs and targets, [B, L] int64 each. Raises a
        ``DataError`` naming a memory-mapped file that shrank (checked before the first
        batch and each epoch), where reading it would raise SIGBUS."""
        if self.needs_check(step):
            problem = self.files_problem()
            if problem is not None:
                raise DataError(problem)
            self._checked_epoch = self._last_epoch(step)
        windows_BL = torch.stack([self.tokens[w * self.seq_len:(w + 1) * self.seq_len + 1].to(torch.int64)
                                  for w in self.windows(step)])
        return windows_BL[:, :-1], windows_BL[:, 1:]

    def epoch_of(self, step: int) -> float:
        """Epochs of the stream all ranks have read before ``step`` (fractional), for logs."""
        return step * self.batch_size * self.dp_size / self.num_windows

    def __iter__(self) -> "TokenBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The data position: the step whose batch comes next (the epoch follows from it)."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position."""
        self.step = int(state["step"])
