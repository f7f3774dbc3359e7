"""RULER-style long-context tasks (ideas from arXiv 2404.06654) for a real, instruction-tuned model.

The haystack is the English documentation that ships with CPython (``pydoc_data.topics``: the help texts of
the language reference), so nothing is downloaded. Its topics are split into ``train`` / ``heldout`` by a hash
of the topic name; evaluation uses the held-out topics by default. Needles are inserted at line boundaries and
the question comes last, as a user would ask it, wrapped in the tokenizer's chat template when it has one.

Tasks and how an answer is scored (greedy output, case-insensitive):

    niah_single      one number hidden for one word; right when the output contains the number
    niah_multikey    look-alike needles for several words, one asked; right when it contains the asked number and
                     none of the distractors' numbers
    niah_multivalue  one word with several numbers; right when every number is in the output
    vt               variable tracking: VAR A = 12345, VAR B = VAR A, ... one chain among decoy chains; right when
                     every variable of the asked chain is named and no decoy variable is
    trip             a journey's stops told one per paragraph across the whole text; right when the output names
                     every city in the order visited (aggregation over the context, not one fact)
    followup         a chat of two turns on one cache: magic numbers for two words; turn 1 asks the first, turn 2 (the
                     conversation templated anew after the first answer, its new tokens fed to the same caches, as
                     the server's prompt-cache reuse does) the second; right when turn 2's answer has the second
                     number and not the first (a cache compressed for the first question must still answer the next)
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from .tasks import SPLITS, TokenizerOrLenFn, _fit, _insert_at_depth, excerpt, random_key, split_of

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "trip", "followup")
# RULER's synthetic tasks under its own names (its two QA tasks need data sets that are not on PyPI); niah_single_2 and
# niah_multikey_1 are niah_single and niah_multikey, niah_multivalue and vt the same generators
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
# tokens a list answer may take, RULER's own per task (its niah tasks get 128): a model writes a numbered list, and
# the answer's own length plus a few cut Qwen2.5's four numbers off after the third (single answers keep that length)
ANSWER_TOKENS = {"niah_multivalue": 128, "niah_multiquery": 128, "vt": 30, "cwe": 120, "fwe": 50}
HELDOUT_MOD = 4  # one topic in four (by name hash) is held out: about 120k characters, enough for 8k tokens

INSTRUCTION = "Read the following text and answer the question after it.\n\n"
NEEDLE = "One of the special magic numbers for {word} is: {number}.\n"
UUID_NEEDLE = "One of the special magic uuids for {key} is: {value}.\n"
WORDS = (
    "amber anchor balcony bamboo beacon biscuit blossom cactus canvas carpet cedar chimney cobalt compass cricket "
    "crimson dolphin ember falcon feather fountain galaxy ginger harbor hazel helmet indigo ivory jasmine kettle "
    "lantern lemon lilac lobster maple meadow mosaic nectar nutmeg oasis orchid pepper pebble quartz raven saffron "
    "sapphire scarlet sparrow tulip velvet walnut willow zephyr"
).split()
CITIES = (
    "Lisbon Oslo Cairo Lima Dublin Vienna Nairobi Quito Hanoi Perth Riga Tunis Zagreb Bergen Dakar Kyoto Malmo "
    "Porto Seville Tallinn Turin Valencia Warsaw Zurich"
).split()
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Example:
    """A prompt, the reference answer as text, and the items the scoring rule looks for."""

    prompt: str
    answer: str
    wanted: tuple[str, ...]
    unwanted: tuple[str, ...] = ()
    ordered: bool = False
    turns: tuple[tuple[str, str], ...] = ()  # (user message, answer start) of a chat's turns; ``wanted``: the last
    question_at: int = 0  # where in ``prompt`` the question begins: before it, the context a cache may compress alone
    tokens: int = 0  # tokens the answer may take at least (``ANSWER_TOKENS``; 0: the answer's own and a few)

    @property
    def context(self) -> str:
        """The prompt up to its question: what the question-after protocol compresses before the question is asked."""
        return self.prompt[: self.question_at]

    @property
    def question(self) -> str:
        """The prompt from its question on (the end of the user's turn and the answer's start with it)."""
        return self.prompt[self.question_at:]


@lru_cache(maxsize=2)
def haystack_text(split: str) -> str:
    """Every documentation topic of the split (by a hash of its name, independent of dict order and Python build), in
    name order, as one English text."""
    from pydoc_data.topics import topics

    assert split in SPLITS, split
    return "".join(topics[k].strip("\n") + "\n\n" for k in sorted(topics) if split_of(k, HELDOUT_MOD) == split)


Hay = Callable[[int, random.Random], str]  # about n characters of filler, from a random generator


def docs_hay(split: str) -> Hay:
    """Whole lines of the split's documentation text (RULER's essays, which are not on PyPI)."""
    text = haystack_text(split)
    return lambda n_chars, rng: excerpt(text, n_chars, rng)


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def noise_hay(n_chars: int, rng: random.Random) -> str:
    """RULER's repeated-sentence haystack: nothing in it looks like a needle."""
    return NOISE * max(0, n_chars // len(NOISE))


def _build(tokenizer: Any, context: int, seed_text: str, needles: list[tuple[str, float]], question: str,
           answer_prefix: str, hay: Hay) -> tuple[str, str, int]:
    """Fit haystack + needles (text, depth) + question into ``context`` tokens: the chat prompt, the user's
    message in it, and where in the prompt the question begins."""
    fill_seed = str(random.Random(seed_text).getstate())
    messages: dict[str, str] = {}

    def build(n_chars: int) -> str:
        body = hay(n_chars, random.Random(fill_seed))
        for needle, depth in sorted(needles, key=lambda nd: -nd[1]):  # back to front keeps depths meaningful
            body = _insert_at_depth(body, needle, depth)
        message = f"{INSTRUCTION}{body}\n{question}"
        prompt = conversation(tokenizer, [(message, answer_prefix)])
        messages[prompt] = message
        return prompt

    prompt = _fit(build, context, tokenizer)
    return prompt, messages[prompt], prompt.rindex(question)


def _depths(rng: random.Random, n: int) -> list[float]:
    """``n`` needle depths spread over the text (one per equal slice, jittered), so no two collide."""
    return [(i + rng.uniform(0.1, 0.9)) / n for i in range(n)]


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def _number(rng: random.Random) -> str:
    return random_key(rng, 7)


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _pair(rng: random.Random) -> str:
    """A two-word key (``amber-lantern``): thousands of them, so a haystack of needles needs no repeated key."""
    first, second = rng.sample(WORDS, 2)
    return f"{first}-{second}"


def _needle(kind: str, key: str, value: str) -> str:
    """A needle line: a number for a key (``NEEDLE``) or a uuid (``UUID_NEEDLE``)."""
    return NEEDLE.format(word=key, number=value) if kind == "number" else UUID_NEEDLE.format(key=key, value=value)


def _needles(words: Sequence[str], numbers: list[str], depths: list[float]) -> list[tuple[str, float]]:
    return [(NEEDLE.format(word=w, number=n), d) for w, n, d in zip(words, numbers, depths)]


def _asked(kind: str, key: str) -> tuple[str, str]:
    """The question for ``key``'s magic ``kind`` (a plural: all of them) and the answer's start."""
    what = f"special magic {kind} for {key} mentioned in the provided text"
    if kind.endswith("s"):
        return f"What are all the {what}?", f"The {what} are"
    return f"What is the {what}?", f"The {what} is"


def _single(name: str, new_key: Callable[[random.Random], str], value: Callable[[random.Random], str], kind: str,
            hay: Callable[[str], Hay] | None = None) -> Callable[..., Example]:
    """A task of one ``kind`` needle for one key at a random depth, asked for by the key (``name``, given the split
    and seed, seeds it), in ``hay(split)`` or else among needles of the same shape for other keys (RULER's
    niah_multikey_2 and _3)."""

    def generate(tokenizer: Any, context: int, seed: int, split: str = "heldout") -> Example:
        rng = random.Random(name.format(split=split, seed=seed))
        key, answer = new_key(rng), value(rng)
        prompt, _, at = _build(tokenizer, context, f"{rng.random()}", [(_needle(kind, key, answer), rng.random())],
                               *_asked(kind, key), hay(split) if hay else needles_hay(new_key, value, kind, key))
        return Example(prompt, answer, (answer,), question_at=at)

    return generate


niah_single = _single("niah_single/{split}/{seed}", _word, _number, "number", docs_hay)  # RULER's niah_single_2


def niah_multikey(tokenizer: Any, context: int, seed: int, split: str = "heldout", n_keys: int = 4) -> Example:
    """``n_keys`` needles of the same shape for different words; one word is asked (RULER's niah_multikey_1)."""
    rng = random.Random(f"niah_multikey/{split}/{seed}")
    words = rng.sample(WORDS, n_keys)
    numbers = [random_key(rng, 7) for _ in words]
    asked = rng.randrange(n_keys)
    needles = _needles(words, numbers, _depths(rng, n_keys))
    prompt, _, at = _build(tokenizer, context, f"{rng.random()}", needles, *_asked("number", words[asked]),
                           docs_hay(split))
    others = tuple(n for i, n in enumerate(numbers) if i != asked)
    return Example(prompt, numbers[asked], (numbers[asked],), others, question_at=at)


def needles_hay(new_key: Callable[[random.Random], str], value: Callable[[random.Random], str], kind: str,
                skip: str) -> Hay:
    """A haystack made of ``kind`` needles for other keys (RULER's niah_multikey_2 and _3), each a key and a value
    drawn by ``new_key`` and ``value``; ``skip``, the asked key, never appears."""
    def hay(n_chars: int, rng: random.Random) -> str:
        out, size, seen = [], 0, {skip}
        while size < n_chars:
            key = new_key(rng)
            text = _needle(kind, key, value(rng))
            if key not in seen:
                seen.add(key)
                out.append(text)
                size += len(text)
        return "".join(out)
    return hay


def _all_numbers(tokenizer: Any, context: int, rng: random.Random, words: list[str], named: str,
                 split: str) -> Example:
    """A number for each of ``words`` (a word may repeat) spread over the text; all asked for at once."""
    numbers = [random_key(rng, 7) for _ in words]
    needles = _needles(words, numbers, _depths(rng, len(words)))
    prompt, _, at = _build(tokenizer, context, f"{rng.random()}", needles, *_asked("numbers", named),
                           docs_hay(split))
    return Example(prompt, ", ".join(numbers), tuple(numbers), question_at=at)


def niah_multivalue(tokenizer: Any, context: int, seed: int, split: str = "heldout", n_values: int = 4) -> Example:
    """One word with ``n_values`` numbers spread over the text; all are asked for."""
    rng = random.Random(f"niah_multivalue/{split}/{seed}")
    word = rng.choice(WORDS)
    return _all_numbers(tokenizer, context, rng, [word] * n_values, word, split)


def niah_multiquery(tokenizer: Any, context: int, seed: int, split: str = "heldout", n_keys: int = 4) -> Example:
    """``n_keys`` words, each with its number spread over the text; all of them are asked at once."""
    rng = random.Random(f"niah_multiquery/{seed}")
    words = rng.sample(WORDS, n_keys)
    return _all_numbers(tokenizer, context, rng, words, ", ".join(words[:-1]) + f" and {words[-1]}", split)


def vt(tokenizer: Any, context: int, seed: int, split: str = "heldout", hops: int = 4, decoys: int = 1) -> Example:
    """Variable tracking: chains ``VAR A = value``, ``VAR B = VAR A`` ...; the asked chain's variables are the answer.

    Decoy chains start from other values, so copying every ``VAR`` name is wrong."""
    rng = random.Random(f"vt/{split}/{seed}")
    drawn: set[str] = set()  # distinct five-letter upper-case variable names
    while len(drawn) < (hops + 1) * (decoys + 1):
        drawn.add("".join(rng.choice(LETTERS) for _ in range(5)))
    names = sorted(sorted(drawn), key=lambda _: rng.random())  # a set's order changes with each process's hash seed
    chains = [names[i * (hops + 1):(i + 1) * (hops + 1)] for i in range(decoys + 1)]
    values = [random_key(rng, 5) for _ in chains]
    depths = iter(_depths(rng, len(names)))
    needles = []
    for chain, value in zip(chains, values):
        links = [f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(chain, chain[1:])]
        needles += [(f"{link}\n", d) for link, d in zip(links, sorted(next(depths) for _ in links))]
    question = f"Find all variables that are assigned the value {values[0]} in the text above."
    prefix = f"The variables assigned the value {values[0]} are:"
    prompt, _, at = _build(tokenizer, context, f"{rng.random()}", needles, question, prefix, docs_hay(split))
    return Example(prompt, " ".join(chains[0]), tuple(chains[0]), tuple(n for c in chains[1:] for n in c),
                   question_at=at)


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Plain lower-case English words of five to nine letters from the documentation text, each once, sorted:
    what the word-counting tasks draw from (RULER's come from a word list that is not on PyPI)."""
    found = re.findall(r"(?<![\w.])[a-z]{5,9}(?![\w.(])", haystack_text("train") + haystack_text("heldout"))
    return tuple(sorted(set(found)))


def cwe(tokenizer: Any, context: int, seed: int, split: str = "heldout", common: int = 10, often: int = 30,
        rarely: int = 3) -> Example:
    """Common words extraction (RULER's cwe): a numbered list where ``common`` words appear ``often`` times each and
    the rest ``rarely``; all the common ones are asked for (aggregation: no single line answers it)."""
    rng = random.Random(f"cwe/{seed}")
    words = list(vocabulary())
    rng.shuffle(words)
    top, rest = words[:common], words[common:]

    def hay(n_chars: int, r: random.Random) -> str:
        others = rest[: max(0, n_chars // 12 - common * often) // rarely]
        items = top * often + others * rarely
        r.shuffle(items)
        return "".join(f"{i}. {w}\n" for i, w in enumerate(items, start=1))

    question = f"What are the {common} most common words in the list above?"
    prefix = f"The {common} words that appear most often in the list are:"
    prompt, _, at = _build(tokenizer, context, f"{rng.random()}", [], question, prefix, hay)
    return Example(prompt, ", ".join(top), tuple(top), question_at=at)


def fwe(tokenizer: Any, context: int, seed: int, split: str = "heldout", asked: int = 3, alpha: float = 2.0) -> Example:
    """Frequent words extraction (RULER's fwe): made-up words whose counts follow a Zipf law of exponent ``alpha``;
    the ``asked`` most frequent are the answer."""
    rng = random.Random(f"fwe/{seed}")
    made = {"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6))) for _ in range(400)}
    coded = sorted(sorted(made), key=lambda _: rng.random())

    def hay(n_chars: int, r: random.Random) -> str:
        total = max(0, n_chars // 6)
        weights = [1 / (rank ** alpha) for rank in range(1, len(coded) + 1)]
        counts = [round(total * w / sum(weights)) for w in weights]
        items = [w for w, c in zip(coded, counts) for _ in range(c)]
        r.shuffle(items)
        return " ".join(items) + "\n"

    question = f"What are the {asked} most frequently appearing words in the coded text above?"
    prefix = f"The {asked} most frequently appearing words in the coded text are:"
    prompt, _, at = _build(tokenizer, context, f"{rng.random()}", [], question, prefix, hay)
    return Example(prompt, ", ".join(coded[:asked]), tuple(coded[:asked]), question_at=at)


def trip(tokenizer: Any, context: int, seed: int, split: str = "heldout", stops: int = 4) -> Example:
    """A traveller's stops, one sentence each, spread front to back; the answer is the whole route in order.

    No single sentence answers it: every stop must survive in the cache, and in its place."""
    rng = random.Random(f"trip/{split}/{seed}")
    traveller = rng.choice(WORDS).capitalize()
    cities = rng.sample(CITIES, stops)
    ordinals = ("first", "second", "third", "fourth", "fifth", "sixth")
    needles = [(f"On the {ordinals[i]} day of the journey, the traveller {traveller} arrived in {city}.\n", d)
               for i, (city, d) in enumerate(zip(cities, _depths(rng, stops)))]
    question = f"List, in order, the cities the traveller {traveller} arrived in during the journey."
    prefix = f"The traveller {traveller} arrived in these cities, in order:"
    prompt, _, at = _build(tokenizer, context, f"{rng.random()}", needles, question, prefix, docs_hay(split))
    return Example(prompt, ", ".join(cities), tuple(cities), ordered=True, question_at=at)


def followup(tokenizer: Any, context: int, seed: int, split: str = "heldout", facts: int = 2) -> Example:
    """``facts`` words' magic numbers at random depths; turn 1 asks the first, each next turn (after the answers
    before it) the next word's. ``wanted`` is the last turn's number, ``unwanted`` the others in turn order."""
    rng = random.Random(f"followup/{split}/{seed}")
    words = rng.sample(WORDS, facts)
    numbers = [random_key(rng, 7) for _ in words]
    depths = _depths(rng, facts)
    rng.shuffle(depths)  # any number may come first in the text
    turns = tuple(_asked("number", w) for w in words)
    prompt, message, _ = _build(tokenizer, context, f"{rng.random()}", _needles(words, numbers, depths), *turns[0],
                                docs_hay(split))
    return Example(prompt, numbers[-1], (numbers[-1],), tuple(numbers[:-1]),
                   turns=((message, turns[0][1]), *turns[1:]))


def conversation(tokenizer: Any, turns: Sequence[tuple[str, str]], answers: Sequence[str] = ()) -> str:
    """A chat's text up to where the answer to ``turns[len(answers)]`` starts: each turn a user's message and the start
    of its answer, an earlier one with its answer given, through the tokenizer's chat template as the server's
    prompt-cache reuse writes it (it keeps the cached tokens the new text starts with and feeds the rest); plain text
    without a template. Starting the assistant's turn with the answer's first words is what makes a 135M instruct model
    answer with the number instead of a preamble (measured: see README). An answer follows its turn's start after one
    space, however it began (mlx_lm's server drops the space its first token starts with; its tokens had it)."""
    asked, answers = turns[: len(answers) + 1], [" " + a.strip() for a in answers]
    if not getattr(tokenizer, "chat_template", None):
        (message, prefix), *later = asked
        return f"{message}\n{prefix}" + "".join(f"{a}\n{q}\n{p}" for a, (q, p) in zip(answers, later))
    messages = []
    for (message, prefix), answer in zip(asked, answers):
        messages += [{"role": "user", "content": message}, {"role": "assistant", "content": prefix + answer}]
    messages.append({"role": "user", "content": asked[-1][0]})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + asked[-1][1]


GENERATORS: dict[str, Callable[..., Example]] = {
    "niah_single": niah_single, "niah_multikey": niah_multikey, "niah_multivalue": niah_multivalue,
    "vt": vt, "trip": trip, "followup": followup,
    "niah_single_1": _single("niah_single_1/{seed}", _word, _number, "number", lambda split: noise_hay),
    "niah_single_2": niah_single,
    "niah_single_3": _single("niah_single_3/{split}/{seed}", _word, _uuid, "uuid", docs_hay),  # 36 characters to keep
    "niah_multikey_1": niah_multikey,
    "niah_multikey_2": _single("niah_multikey_2/{seed}", _pair, _number, "number"),  # a haystack of other keys' needles
    # UUIDs to UUIDs: the hardest of the needle tasks, nothing in the key's words to go by
    "niah_multikey_3": _single("niah_multikey_3/{seed}", _uuid, _uuid, "uuid"),
    "niah_multiquery": niah_multiquery, "cwe": cwe, "fwe": fwe,
}


def example(task: str, tokenizer: TokenizerOrLenFn, context: int, seed: int, split: str = "heldout") -> Example:
    """One example of a RULER-style task."""
    return replace(GENERATORS[task](tokenizer, context, seed, split), tokens=ANSWER_TOKENS.get(task, 0))


def score(generated: str, ex: Example) -> bool:
    """The task's exact rule: every wanted item as a whole word (in order if ``ordered``), no unwanted item."""
    found = [_position(generated, item) for item in ex.wanted]
    if any(p < 0 for p in found) or any(_position(generated, item) >= 0 for item in ex.unwanted):
        return False
    return not ex.ordered or found == sorted(found)


def _position(text: str, item: str) -> int:
    """Where ``item`` first appears as a whole word (case-insensitive), -1 if it does not."""
    match = re.search(rf"(?<![\w]){re.escape(item)}(?![\w])", text, flags=re.IGNORECASE)
    return match.start() if match else -1
