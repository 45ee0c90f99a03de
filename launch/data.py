"""Token data for the trainer: an embedded synthetic corpus or the user's own file.

Sources (``[data] path``):

- ``""`` (default): a byte-level corpus generated deterministically from ``seed``, no
  download. Its lines follow a small grammar a model can learn: sums (``"17+25=42"``),
  counting runs (``"7 8 9 10 11"``), sentences over a fixed vocabulary and copy tasks
  (``"copy abcd|abcd"``), so the loss falls quickly from ln(256) = 5.5.
- a text file (any suffix not below): its bytes, vocabulary 256.
- a flat token file: ``.bin``/``.u16`` hold uint16 ids (nanoGPT's ``train.bin``),
  ``.i32`` int32 ids; native byte order, no header. Memory-mapped, never read whole.
  ``[data] format`` names the layout when the suffix does not.

Batches are a pure function of (seed, step, data-parallel rank): step ``s`` draws
``batch_size * dp_size`` window offsets from a generator seeded with (seed, s), and rank
``r`` takes its slice. So the data position is just the step, and a resumed run reads
exactly the batches an uninterrupted run would have read.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from errors import DataError

Format = Literal["auto", "text", "uint16", "int32"]
_TOKEN_SUFFIXES: dict[str, Format] = {".bin": "uint16", ".u16": "uint16", ".i32": "int32"}
_FILE_DTYPES = {"uint16": torch.uint16, "int32": torch.int32}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from and how much of them is held out."""

    path: str = ""
    """Token or text file; empty for the embedded synthetic corpus."""
    format: Format = "auto"
    """``"auto"`` picks by suffix (``.bin``/``.u16`` uint16, ``.i32`` int32, else text)."""
    synthetic_bytes: int = 1 << 20
    """Size of the embedded corpus in bytes (= tokens)."""
    val_fraction: float = 0.05
    """Tail of the token stream held out for evaluation."""

    def __post_init__(self) -> None:
        if self.format not in ("auto", "text", "uint16", "int32"):
            raise ValueError(f"data.format={self.format!r}: use 'auto', 'text', 'uint16' or 'int32'")
        if self.synthetic_bytes < 4096:
            raise ValueError(f"data.synthetic_bytes={self.synthetic_bytes} is too small: use at least 4096")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in (0, 0.5)")


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


# --- user files -------------------------------------------------------------------------

def _resolve_format(path: Path, fmt: Format) -> Format:
    return fmt if fmt != "auto" else _TOKEN_SUFFIXES.get(path.suffix.lower(), "text")


def load_tokens(path: str, fmt: Format = "auto") -> tuple[torch.Tensor, int]:
    """Read a text or flat token file; return the 1-D tokens and the vocabulary they need.

    Token files are memory-mapped copy-on-write (``torch.from_file`` with ``shared=False``
    opens the file read-only), so a file of many gigabytes costs no resident memory up
    front. The vocabulary check reads the file once.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data.path={path!r} is not a file: pass a text file or a flat token file")
    fmt = _resolve_format(file, fmt)
    nbytes = os.path.getsize(file)
    if nbytes == 0:
        raise DataError(f"data.path={path!r} is empty (0 bytes): pass a file that holds the training "
                        f"{'text' if fmt == 'text' else 'tokens'}, or drop --data for the embedded corpus")
    if fmt == "text":
        return torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8), 256
    dtype = _FILE_DTYPES[fmt]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise DataError(f"data.path={path!r} has {nbytes} bytes, not a multiple of {itemsize} ({fmt}); "
                        f"set data.format to the file's token type")
    tokens = torch.from_file(str(file), shared=False, size=nbytes // itemsize, dtype=dtype)
    lo, hi = _min_max(tokens)
    if lo < 0:
        raise DataError(f"data.path={path!r} holds negative token ids; is it really int32? Set data.format")
    return tokens, hi + 1


def _min_max(tokens: torch.Tensor, chunk: int = 1 << 24) -> tuple[int, int]:
    """Smallest and largest id, read in chunks: uint16 has no ``min``/``max`` kernels, and a
    whole-file int32 copy of a large memory-mapped file would not fit in memory."""
    lo, hi = 0, 0
    for start in range(0, tokens.numel(), chunk):
        part = tokens[start:start + chunk].to(torch.int32)
        lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    return lo, hi


class TokenBatches:
    """Deterministic (input, target) batches of one data-parallel rank from a token stream.

    ``tokens`` is [S] (any integer dtype, possibly memory-mapped); each sample is a window
    of ``seq_len + 1`` tokens at an offset drawn from a generator seeded with (seed, step).
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, split: str = "data", hint: str = "") -> None:
        """``split`` names the stream and ``hint`` adds a remedy, in the error raised when
        ``tokens`` is too short for one window."""
        if tokens.numel() <= seq_len + 1:
            raise DataError(f"the {split} has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}: "
                             f"{hint + ', ' if hint else ''}lower training.seq_len or use more data")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of ``step``: inputs and targets, [B, L] int64 each."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        offsets_G = torch.randint(0, self.tokens.numel() - self.seq_len - 1,
                                  (self.batch_size * self.dp_size,), generator=gen)
        mine_B = offsets_G[self.dp_rank * self.batch_size:(self.dp_rank + 1) * self.batch_size]
        windows_BL = torch.stack([self.tokens[o:o + self.seq_len + 1] for o in mine_B.tolist()]).to(torch.int64)
        return windows_BL[:, :-1], windows_BL[:, 1:]

    def __iter__(self) -> "TokenBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The data position: the step whose batch comes next."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position."""
        self.step = int(state["step"])


@dataclass(frozen=True)
class TokenStreams:
    """The train and validation token streams of one source."""

    train: torch.Tensor
    """[S_train] token ids."""
    val: torch.Tensor
    """[S_val] token ids: the tail of the source."""
    vocab_size: int
    """Smallest vocabulary that holds every id."""
    byte_level: bool
    """Tokens are bytes (text file or the embedded corpus), so text encodes as ``bytes``."""


def build_token_streams(cfg: DataConfig, seed: int) -> TokenStreams:
    """Load or generate the tokens and split off the validation tail."""
    if cfg.path:
        tokens, vocab = load_tokens(cfg.path, cfg.format)
        byte_level = _resolve_format(Path(cfg.path), cfg.format) == "text"
    else:
        tokens, vocab, byte_level = synthetic_corpus(cfg.synthetic_bytes, seed), 256, True
    split = int(tokens.numel() * (1.0 - cfg.val_fraction))
    return TokenStreams(train=tokens[:split], val=tokens[split:], vocab_size=vocab, byte_level=byte_level)
