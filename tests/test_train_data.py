"""Tests of the trainer's data (``ep_moe/train/data.py``, ``ep_moe/train/tokens.py``), in process, on the CPU.

- sources: a text file, a ``.jsonl`` file, a folder (recursive, sorted), a glob, a
  ``save_to_disk`` Dataset and DatasetDict, each tokenized equal to the reference (each
  document's ids, then EOS) and split at a document boundary; the same as bytes without a
  tokenizer; uint16/uint32/int32 token files never tokenized; ``data.eval_path``; a large
  text file read in pieces.
- the token cache: next to the data or in ``data.cache_dir`` (the fallback when the data's
  folder cannot be written), reused by a second build (no tokenization), a new entry when
  a file or the tokenizer changes, one entry and identical streams from two processes
  building at once.
- errors: each names the option and the fix, in one line.
- packing: non-overlapping windows, each read once per epoch, another order per epoch,
  disjoint data-parallel shards, resume from ``{"step": N}``.

The tokenizer is a 300-id byte-level BPE trained here (``text_data.py``); nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from text_data import EOS, sample_documents, train_tokenizer, write_jsonl, write_text_files

REPO = Path(__file__).resolve().parents[1]
DOCS = sample_documents(60, seed=1)


@pytest.fixture
def data():
    """``ep_moe/train/data.py``."""
    from ep_moe.train import data

    return data


@pytest.fixture
def tokens():
    """``ep_moe/train/tokens.py``."""
    from ep_moe.train import tokens

    return tokens


@pytest.fixture
def errors():
    """``ep_moe/train/errors.py``."""
    from ep_moe.train import errors

    return errors


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"), sample_documents(200, seed=0))


@pytest.fixture
def tokenizer(data, tokenizer_dir):
    return data.load_tokenizer(str(tokenizer_dir))


def _reference(tokenizer_dir: Path, docs: list[str]) -> list[int]:
    """Each document tokenized on its own by transformers (no special tokens), then EOS."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = []
    for doc in docs:
        ids += hf(doc, add_special_tokens=False)["input_ids"] + [hf.convert_tokens_to_ids(EOS)]
    return ids


def _boundaries(pieces: list[list[int]]) -> set[int]:
    """Where each document after the first starts in the concatenation of ``pieces``."""
    ends, total = set(), 0
    for piece in pieces[:-1]:
        total += len(piece)
        ends.add(total)
    return ends


def _ids(stream: torch.Tensor) -> list[int]:
    return stream.to(torch.int64).tolist()


class EncodeCalls:
    """Counts ``TextTokenizer.encode_batch`` calls; with ``refuse`` set, a call fails the test."""

    def __init__(self, tokens, monkeypatch) -> None:
        self.count, self.refuse = 0, False
        real = tokens.TextTokenizer.encode_batch

        def counting(tokenizer, texts):
            assert not self.refuse, "this build must read the cache, not tokenize"
            self.count += 1
            return real(tokenizer, texts)

        monkeypatch.setattr(tokens.TextTokenizer, "encode_batch", counting)


# --- sources ---------------------------------------------------------------------------------

def _text_file(tmp_path):
    """One text file: one document."""
    path = tmp_path / "book.txt"
    path.write_text("".join(DOCS[:10]), encoding="utf-8")
    return str(path), ["".join(DOCS[:10])]


def _jsonl(tmp_path):
    return str(write_jsonl(tmp_path / "corpus.jsonl", DOCS)), DOCS


def _folder(tmp_path):
    """.txt and .jsonl files at several depths, in sorted order; other files ignored."""
    root = tmp_path / "corpus"
    write_text_files(root / "a", DOCS[:3])
    write_jsonl(root / "b.jsonl", DOCS[3:40])
    write_text_files(root / "c" / "sub", DOCS[40:45])
    (root / "notes.md").write_text("not data")
    (root / "ids.bin").write_bytes(b"\x00\x01")
    return str(root), DOCS[:45]


