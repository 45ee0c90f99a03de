"""The inputs of the HF-model trainer benchmark, made here without a download: English text,
a byte-level BPE tokenizer trained on it, and a Hugging Face model folder of a real model's
widths (no weights: the trainer starts it from its random init)::

    python benchmarks/hf_train_fixture.py --out /tmp/hf_bench --layers 4 --megabytes 64
    torchrun --nproc-per-node 1 benchmarks/bench_train.py --hf-model /tmp/hf_bench/model \\
        --data /tmp/hf_bench/text --set training.dtype=\\'bfloat16\\' ...

The text is generated from a seeded grammar over a few thousand words (narrative sentences,
dialogue, lists, arithmetic, dates), so a model learns it the way it learns prose: fast
at first, then slowly. ``--shape qwen3-30b-a3b`` (the default) is Qwen3-30B-A3B's widths
(hidden 2048, 128 experts top-8 of width 768, 32 query and 4 key-value heads of 128) at
``--layers`` depth with a vocabulary of ``--vocab`` BPE tokens.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SHAPES = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, norm_topk_prob=True,
                          rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096,
                          router_aux_loss_coef=1e-3, output_router_logits=True, tie_word_embeddings=False),
}

_SYLLABLES = ("ka", "lo", "mi", "ren", "sta", "vor", "el", "dun", "pa", "tir", "os", "bel", "cra", "fen", "gu",
              "hal", "ix", "jo", "mar", "nel", "or", "quin", "ru", "sel", "tha", "ul", "ven", "wy", "zor", "an")
_VERBS = ("walked", "spoke", "waited", "wrote", "listened", "travelled", "worked", "laughed", "argued", "sang",
          "counted", "planted", "built", "carried", "watched", "remembered", "forgot", "answered", "asked", "found")
_ADVERBS = ("slowly", "quietly", "carefully", "suddenly", "gladly", "often", "rarely", "together", "alone", "again")
_PLACES = ("the harbour", "the old mill", "the market square", "the northern road", "the library", "the river bank",
           "the orchard", "the station", "the high meadow", "the lighthouse", "the workshop", "the village school")
_THINGS = ("a letter", "the lantern", "a basket of apples", "the map", "a broken clock", "the ledger", "a small boat",
           "the bread", "a wooden box", "the key", "an old coat", "the seeds", "a song", "the news", "a promise")
_TIMES = ("in the morning", "at dusk", "before the rain", "after supper", "on the first day of spring",
          "late at night", "during the fair", "when the bells rang", "in the winter", "at noon")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _sentence(rng: random.Random, people: list[str]) -> str:
    who, other = rng.sample(people, 2)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{who} {rng.choice(_VERBS)} {rng.choice(_ADVERBS)} to {rng.choice(_PLACES)} {rng.choice(_TIMES)}."
    if kind == 1:
        return f'"Have you seen {rng.choice(_THINGS)}?" {who} asked. "Not since {rng.choice(_TIMES)}," said {other}.'
    if kind == 2:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"{who} counted {a} and then {b} more, which made {a + b} in all."
    if kind == 3:
        return (f"On the {rng.randint(1, 28)}th of {rng.choice(_MONTHS)} {who} left {rng.choice(_THINGS)} "
                f"at {rng.choice(_PLACES)} for {other}.")
    if kind == 4:
        items = rng.sample(_THINGS, 3)
        return f"{who} carried {items[0]}, {items[1]} and {items[2]}."
    return f"{who} and {other} {rng.choice(_VERBS)} {rng.choice(_ADVERBS)}, {rng.choice(_TIMES)}."


def document(rng: random.Random) -> str:
    """One story: a few paragraphs about a small cast."""
    people = [_name(rng) for _ in range(rng.randint(2, 5))]
    paragraphs = [" ".join(_sentence(rng, people) for _ in range(rng.randint(3, 8)))
                  for _ in range(rng.randint(1, 5))]
    return f"The story of {people[0]}\n\n" + "\n\n".join(paragraphs)


def write_text(folder: Path, megabytes: float, seed: int, files: int = 8) -> int:
    """``files`` jsonl files of documents, about ``megabytes`` in all; returns the document count."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    budget, count = int(megabytes * 2**20) // files, 0
    for i in range(files):
        size = 0
        with open(folder / f"part-{i:03d}.jsonl", "w", encoding="utf-8") as f:
            while size < budget:
                line = json.dumps({"text": document(rng)}) + "\n"
                f.write(line)
                size += len(line)
                count += 1
    return count


def train_tokenizer(text_folder: Path, out: Path, vocab_size: int) -> None:
    """A byte-level BPE of ``vocab_size`` tokens trained on the text, saved as an HF tokenizer
    (``<|endoftext|>`` its end-of-document token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        for path in sorted(text_folder.glob("*.jsonl")):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)["text"]

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(out)


def write_model_config(out: Path, shape: str, layers: int, vocab_size: int, eos_id: int) -> None:
    """``config.json`` of ``shape`` at ``layers`` depth (no weights)."""
    config = dict(SHAPES[shape], num_hidden_layers=layers, vocab_size=vocab_size, eos_token_id=eos_id,
                  bos_token_id=eos_id, dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for text/ and model/")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000, help="BPE tokens (default: %(default)s)")
    parser.add_argument("--megabytes", type=float, default=64.0, help="text to write (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    docs = write_text(args.out / "text", args.megabytes, args.seed)
    train_tokenizer(args.out / "text", args.out / "model", args.vocab)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.out / "model")
    write_model_config(args.out / "model", args.shape, args.layers, args.vocab, tokenizer.eos_token_id)
    print(f"{args.out}: {docs} documents ({args.megabytes} MB), a {len(tokenizer)}-token BPE, "
          f"{args.shape} at {args.layers} layers")


if __name__ == "__main__":
    main()
