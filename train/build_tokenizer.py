"""Build the shipped model's tokenizer: byte-level BPE over the stdlib train split, digits split one per token.

Why: a character vocabulary makes the cue ("The pass key is") a dozen tokens and the key-to-cue distance long; a
small BPE makes the cue a few distinct tokens. Numbers are pre-split into groups of two digits, the first carrying
the leading space (" 48213" -> "Ġ48" "21" "3"): every key of a given length has the same token count, and each
key token is rare enough for an induction head to copy it (single-digit tokens were not learnable: after 800
steps the model copied nothing, because a previous digit matches everywhere).

    python train/build_tokenizer.py --out /root/veloxpatch-train/tokenizer.json
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veloxpatch.eval import tasks  # noqa: E402

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096


def _texts(max_chars: int, seed: int = 0) -> list[str]:
    """Train-split corpus in ~1 MB pieces plus the task phrases, so the cue words get their own merges."""
    text = tasks.corpus("train")[:max_chars]
    pieces = [text[i:i + 1_000_000] for i in range(0, len(text), 1_000_000)]
    rng = random.Random(seed)
    cues = []
    for _ in range(2000):
        name = rng.choice(tasks.KEY_NAMES)
        cues.append(tasks.PASSKEY_NEEDLE.format(key=tasks.random_key(rng, 5)) + tasks.PASSKEY_QUESTION)
        cues.append(tasks.MULTIKEY_NEEDLE.format(name=name, key=tasks.random_key(rng, 4))
                    + tasks.MULTIKEY_QUESTION.format(name=name))
    # every 1-2 digit group, with and without a leading space, often enough that BPE keeps each as one token
    groups = [f"{i}" for i in range(10)] + [f"{i:02d}" for i in range(100)]
    numbers = " ".join(g + "," + g for g in groups) + "\n"
    return pieces + ["\n".join(cues)] + [numbers] * 400


def build(vocab_size: int = VOCAB_SIZE, max_chars: int = 12_000_000) -> Tokenizer:
    """Train the BPE (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?[0-9]{1,2}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_texts(max_chars), trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/root/veloxpatch-train/tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    tok = build(args.vocab_size)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    sample = tasks.PASSKEY_NEEDLE.format(key="48213") + tasks.PASSKEY_QUESTION + " 48213"
    print("vocab", tok.get_vocab_size(), "->", args.out)
    print(tok.encode(sample).tokens)


if __name__ == "__main__":
    main()