def _glob(tmp_path):
    for i in range(3):
        write_jsonl(tmp_path / "shards" / f"part_{i}.jsonl", DOCS[20 * i:20 * i + 20])
    (tmp_path / "shards" / "other.txt").write_text("not matched")
    return str(tmp_path / "shards" / "part_*.jsonl"), DOCS


def _dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS}).save_to_disk(str(tmp_path / "ds"))
    return str(tmp_path / "ds"), DOCS


def _dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = {"train": datasets.Dataset.from_dict({"text": DOCS[:50]}),
              "test": datasets.Dataset.from_dict({"text": ["held elsewhere"]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dsd"))
    return str(tmp_path / "dsd"), DOCS[:50]


SOURCES = {"txt": _text_file, "jsonl": _jsonl, "folder": _folder, "glob": _glob, "dataset": _dataset,
           "dataset_dict": _dataset_dict}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_tokenized_source_is_each_document_then_eos(data, tokens, tokenizer, tokenizer_dir, tmp_path, monkeypatch,
                                                    kind):
    """The stream equals each document tokenized alone followed by EOS; the held-out
    tail starts at a document boundary (a single document is cut inside); a second build
    reads the cache."""
    spec, docs = SOURCES[kind](tmp_path)
    cfg = data.DataConfig(path=spec, val_fraction=0.1)
    calls = EncodeCalls(tokens, monkeypatch)
    data.build_token_streams(cfg, seed=0, tokenizer=tokenizer)
    calls.refuse = True
    streams = data.build_token_streams(cfg, seed=0, tokenizer=tokenizer)
    expected = _reference(tokenizer_dir, docs)
    assert _ids(streams.train) + _ids(streams.val) == expected
    assert streams.train.dtype == torch.uint16, "a 300-id vocabulary fits uint16"
    assert (streams.eos_id, streams.byte_level, streams.vocab_size) == (tokenizer.eos_id, False, max(expected) + 1)
    split = streams.train.numel()
    if len(docs) == 1:
        assert split == int(len(expected) * 0.9)
    else:
        per_doc = [_reference(tokenizer_dir, [doc]) for doc in docs]
        assert split in _boundaries(per_doc), "the held-out part starts with a whole document"
        assert 0.05 < streams.val.numel() / len(expected) < 0.2
    assert spec in streams.source and "held out" in streams.source


@pytest.mark.parametrize("kind", ["jsonl", "folder", "glob", "dataset"])
def test_bytes_without_a_tokenizer(data, tmp_path, kind):
    """Without a tokenizer the documents are their UTF-8 bytes joined by newlines."""
    spec, docs = SOURCES[kind](tmp_path)
    streams = data.build_token_streams(data.DataConfig(path=spec), seed=0)
    joined = "\n".join(docs).encode("utf-8")
    assert bytes(torch.cat([streams.train, streams.val]).tolist()) == joined
    assert (streams.vocab_size, streams.byte_level, streams.eos_id) == (256, True, None)
    assert joined[streams.train.numel() - 1:streams.train.numel()] == b"\n", "cut at a document boundary"


def test_text_file_is_its_bytes(data, tmp_path):
    """A single text file without a tokenizer is exactly its bytes, not-UTF-8 ones included."""
    raw = "".join(DOCS[:5]).encode() + b"\xff\xfe stray bytes\n"
    (tmp_path / "corpus.data").write_bytes(raw)
    streams = data.build_token_streams(data.DataConfig(path=str(tmp_path / "corpus.data")), seed=0)
    assert bytes(torch.cat([streams.train, streams.val]).tolist()) == raw
    assert streams.train.numel() == int(len(raw) * 0.95)


def test_large_text_file_is_read_in_pieces(data, tokens, tmp_path, monkeypatch):
    """Pieces cut before a line that starts a word tokenize as the whole file does (a cut
    before an indented line would not: this tokenizer merges a newline with the indent)."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(tokens, "PIECE_BYTES", 300)
    monkeypatch.setattr(tokens, "BATCH_PIECES", 4)
    verse = "  an indented verse line\n  and its indented answer\n"
    text = "".join(doc + verse for doc in DOCS) + "  last words without a newline"
    tokenizer_dir = train_tokenizer(tmp_path / "tokenizer", [text], vocab_size=400)
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    tokenizer = data.load_tokenizer(str(tokenizer_dir))
    streams = data.build_token_streams(data.DataConfig(path=str(path)), seed=0, tokenizer=tokenizer)
    assert _ids(streams.train) + _ids(streams.val) == _reference(tokenizer_dir, [text])
    as_bytes = data.build_token_streams(data.DataConfig(path=str(path)), seed=0)
    assert bytes(torch.cat([as_bytes.train, as_bytes.val]).tolist()) == text.encode()


@pytest.mark.parametrize("name, fmt, dtype, values", [
    ("ids.bin", "auto", torch.uint16, [1, 65535, 7]), ("ids.u16", "auto", torch.uint16, [0, 3]),
    ("ids.u32", "auto", torch.uint32, [1, 70000, 2**31 + 5]), ("ids.i32", "auto", torch.int32, [5, 99999]),
    ("ids.dat", "uint32", torch.uint32, [4, 100000]),
])
def test_token_files_are_never_tokenized(data, tmp_path, monkeypatch, name, fmt, dtype, values):
    ids = torch.tensor(values * 50, dtype=torch.int64)
    path = tmp_path / name
    path.write_bytes(bytes(ids.to(dtype).untyped_storage()))

    class NoTokenizer:
        def __getattr__(self, name):
            raise AssertionError("a token file must not be tokenized")

    streams = data.build_token_streams(data.DataConfig(path=str(path), format=fmt), seed=0, tokenizer=NoTokenizer())
    assert _ids(streams.train) + _ids(streams.val) == ids.tolist()
    assert streams.train.dtype == dtype and streams.train.numel() == int(ids.numel() * 0.95)
    assert (streams.vocab_size, streams.byte_level, streams.eos_id) == (max(values) + 1, False, None)


def test_config_checks(data):
    for kwargs, message in [({"format": "csv"}, "'auto', 'text', 'uint16', 'int32', 'uint32' or 'jsonl'"),
                            ({"text_field": ""}, "data.text_field is empty"),
                            ({"eval_path": "val.jsonl"}, "data.eval_path='val.jsonl' needs data.path")]:
        with pytest.raises(ValueError, match=message):
            data.DataConfig(**kwargs)


def test_is_token_data(data, tmp_path):
    """Only token files (or the embedded corpus) need no tokenizer."""
    ids = _write(tmp_path / "ids.bin", b"\x01\x00" * 8)
    text = _write(tmp_path / "a.txt", "text")
    assert data.is_token_data(data.DataConfig())
    assert data.is_token_data(data.DataConfig(path=str(ids), eval_path=str(ids)))
    assert data.is_token_data(data.DataConfig(path=str(text), format="uint16"))
    assert not data.is_token_data(data.DataConfig(path=str(text)))
    assert not data.is_token_data(data.DataConfig(path=str(ids), eval_path=str(text)))
    assert not data.is_token_data(data.DataConfig(path=str(tmp_path / "*.bin")))


def test_eval_path_holds_out_other_files(data, tokenizer, tokenizer_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", DOCS[:50])
    write_text_files(tmp_path / "val", DOCS[50:])
    cfg = data.DataConfig(path=str(train), eval_path=str(tmp_path / "val"), val_fraction=0.3)
    streams = data.build_token_streams(cfg, seed=0, tokenizer=tokenizer)
    assert _ids(streams.train) == _reference(tokenizer_dir, DOCS[:50]), "all of data.path trains"
    assert _ids(streams.val) == _reference(tokenizer_dir, DOCS[50:])
    assert "data.eval_path=" in streams.source
    assert (tmp_path / "val" / ".ep_moe-tokens").is_dir(), "each source has its own cache"
    ids = tmp_path / "val.bin"
    ids.write_bytes(bytes(torch.arange(300).to(torch.uint16).untyped_storage()))
    mixed = data.build_token_streams(data.DataConfig(path=str(train), eval_path=str(ids)), seed=0, tokenizer=tokenizer)
    assert _ids(mixed.val) == list(range(300)) and mixed.vocab_size == 300


# --- the token cache ---------------------------------------------------------------------------

def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def test_cache_is_reused_and_follows_changes(data, tokens, tokenizer, tokenizer_dir, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="ep_moe.train.data")
    spec, _ = _folder(tmp_path)
    cfg = data.DataConfig(path=spec)
    calls = EncodeCalls(tokens, monkeypatch)
    first = data.build_token_streams(cfg, seed=0, tokenizer=tokenizer)
    cache = Path(spec) / ".ep_moe-tokens"
    assert calls.count and len(_entries(cache)) == 1 and not list(cache.glob("*.tmp-*"))

    calls.refuse = True
    caplog.clear()
    second = data.build_token_streams(cfg, seed=0, tokenizer=tokenizer)
    assert "reusing token cache" in caplog.text
    assert second.train.equal(first.train) and second.val.equal(first.val)

    calls.refuse, calls.count = False, 0
    with open(Path(spec) / "b.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "One more document."}) + "\n")
    changed = data.build_token_streams(cfg, seed=0, tokenizer=tokenizer)
    assert calls.count, "a changed file is tokenized again"
    assert len(_entries(cache)) == 2
    assert changed.train.numel() + changed.val.numel() > first.train.numel() + first.val.numel()

    calls.count = 0
    other = data.load_tokenizer(str(train_tokenizer(tmp_path / "other_tok", DOCS, vocab_size=280)))
    assert other.fingerprint != tokenizer.fingerprint
    data.build_token_streams(cfg, seed=0, tokenizer=other)
    assert calls.count and len(_entries(cache)) == 3, "another tokenizer gets its own entry"


def test_damaged_cache_entry_is_rebuilt(data, tokenizer, tmp_path):
    spec, _ = _jsonl(tmp_path)
    first = data.build_token_streams(data.DataConfig(path=spec), seed=0, tokenizer=tokenizer)
    expected = (_ids(first.train), _ids(first.val))
    (entry,) = Path(spec + ".ep_moe-tokens").glob("*.tokens")
    damaged = entry.read_bytes()[:100]
    entry.unlink()  # a new file: truncating the one ``first`` maps would fault its pages
    entry.write_bytes(damaged)
    again = data.build_token_streams(data.DataConfig(path=spec), seed=0, tokenizer=tokenizer)
    assert (_ids(again.train), _ids(again.val)) == expected


def test_cache_locations(data, tokenizer, tmp_path, monkeypatch, caplog):
    """Beside a file, in a glob's fixed folder, in data.cache_dir; the fallback under
    ~/.cache when the data's folder cannot be written."""
    spec, _ = _glob(tmp_path)
    data.build_token_streams(data.DataConfig(path=spec), seed=0, tokenizer=tokenizer)
    assert len(_entries(tmp_path / "shards" / ".ep_moe-tokens")) == 1
    chosen = tmp_path / "chosen" / "cache"
    data.build_token_streams(data.DataConfig(path=spec, cache_dir=str(chosen)), seed=0, tokenizer=tokenizer)
    assert len(_entries(chosen)) == 1

    spec, _ = _jsonl(tmp_path)
    Path(spec + ".ep_moe-tokens").write_text("a file where the cache folder would go")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with caplog.at_level(logging.WARNING, logger="ep_moe.train.data"):
        data.build_token_streams(data.DataConfig(path=spec), seed=0, tokenizer=tokenizer)
    assert "cannot write the token cache next to the data" in caplog.text
    assert len(_entries(tmp_path / "home" / ".cache" / "ep_moe" / "tokens")) == 1


WORKER = """
import hashlib, json, sys, time
from pathlib import Path
from ep_moe.train import data, tokens
spec, tokenizer_dir, ready, me = sys.argv[1:]
tokens.BATCH_PIECES = 4
calls = []
real = tokens.TextTokenizer.encode_batch
def slow(self, texts):
    calls.append(len(texts))
    time.sleep(0.02)
    return real(self, texts)
tokens.TextTokenizer.encode_batch = slow
tokenizer = data.load_tokenizer(tokenizer_dir)
Path(ready, me).touch()
while len(list(Path(ready).iterdir())) < 2:
    time.sleep(0.005)
streams = data.build_token_streams(data.DataConfig(path=spec), 0, tokenizer)
digest = hashlib.sha256(json.dumps([streams.train.tolist(), streams.val.tolist()]).encode()).hexdigest()
print(json.dumps({"calls": len(calls), "digest": digest}))
"""


def test_concurrent_builders_share_one_cache(data, tokenizer_dir, tmp_path):
    """Two processes (as torchrun's ranks) build at once: one tokenizes, the other waits
    on the lock and reads its entry; both get the same streams."""
    spec, _ = _jsonl(tmp_path)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, spec, str(tokenizer_dir),
                               str(ready), str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for rank in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["calls"] > 0 for r in results) == [False, True], f"exactly one tokenizes: {results}"
    assert results[0]["digest"] == results[1]["digest"]
    cache = Path(spec + ".ep_moe-tokens")
    assert len(_entries(cache)) == 1 and not list(cache.glob("*.tmp-*"))


# --- errors ------------------------------------------------------------------------------------

def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _fake_dataset_folder(tmp_path, monkeypatch):
    _write(tmp_path / "ds" / "state.json", "{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    return {"path": str(tmp_path / "ds")}


def _dataset_without_column(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    return {"path": str(tmp_path / "ds")}


def _dataset_dict_without_train(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "ds"))
    return {"path": str(tmp_path / "ds")}


def _unreadable(tmp_path, monkeypatch):
    from ep_moe.train import tokens

    path = _write(tmp_path / "corpus" / "secret.txt", "hidden")
    _write(tmp_path / "corpus" / "open.txt", "visible")
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything: refuse the open instead
        real_open = open

        def refusing_open(file, *args, **kwargs):
            if Path(file) == path:
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(tokens, "open", refusing_open, raising=False)
    return {"path": str(tmp_path / "corpus")}


ERRORS = {
    "glob matches nothing": (lambda t, m: {"path": str(t / "none_*.jsonl")},
                             r"^data.path='.*none_\*.jsonl' matches no file: check the pattern"),
    "missing path": (lambda t, m: {"path": str(t / "missing")},
                     r"^data.path='.*missing' is not a file, a folder or a glob pattern"),
    "folder without text": (lambda t, m: {"path": str(_write(t / "d" / "notes.md", "x").parent)},
                            r"^data.path='.*d' is a folder without .txt or .jsonl files"),
    "empty file in a folder": (lambda t, m: {"path": str(_write(t / "d" / "b.txt", "").parent),
                                             "_": _write(t / "d" / "a.txt", "x")},
                               r"^data.path='.*d': '.*b.txt' is empty \(0 bytes\): fill it or remove it"),
    "empty text file": (lambda t, m: {"path": str(_write(t / "e.txt", ""))},
                        r"^data.path='.*e.txt' is empty \(0 bytes\)"),
    "jsonl of blank lines": (lambda t, m: {"path": str(_write(t / "b.jsonl", "\n \n"))},
                             r"'.*b.jsonl' holds no documents .*data.text_field='text'"),
    "jsonl line not JSON": (lambda t, m: {"path": str(_write(t / "b.jsonl", '{"text": "a"}\n{"text": \n'))},
                            r"^data.path='.*b.jsonl': .*b.jsonl:2 is not JSON \(.*\): .*data.text_field='text'"),
    "jsonl line without the field": (
        lambda t, m: {"path": str(_write(t / "b.jsonl", '{"text": "a"}\n\n{"body": "b"}\n'))},
        r"b.jsonl:3 has no key data.text_field='text' \(it holds 'body'\): set data.text_field"),
    "jsonl field not a string": (lambda t, m: {"path": str(_write(t / "b.jsonl", '{"text": 5}\n'))},
                                 r"b.jsonl:1: data.text_field='text' is not a string but int"),
    "jsonl with another text_field": (lambda t, m: {"path": str(_write(t / "b.jsonl", '{"text": "a"}\n')),
                                                    "text_field": "content"},
                                      r"b.jsonl:1 has no key data.text_field='content' \(it holds 'text'\)"),
    "unreadable file": (_unreadable, r"^data.path='.*corpus': '.*secret.txt' cannot be read \(Permission denied\)"),
    "token files in a glob": (lambda t, m: {"path": str(_write(t / "s" / "a.bin", b"\x00\x01").parent / "*")},
                              r"matches token file '.*a.bin': a glob reads text and .jsonl files"),
    "token format on a folder": (lambda t, m: {"path": str(_write(t / "d" / "a.txt", "x").parent),
                                               "format": "uint16"},
                                 r"^data.path='.*d' is not a file: data.format='uint16' reads one flat token file"),
    "eval_path missing": (lambda t, m: {"path": str(_write(t / "a.txt", "x" * 100)), "eval_path": str(t / "nope")},
                          r"^data.eval_path='.*nope' is not a file, a folder or a glob pattern"),
    "eval_path empty": (lambda t, m: {"path": str(_write(t / "a.txt", "x" * 100)),
                                      "eval_path": str(_write(t / "v.jsonl", ""))},
                        r"^data.eval_path='.*v.jsonl' is empty \(0 bytes\)"),
    "eval_path of another kind": (lambda t, m: {"path": str(_write(t / "a.txt", "x" * 100)),
                                                "eval_path": str(_write(t / "v.bin", b"\x01\x00" * 50))},
                                  r"^data.eval_path='.*v.bin' holds token ids but data.path='.*a.txt' holds text "
                                  r"read as bytes"),
    "datasets not installed": (_fake_dataset_folder, r"^data.path='.*ds' is a Hugging Face datasets folder "
                                                     r"\(save_to_disk\), which needs the datasets package: "
                                                     r"pip install datasets"),
    "dataset without the column": (_dataset_without_column,
                                   r"has no column data.text_field='text' \(columns: body\): set data.text_field"),
    "dataset dict without train": (_dataset_dict_without_train, r"holds the splits \['test'\] but no 'train'"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_source_names_the_option_and_the_fix(data, errors, tmp_path, monkeypatch, case):
    setup, expected = ERRORS[case]
    kwargs = {k: v for k, v in setup(tmp_path, monkeypatch).items() if not k.startswith("_")}
    with pytest.raises(errors.DataError, match=expected) as err:
        data.build_token_streams(data.DataConfig(**kwargs), seed=0)
    assert "\n" not in str(err.value), "one line"


def test_tokenizer_errors(data, errors, tokenizer, tmp_path):
    """Text that is not UTF-8, a folder without tokenizer files, a tokenizer without EOS,
    a cache folder that cannot be written."""
    path = _write(tmp_path / "latin1.txt", "caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(errors.DataError, match=r"^data.path='.*latin1.txt': '.*latin1.txt' is not UTF-8 text "
                                               r"\(byte 3\): convert it to UTF-8"):
        data.build_token_streams(data.DataConfig(path=str(path)), seed=0, tokenizer=tokenizer)
    with pytest.raises(errors.DataError, match=r"^model.hf='.*empty' holds no tokenizer files .*: text data needs "
                                               r"the model's tokenizer there"):
        (tmp_path / "empty").mkdir()
        data.load_tokenizer(str(tmp_path / "empty"))
    blocked = _write(tmp_path / "blocked", "a file, not a folder")
    with pytest.raises(errors.DataError, match=r"^data.cache_dir='.*blocked' cannot be written"):
        data.build_token_streams(data.DataConfig(path=str(_write(tmp_path / "a.txt", "text")),
                                                 cache_dir=str(blocked)), seed=0, tokenizer=tokenizer)

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
                            ).save_pretrained(str(tmp_path / "no_eos"))
    no_eos = data.load_tokenizer(str(tmp_path / "no_eos"))
    with pytest.raises(errors.DataError, match=r"has no EOS token, which separates the documents"):
        data.build_token_streams(data.DataConfig(path=str(tmp_path / "a.txt")), seed=0, tokenizer=no_eos)


# --- packing -------------------------------------------------------------------------------------

L, B, DP = 8, 3, 2
WINDOWS = 24
"""A stream of ``WINDOWS * L + 1 + 5`` distinct ids: 24 windows (the last 5 ids are
left over), 4 steps of ``B * DP`` samples per epoch."""


def _ranks(data, tokens, seed=0):
    return [data.TokenBatches(tokens, seq_len=L, batch_size=B, dp_rank=r, dp_size=DP, seed=seed) for r in range(DP)]


def _windows_read(batches, step) -> list[int]:
    """The windows a batch holds, read off its ids (token i has id i)."""
    inputs, targets = batches.batch(step)
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (B, L)
    starts = inputs[:, 0]
    assert (starts % L == 0).all(), "windows start at multiples of seq_len"
    assert inputs.equal(starts[:, None] + torch.arange(L)) and targets.equal(inputs + 1)
    return (starts // L).tolist()


def test_packing_reads_each_window_once_per_epoch(data):
    tokens = torch.arange(WINDOWS * L + 1 + 5, dtype=torch.int32)
    ranks = _ranks(data, tokens)
    assert ranks[0].num_windows == WINDOWS
    steps_per_epoch = WINDOWS // (B * DP)
    orders = []
    for epoch in range(3):
        order = []
        for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            shards = [_windows_read(r, step) for r in ranks]
            assert not set(shards[0]) & set(shards[1]), "the ranks' shards of a step are disjoint"
            order += shards[0] + shards[1]
        assert sorted(order) == list(range(WINDOWS)), "every window once per epoch"
        orders.append(order)
    assert orders[0] != orders[1] != orders[2], "each epoch has its own order"
    assert ranks[0].epoch_of(steps_per_epoch) == 1.0
    other_seed = _ranks(data, tokens, seed=1)
    assert [w for s in range(steps_per_epoch) for r in other_seed for w in _windows_read(r, s)] != orders[0]


def test_batches_resume_from_the_step(data):
    tokens = torch.arange(WINDOWS * L + 1, dtype=torch.int32)
    fresh = _ranks(data, tokens)[1]
    expected = [fresh.batch(step) for step in range(11)]
    for start in (0, 3, 4, 9):
        resumed = _ranks(data, tokens)[1]
        resumed.load_state_dict({"step": start})
        for step in range(start, 11):
            x, y = next(resumed)
            assert x.equal(expected[step][0]) and y.equal(expected[step][1])
        assert resumed.state_dict() == {"step": 11}


def test_short_stream_wraps_and_too_short_one_fails(data, errors):
    """A stream of one window still serves any number of batches (evaluation reads
    ``batch(i)`` for i below eval_batches); a shorter one is an error naming the fix."""
    one = data.TokenBatches(torch.arange(L + 2), seq_len=L, batch_size=B, dp_rank=0, dp_size=DP, seed=0)
    assert one.num_windows == 1
    for step in range(5):
        assert _windows_read(one, step) == [0] * B
    with pytest.raises(errors.DataError, match=r"^the validation split has 9 tokens, fewer than seq_len \+ 2 = 10: "
                                               r"raise it, lower training.seq_len or use more data"):
        data.TokenBatches(torch.arange(L + 1), seq_len=L, batch_size=B, dp_rank=0, dp_size=DP, seed=0,
                          split="validation split", hint="raise it")
