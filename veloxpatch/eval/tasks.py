"""Deterministic long-context task generators shared by training and evaluation.

Filler text is the Python standard library's own ``.py`` sources: natural code/prose that exists on every
machine with Python, so nothing needs downloading. Files are split into ``train`` / ``heldout`` by a hash of
their relative path, so evaluation text is never trained on.

Every generator is seeded and pure Python; prompts are plain text that any ``tokenizer.encode`` handles, and the
answer is exactly what greedy generation should produce right after the prompt (:func:`is_correct`).

Prompt formats (the shipped model was trained on exactly these phrases)::

    passkey:   <filler> The pass key is 48213. Remember it. 48213 is the pass key. <filler>
               What is the pass key? The pass key is          -> answer " 48213"
    multikey:  <filler> The secret code for apple is 4821. <filler> ... (several pairs)
               What is the secret code for apple? The secret code for apple is   -> answer " 4821"
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Protocol

SPLITS = ("train", "heldout")
HELDOUT_MOD = 10  # one file in ten (by path hash) is held out

PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "What is the pass key? The pass key is"
MULTIKEY_NEEDLE = "The secret code for {name} is {key}.\n"
MULTIKEY_QUESTION = "What is the secret code for {name}? The secret code for {name} is"

# Names for multikey pairs: plain, distinct English words (not identifiers that are common in code).
KEY_NAMES = (
    "apple banana cherry grape lemon mango olive peach pear plum melon berry "
    "river mountain forest desert island valley ocean meadow canyon glacier "
    "tiger eagle whale horse rabbit falcon otter beaver badger salmon turtle "
    "violin trumpet guitar piano drum flute harp cello "
    "copper silver marble granite crystal amber coral pearl "
    "winter summer autumn spring thunder rainbow sunrise sunset "
    "castle bridge tower harbor garden temple market village "
    "pencil basket candle ladder mirror pillow blanket wallet"
).split()


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


LenFn = Callable[[str], int]
TokenizerOrLenFn = _Encoder | LenFn


def split_of(rel_path: str, mod: int = HELDOUT_MOD) -> str:
    """Stable split of a path inside stdlib by its hash, one in ``mod`` held out (independent of file order)."""
    return "heldout" if int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % mod == 0 else "train"


@lru_cache(maxsize=2)
def corpus(split: str) -> str:
    """Every stdlib ``.py`` file of one split (site-packages aside) as one string, in path order so the corpus is
    deterministic; files that are not clean UTF-8 are skipped."""
    assert split in SPLITS, split
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel or split_of(rel) != split:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "pass key" in text or "secret code for" in text:
            continue  # never let filler contain a cue phrase
        parts.append(text.strip("\n") + "\n\n")
    return "".join(parts)


def filler(n_chars: int, rng: random.Random, split: str) -> str:
    """A run of whole lines of about ``n_chars`` characters starting at a random line of the split's corpus."""
    return excerpt(corpus(split), n_chars, rng)


def excerpt(text: str, n_chars: int, rng: random.Random) -> str:
    """Whole lines of ``text``, about ``n_chars`` characters, from a random line on (shared by every haystack)."""
    if n_chars <= 0:
        return ""
    start = text.find("\n", rng.randrange(0, max(1, len(text) - n_chars - 1))) + 1  # no newline after it: 0
    chunk = text[start:start + n_chars]
    return chunk[:chunk.rfind("\n") + 1]


def random_key(rng: random.Random, n_digits: int) -> str:
    """A key of exactly ``n_digits`` digits (no leading zero, so it reads as a number)."""
    return str(rng.randint(10 ** (n_digits - 1), 10**n_digits - 1))


def _insert_at_depth(text: str, needle: str, depth: float) -> str:
    """Insert ``needle`` at the line boundary nearest to fraction ``depth`` of ``text``."""
    pos = text.rfind("\n", 0, int(len(text) * depth)) + 1  # 0 before the first line boundary
    return text[:pos] + needle + text[pos:]


def _fit(build: Callable[[int], str], context_tokens: int, tok: TokenizerOrLenFn) -> str:
    """The prompt of the deterministic ``build(n_chars)`` closest to ``context_tokens`` without going over, counted by
    ``tok`` (a tokenizer: anything with ``encode``, or a ready ``str -> n_tokens`` function): a few secant-like steps
    on chars-per-token converge fast."""
    len_fn: LenFn = (lambda s: len(tok.encode(s))) if hasattr(tok, "encode") else tok
    n_chars = context_tokens * 3
    best, best_len = build(0), len_fn(build(0))
    for _ in range(8):
        prompt = build(n_chars)
        n = len_fn(prompt)
        if n <= context_tokens and n > best_len:
            best, best_len = prompt, n
        if abs(n - context_tokens) <= max(4, context_tokens // 200) and n <= context_tokens:
            break
        n_chars = max(1, int(n_chars * context_tokens / max(n, 1) * (0.995 if n > context_tokens else 1.0)))
    return best


def passkey_example(tokenizer_or_len_fn: TokenizerOrLenFn, context_tokens: int, seed: int, split: str = "heldout",
                    n_digits: int = 5, depth: float | None = None) -> tuple[str, str]:
    """Passkey retrieval, (prompt, answer): a key hidden at ``depth`` (random if None) in filler, the question
    last, at most ``context_tokens`` tokens."""
    rng = random.Random(f"passkey/{split}/{seed}")
    key = random_key(rng, n_digits)
    depth = rng.random() if depth is None else depth
    fill_rng_state = rng.getstate()

    def build(n_chars: int) -> str:
        body = filler(n_chars, random.Random(str(fill_rng_state)), split)
        return _insert_at_depth(body, PASSKEY_NEEDLE.format(key=key), depth) + PASSKEY_QUESTION

    return _fit(build, context_tokens, tokenizer_or_len_fn), " " + key


def multikey_example(tokenizer_or_len_fn: TokenizerOrLenFn, context_tokens: int, seed: int, split: str = "heldout",
                     n_keys: int = 4, n_digits: int = 4) -> tuple[str, str]:
    """Multi-key retrieval: ``n_keys`` name→code pairs scattered in filler, one of them asked for at the end.
    Harder than passkey for eviction methods: the distractor pairs look alike, so only the right one may survive."""
    rng = random.Random(f"multikey/{split}/{seed}")
    names = rng.sample(KEY_NAMES, n_keys)
    keys = [random_key(rng, n_digits) for _ in names]
    depths = sorted(rng.random() for _ in names)
    asked = rng.randrange(n_keys)
    fill_seed = str(rng.getstate())

    def build(n_chars: int) -> str:
        body = filler(n_chars, random.Random(fill_seed), split)
        for name, key, d in reversed(list(zip(names, keys, depths))):  # back to front keeps depths meaningful
            body = _insert_at_depth(body, MULTIKEY_NEEDLE.format(name=name, key=key), d)
        return body + MULTIKEY_QUESTION.format(name=names[asked])

    return _fit(build, context_tokens, tokenizer_or_len_fn), " " + keys[asked]


def longtext_sample(tokenizer_or_len_fn: TokenizerOrLenFn, context_tokens: int, seed: int) -> str:
    """Held-out natural text of at most ``context_tokens`` tokens, for perplexity under a compressed cache."""
    rng_state = str(random.Random(f"longtext/{seed}").getstate())
    return _fit(lambda n: filler(n, random.Random(rng_state), "heldout"), context_tokens, tokenizer_or_len_fn)


def is_correct(generated: str, answer: str) -> bool:
    """Greedy output counts as right when it starts with the answer's digits (whitespace-insensitive)."""
    return generated.strip().startswith(answer.strip())
