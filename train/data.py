"""Training batches: stdlib filler mixed with retrieval episodes, answer tokens up-weighted.

Why this mix: retrieval is an induction/copy skill; a model sees it far more often when every sequence holds
several "cue -> digits ... same cue -> ?" episodes than when one passkey sits in a long plain-text sequence.
Each batch is a pure function of (seed, step, context length), so the data "RNG state" to checkpoint is the step.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veloxpatch.eval import tasks  # noqa: E402

CHARS_PER_TOKEN = 3.35  # measured for the 4096-token BPE on held-out stdlib text


@dataclass
class Mix:
    """Probabilities of the sequence kinds, and the loss weight of answer tokens."""

    passkey: float = 0.35  # exact eval format, question right at the end (right-aligned)
    dense: float = 0.45  # several secret-code pairs (+ maybe a passkey), each asked 1-2 times later
    plain: float = 0.20  # natural text only
    drill: float = 0.0  # episodes packed back to back with little filler: dense signal to form induction heads
    answer_weight: float = 4.0


def _snap(text: str, pos: int) -> int:
    """Next line start at or after ``pos`` (events go between lines, like in the eval prompts)."""
    if pos <= 0:
        return 0
    nl = text.find("\n", pos - 1)
    return len(text) if nl < 0 else nl + 1


def _assemble(body: str, events: list[tuple[int, str, tuple[int, int] | None]]) -> tuple[str, list[tuple[int, int]]]:
    """Insert (pos, text, answer-span-within-text) events into ``body``; return text and absolute answer spans."""
    out, spans, last = [], [], 0
    n = 0
    for pos, ev, span in sorted(events, key=lambda e: e[0]):
        pos = max(_snap(body, pos), last)
        out.append(body[last:pos])
        n += pos - last
        if span is not None:
            spans.append((n + span[0], n + span[1]))
        out.append(ev)
        n += len(ev)
        last = pos
    out.append(body[last:])
    return "".join(out), spans


def _qa(question: str, key: str) -> tuple[str, tuple[int, int]]:
    """A question followed by its answer; the span covers ' <digits>' (what greedy decoding must produce)."""
    text = question + " " + key + "\n"
    return text, (len(question), len(question) + 1 + len(key))


def passkey_text(rng: random.Random, L: int) -> tuple[str, list[tuple[int, int]], int]:
    """Eval-format episode; returns text, answer spans and the char position the needle must survive from.

    Filler before and after the needle is sized in tokens from a uniform depth, so the needle's distance from the
    question is uniform over the window like in the eval. (Sizing the text so that it always overflows the window
    made short texts, i.e. needles far from the question, get rejected: depths below 0.1 were 4% of examples.)
    A text shorter than the window is right-padded by ``make_batch``.
    """
    key = tasks.random_key(rng, rng.randint(4, 7))
    depth = rng.random()
    a = tasks.filler(int(L * CHARS_PER_TOKEN * depth * 1.15), rng, "train")
    b = tasks.filler(int(L * CHARS_PER_TOKEN * (1 - depth) * 0.95), rng, "train")
    qa, span = _qa(tasks.PASSKEY_QUESTION, key)
    qa = qa[:-1]  # eval prompts end right after the key
    head = a + tasks.PASSKEY_NEEDLE.format(key=key) + b
    return head + qa, [(len(head) + span[0], len(head) + span[1])], len(a)


def dense_text(rng: random.Random, L: int) -> tuple[str, list[tuple[int, int]]]:
    """Several pairs scattered, each asked 1-2 times after its definition (left-aligned, tail may be cut)."""
    body = tasks.filler(int(L * CHARS_PER_TOKEN * 1.3), rng, "train")
    F = int(len(body) / 1.3)
    events = []
    n_pairs = rng.randint(1, max(2, L // 160))
    names = rng.sample(tasks.KEY_NAMES, n_pairs)
    pairs = [(tasks.MULTIKEY_NEEDLE.format(name=n, key=k), tasks.MULTIKEY_QUESTION.format(name=n), k)
             for n in names for k in [tasks.random_key(rng, rng.randint(3, 6))]]
    if rng.random() < 0.5:
        k = tasks.random_key(rng, rng.randint(4, 7))
        pairs.append((tasks.PASSKEY_NEEDLE.format(key=k), tasks.PASSKEY_QUESTION, k))
    for needle, question, key in pairs:
        a = rng.randrange(0, int(F * 0.85))
        events.append((a, needle, None))
        for _ in range(rng.randint(1, 2)):
            text, span = _qa(question, key)
            events.append((rng.randrange(a + 1, F), text, span))
    text, spans = _assemble(body, events)
    return text, spans


def drill_text(rng: random.Random, L: int) -> tuple[str, list[tuple[int, int]]]:
    """Many short pairs and their questions with only a line or two of filler between: ~25% answer tokens."""
    parts, spans, n = [], [], 0
    live: list[tuple[str, str]] = []
    while n < L * CHARS_PER_TOKEN * 1.3:
        r = rng.random()
        if live and r < 0.45:
            question, key = rng.choice(live)
            text, span = _qa(question, key)
            spans.append((n + span[0], n + span[1]))
        elif r < 0.85:
            if rng.random() < 0.2:
                key = tasks.random_key(rng, rng.randint(4, 7))
                live = [p for p in live if p[0] != tasks.PASSKEY_QUESTION] + [(tasks.PASSKEY_QUESTION, key)]
                text = tasks.PASSKEY_NEEDLE.format(key=key)
            else:
                name, key = rng.choice(tasks.KEY_NAMES), tasks.random_key(rng, rng.randint(3, 6))
                question = tasks.MULTIKEY_QUESTION.format(name=name)
                live = [p for p in live if p[0] != question] + [(question, key)]
                text = tasks.MULTIKEY_NEEDLE.format(name=name, key=key)
        else:
            text = tasks.filler(rng.randint(20, 200), rng, "train")
        parts.append(text)
        n += len(text)
    return "".join(parts), spans


def plain_text(rng: random.Random, L: int) -> str:
    return tasks.filler(int(L * CHARS_PER_TOKEN * 1.3), rng, "train")


def _weights(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], w: float) -> np.ndarray:
    starts = np.array([o[0] for o in offsets], dtype=np.int64)
    out = np.ones(len(offsets), dtype=np.float32)
    for s, e in spans:
        out[(starts >= s) & (starts < e)] = w
    return out


def make_batch(tok: Tokenizer, seed: int, step: int, L: int, batch: int, mix: Mix) -> tuple[np.ndarray, np.ndarray]:
    """(tokens[B, L+1] int32, weights[B, L] float32) for one step, a pure function of its arguments."""
    rng = random.Random(f"{seed}/{step}/{L}")
    toks = np.full((batch, L + 1), 0, dtype=np.int32)
    wts = np.zeros((batch, L), dtype=np.float32)
    for i in range(batch):
        r = rng.random()
        for _ in range(10):  # retry the rare sample whose needle got cut off
            if mix.drill <= r < mix.drill + mix.passkey:
                text, spans, keep_from = passkey_text(rng, L)
                enc = tok.encode(text)
                ids, offs = enc.ids[-(L + 1):], enc.offsets[-(L + 1):]
                if offs[0][0] > keep_from:
                    continue
            else:
                if r < mix.drill:
                    text, spans = drill_text(rng, L)
                elif r < mix.drill + mix.passkey + mix.dense:
                    text, spans = dense_text(rng, L)
                else:
                    text, spans = plain_text(rng, L), []
                enc = tok.encode(text)
                ids, offs = enc.ids[:L + 1], enc.offsets[:L + 1]
                if len(ids) < L + 1:
                    continue
            # a short passkey text is right-padded with EOS at weight 0: later tokens never affect earlier ones
            toks[i, :len(ids)] = ids
            wts[i, :len(ids) - 1] = _weights(offs, spans, mix.answer_weight)[1:]
            break
    return toks, wts
