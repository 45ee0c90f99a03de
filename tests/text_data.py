"""Shared helpers of the text-data tests (tests/test_train_data.py, the trainer tests that
train on text): varied English-like documents made up on the spot, a small byte-level BPE
tokenizer trained on them and saved as a Hugging Face tokenizer folder, and writers for
the file kinds ``ep_moe/train/data.py`` reads. Nothing is downloaded. ``train_tokenizer`` needs
``tokenizers`` and ``transformers``: import it after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

EOS = "<|endoftext|>"
"""The special token that ends each document."""

_SUBJECTS = ("The old miller", "A young sailor", "The queen of the valley", "My neighbour", "The village doctor",
             "A tired traveller", "The shepherd's daughter", "Our captain", "The schoolmaster", "An honest clerk")
_VERBS = ("walked slowly to", "wrote a long letter about", "dreamed of", "spoke kindly of", "returned at dusk to",
          "could not forget", "laughed at", "painted a picture of", "waited patiently by", "sold his coat near")
_OBJECTS = ("the mill by the river", "the grey harbour", "a garden full of roses", "the winter market",
            "the little church on the hill", "three silver coins", "the northern road", "an empty house",
            "the café on the corner", "a ship named Œnone")
_CLAUSES = ("when the bells rang", "although it was raining", "before anyone woke", "for the hundredth time",
            "as the sun went down", "without saying a word", "in the year 1843", "because nobody else would")
_REMARKS = ('"Never again," she said.', "It was, in truth, a quiet life.", "Nobody knew why.",
            "The clock struck nine.", "— and that was the end of it.", "He smiled; the matter was settled.")


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(_REMARKS)
    clause = f" {rng.choice(_CLAUSES)}" if rng.random() < 0.5 else ""
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{clause}."


def sample_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of one to four paragraphs of two to six sentences (some non-ASCII),
    identical for identical arguments."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        paragraphs = [" ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(1, 4))]
        docs.append(f"Chapter {i + 1}\n\n" + "\n\n".join(paragraphs) + "\n")
    return docs


def train_tokenizer(folder: Path, texts: Sequence[str], vocab_size: int = 300) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids (``EOS`` included) on ``texts`` and save
    it in ``folder`` as a tokenizer ``AutoTokenizer.from_pretrained`` loads; return ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS).save_pretrained(str(folder))
    return Path(folder)


def write_text_files(folder: Path, docs: Sequence[str], prefix: str = "doc") -> list[Path]:
    """One ``<prefix>_NNN.txt`` per document in ``folder`` (created); their paths in order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, doc in enumerate(docs):
        path = folder / f"{prefix}_{i:03d}.txt"
        path.write_text(doc, encoding="utf-8")
        paths.append(path)
    return paths


def write_jsonl(path: Path, docs: Sequence[str], field: str = "text") -> Path:
    """One JSON object per document, the text under ``field`` (plus an ``id``); return ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}, ensure_ascii=False) + "\n")
    return path
