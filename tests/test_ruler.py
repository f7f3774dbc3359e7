"""RULER-style tasks: prompt length, where the answer is, split hygiene, scoring rules, and eval resuming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from veloxpatch.assets import model_path
from veloxpatch.cli import main
from veloxpatch.eval import harness, ruler, sharing, tasks


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path()))


class ChatTokenizer:
    """The shipped tokenizer with a stand-in chat template, to check the chat path without a real model."""

    chat_template = "stand-in"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "".join(f"<user>{m['content']}</user>" for m in messages) + "<assistant>"


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("context", [512, 2048])
def test_prompts_fill_the_context_and_hold_the_answer(tokenizer: Any, task: str, context: int) -> None:
    ex = ruler.example(task, tokenizer, context, seed=3)
    n = len(tokenizer.encode(ex.prompt))
    assert context * 0.97 <= n <= context, n
    body, question = ex.prompt.rsplit("\n\n", 1)[0], ex.prompt.splitlines()[-2]
    assert all(item in body for item in ex.wanted) and all(item in body for item in ex.unwanted)
    assert not any(item in question for item in ex.wanted if item.isdigit() and task != "vt")
    assert ex == ruler.example(task, tokenizer, context, seed=3), "deterministic by seed"
    assert ex != ruler.example(task, tokenizer, context, seed=4)


@pytest.mark.parametrize("task", [t for t in ruler.RULER_TASKS if t not in ruler.TASKS])
def test_ruler_tasks_fill_the_context_and_split_at_the_question(tokenizer: Any, task: str) -> None:
    """RULER's own tasks: the prompt fills the context, every wanted item is in the context and none in the question,
    the context and the question make the prompt, and an example is a function of its seed."""
    ex = ruler.example(task, tokenizer, 2048, seed=3)
    n = len(tokenizer.encode(ex.prompt))
    assert 2048 * 0.97 <= n <= 2048, n
    assert ex.context + ex.question == ex.prompt and ex.question.startswith(("What", "Find"))
    assert all(item in ex.context for item in ex.wanted)
    assert not any(item in ex.question for item in ex.wanted)
    assert ex == ruler.example(task, tokenizer, 2048, seed=3)
    assert ex != ruler.example(task, tokenizer, 2048, seed=4)


def test_a_list_answer_gets_rulers_tokens_and_a_single_one_its_own_length(tokenizer: Any) -> None:
    """A numbered list of four seven-digit numbers takes about 46 tokens, more than the answer's own 34 and a few:
    list tasks generate RULER's number of tokens; a single answer its own length and eight."""
    many = ruler.example("niah_multiquery", tokenizer, 1024, seed=0)
    listed = ":\n\n" + "".join(f"{i}. {n}\n" for i, n in enumerate(many.wanted, start=1))
    assert harness._steps(tokenizer, many) == 128 >= len(tokenizer.encode(listed))
    one = ruler.example("niah_single_2", tokenizer, 1024, seed=0)
    assert harness._steps(tokenizer, one) == len(tokenizer.encode(one.answer)) + 8
    assert all(ruler.example(t, tokenizer, 1024, seed=0).tokens == n > 0 for t, n in ruler.ANSWER_TOKENS.items())
    assert {ruler.example(t, tokenizer, 1024, seed=0).tokens for t in ("niah_single_1", "niah_multikey_1", "trip")} \
        == {0}


def test_haystacks_of_needles_and_noise(tokenizer: Any) -> None:
    """niah_single_1 hides its needle in repeated noise; niah_multikey_2/3 in needles for other keys, the asked key
    once and its value once."""
    noise = ruler.example("niah_single_1", tokenizer, 1024, seed=0)
    assert noise.context.count(ruler.NOISE) > 20 and noise.context.count("special magic") == 1
    for task, kind in (("niah_multikey_2", "numbers"), ("niah_multikey_3", "uuids")):
        ex = ruler.example(task, tokenizer, 1024, seed=0)
        key = ex.question.split(" for ")[1].split(" mentioned")[0]
        assert ex.context.count(f"special magic {kind} for") > 10
        assert ex.context.count(f"for {key} is") == 1 and ex.context.count(ex.wanted[0]) == 1


def test_word_counting_tasks_count_right(tokenizer: Any) -> None:
    """cwe: the asked words are the ten that appear thirty times, every other at most three; fwe: the asked words
    are the three most frequent, each strictly more frequent than any other."""
    import re
    from collections import Counter

    cwe = ruler.cwe(tokenizer, 4096, seed=1)
    counts = Counter(re.findall(r"^\d+\. (\w+)$", cwe.context, flags=re.MULTILINE))
    assert {w: counts[w] for w in cwe.wanted} == {w: 30 for w in cwe.wanted}
    assert max(c for w, c in counts.items() if w not in cwe.wanted) == 3 and len(counts) > 100
    fwe = ruler.fwe(tokenizer, 4096, seed=1)
    counts = Counter(fwe.context.split("\n\n", 1)[1].split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[:3] == list(fwe.wanted) and counts[ranked[2]] > counts[ranked[3]]


def test_needles_spread_and_keep_their_order(tokenizer: Any) -> None:
    ex = ruler.trip(tokenizer, 2048, seed=0)
    where = [ex.prompt.index(f"arrived in {city}.") for city in ex.wanted]
    assert where == sorted(where) and where[-1] - where[0] > len(ex.prompt) / 3
    vt = ruler.vt(tokenizer, 2048, seed=0)
    value = vt.prompt.split("assigned the value ")[1].split()[0]
    assert f"VAR {vt.wanted[0]} = {value}\n" in vt.prompt
    assert all(f"VAR {b} = VAR {a}\n" in vt.prompt for a, b in zip(vt.wanted, vt.wanted[1:]))


def test_question_goes_through_the_chat_template(tokenizer: Any) -> None:
    ex = ruler.niah_single(ChatTokenizer(tokenizer), 400, seed=0)
    assert ex.prompt.startswith("<user>" + ruler.INSTRUCTION)
    assert "mentioned in the provided text?</user><assistant>The special magic number for" in ex.prompt
    plain = ruler.niah_single(tokenizer, 400, seed=0)
    assert plain.prompt.startswith(ruler.INSTRUCTION) and "<user>" not in plain.prompt


def test_train_and_heldout_haystacks_do_not_overlap() -> None:
    from pydoc_data.topics import topics

    held = {k for k in topics if tasks.split_of(k, ruler.HELDOUT_MOD) == "heldout"}
    assert 0 < len(held) < len(topics) / 2
    train_text, held_text = ruler.haystack_text("train"), ruler.haystack_text("heldout")
    assert all(topics[k].strip("\n") in held_text and topics[k].strip("\n") not in train_text for k in held)
    assert len(held_text) > 8192 * 5, "enough held-out text for an 8k prompt"
    for cue in ("magic number", "VAR ", "the traveller"):
        assert cue not in train_text + held_text


def test_scoring_rules_accept_right_and_reject_wrong() -> None:
    single = ruler.Example("", "1234567", ("1234567",))
    assert ruler.score(" 1234567.", single) and not ruler.score(" 12345678", single)
    assert not ruler.score(" 1234566", single)
    multikey = ruler.Example("", "111", ("111",), ("222", "333"))
    assert ruler.score("111", multikey) and not ruler.score("111, 222", multikey)
    multivalue = ruler.Example("", "1, 2, 3", ("11", "22", "33"))
    assert ruler.score("33, 11 and 22", multivalue) and not ruler.score("11, 22", multivalue)
    vt = ruler.Example("", "ABCDE FGHIJ", ("ABCDE", "FGHIJ"), ("KLMNO",))
    assert ruler.score("abcde, FGHIJ", vt) and not ruler.score("ABCDE FGHIJ KLMNO", vt)
    trip = ruler.Example("", "Oslo, Lima", ("Oslo", "Lima"), ordered=True)
    assert ruler.score(" Oslo, then Lima.", trip) and not ruler.score(" Lima, Oslo", trip)
    assert not ruler.score(" Oslo", trip)


def test_eval_runs_ruler_tasks_and_a_rerun_skips_finished_cells(model_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "eval"
    args = ["eval", "--model", str(model_dir), "--tasks", "niah_single,trip", "--contexts", "200",
            "--samples", "1", "--budgets", "100%,50%", "--methods", "snapkv", "--out", str(out), "--no-plots"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    journal = [json.loads(line) for line in (out / "eval.cells.jsonl").read_text().splitlines()]
    assert [(r["task"], r["label"]) for r in journal] == [("niah_single", "full"), ("niah_single", "snapkv@0.5"),
                                                          ("trip", "full"), ("trip", "snapkv@0.5")]
    assert journal[0]["key"]["prefill_step"] == 2048, "mlx_lm's default prefill step with --model"

    def must_not_run(*_: Any) -> None:
        raise AssertionError("a finished cell was measured again")

    monkeypatch.setattr(harness, "measure", must_not_run)
    second = CliRunner().invoke(main, args)
    assert second.exit_code == 0, second.output
    assert json.loads((out / "eval.json").read_text())["rows"] == [
        {k: v for k, v in r.items() if k != "key"} for r in journal]
    changed = CliRunner().invoke(main, args + ["--seed", "1"])
    assert changed.exit_code != 0 and "measured again" in repr(changed.exception), "other arguments recompute"


def test_a_run_of_other_variants_into_the_folder_keeps_the_earlier_cells_in_its_tables(model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """eval.csv and eval.json are every cell the folder's journal holds under the run's arguments, not only the
    variants this run asked for (a journal grown by several runs, each adding a variant)."""
    out = tmp_path / "eval"
    common = ["eval", "--model", str(model_dir), "--tasks", "niah_single", "--contexts", "200", "--samples", "1",
              "--budgets", "50%", "--out", str(out), "--no-plots"]
    for method in ("snapkv", "streamingllm"):
        result = CliRunner().invoke(main, [*common, "--methods", method])
        assert result.exit_code == 0, result.output
    rows = json.loads((out / "eval.json").read_text())["rows"]
    assert sorted(r["label"] for r in rows) == ["full", "snapkv@0.5", "streamingllm@0.5"]
    assert "snapkv@0.5" in (out / "eval.csv").read_text()


class ConversationTokenizer(ChatTokenizer):
    """A stand-in chat template that writes every role, as real ones do."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                            **_: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@pytest.mark.parametrize("chat", [False, True])
def test_a_followup_asks_the_other_number_in_a_conversation_that_starts_with_the_first_turn(
        tokenizer: Any, chat: bool) -> None:
    tok = ConversationTokenizer(tokenizer) if chat else tokenizer
    ex = ruler.followup(tok, 1024, seed=2)
    first_word = ex.turns[0][0].split("magic number for ")[1].split()[0]
    second_word = ex.turns[1][0].split("magic number for ")[1].split()[0]
    assert first_word != second_word and ex.wanted != ex.unwanted
    assert f"numbers for {first_word} is: {ex.unwanted[0]}." in ex.prompt
    assert f"numbers for {second_word} is: {ex.wanted[0]}." in ex.prompt, "both facts are in the document"
    conversation = ruler.conversation(tok, ex.turns, [f" {ex.unwanted[0]}."])
    assert conversation.startswith(ex.prompt + f" {ex.unwanted[0]}."), "a cache of the first turn is its prefix"
    assert conversation.endswith(ex.turns[1][1]) and ex.turns[1][0] in conversation[len(ex.prompt):]
    assert ruler.score(f" {ex.wanted[0]}.", ex) and not ruler.score(f" {ex.wanted[0]}, {ex.unwanted[0]}", ex)


def test_a_followup_of_three_facts_asks_each_in_its_turn(tokenizer: Any) -> None:
    ex = ruler.followup(tokenizer, 1024, seed=2, facts=3)
    words = [message.split("magic number for ")[1].split()[0] for message, _ in ex.turns]
    numbers = (*ex.unwanted, *ex.wanted)
    assert len(set(words)) == 3 and len(set(numbers)) == 3 and ex.answer == numbers[2]
    for word, number in zip(words, numbers):
        assert ex.prompt.count(f"numbers for {word} is: {number}.") == 1, "each fact once in the document"
    conversation = ruler.conversation(tokenizer, ex.turns, [f" {numbers[0]}.", f" {numbers[1]}."])
    assert conversation.startswith(ex.prompt) and conversation.endswith(ex.turns[2][1])
    assert ruler.followup(tokenizer, 1024, seed=2) == ruler.followup(tokenizer, 1024, seed=2, facts=2), "two: as ever"


def test_the_second_turn_reads_only_what_the_caches_do_not_hold(model_dir: Path, monkeypatch) -> None:
    """As the server's prompt-cache reuse: the caches keep the longest prefix of the new conversation's tokens
    they hold, and only the rest is read."""
    from mlx_lm.utils import load

    model, tok = load(str(model_dir))
    item = ruler.followup(tok, 300, seed=0)
    turns: list[tuple[list[int], int, list[int]]] = []  # (tokens fed, tokens the caches held before, answer)
    conversations: list[str] = []
    whole, conversation = sharing.whole, ruler.conversation

    def recorded(model, tokens, caches, *args, **kwargs):
        held = caches[0].offset
        out = whole(model, tokens, caches, *args, **kwargs)
        turns.append((tokens.tolist(), held, [t for t, _ in out]))
        return out

    monkeypatch.setattr(sharing, "whole", recorded)
    monkeypatch.setattr(ruler, "conversation",
                        lambda *args: conversations.append(conversation(*args)) or conversations[-1])
    variant = harness.variants(["snapkv"], [0.25])[-1]
    sample = harness.conversation(model, tok, variant, item, harness.EvalSpec(prefill_step=128))
    (first, start, answer), (second, held, _) = turns
    cached, full = first + answer, tok.encode(conversations[1])  # [0]: the first turn's, the prompt
    common = 0
    while common < min(len(cached), len(full)) and cached[common] == full[common]:
        common += 1
    assert start == 0 and first == tok.encode(item.prompt)
    assert held == common and second == full[common:] and held >= len(first) - 1
    assert sample.read_peak_bytes and sample.read_peak_bytes > 0, "reading both turns' prompts took memory"


def equal_bytes_eval(model_dir: Path, out: Path, question: str, budgets: str, methods: str) -> list[dict]:
    """``veloxpatch eval --equal-bytes`` of one niah_single_1 example at 400 tokens into ``out``: its table's rows."""
    args = ["eval", "--model", str(model_dir), "--tasks", "niah_single_1", "--contexts", "400", "--samples", "1",
            "--budgets", budgets, "--methods", methods, "--question", question, "--equal-bytes", "--out", str(out),
            "--no-plots"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "eval.json").read_text())["rows"]


def test_question_after_at_equal_bytes_through_the_cli(model_dir: Path, tmp_path: Path) -> None:
    """--question after --equal-bytes: each variant's 16-bit bytes once the context is read land near its share of
    the full cache's (a budget measured per method: rows, positions, the tier), the journal says the protocol, and a
    rerun reuses it."""
    out, methods = tmp_path / "eval", "snapkv,rotating,snapkv[compress=chunk,tier=8]"
    rows = equal_bytes_eval(model_dir, out, "after", "100%,50%", methods)
    shares = {r["label"]: r["kv16_share"] for r in rows}
    assert shares["full"] == 1.0 and len(shares) == 4
    assert all(0.4 <= s <= 0.6 for label, s in shares.items() if label != "full"), shares
    journal = [json.loads(line) for line in (out / "eval.cells.jsonl").read_text().splitlines()]
    assert {(r["key"]["protocol"], r["key"]["equal_bytes"]) for r in journal} == {("after", True)}
    assert equal_bytes_eval(model_dir, out, "after", "100%,50%", methods) == rows


def test_question_inside_at_equal_bytes_records_every_variants_16_bit_share(model_dir: Path, tmp_path: Path) -> None:
    """--question inside --equal-bytes: a shared prefill's variants (snapkv in ``end`` mode) and those on their own
    prefill (the chunk-mode default, mlx_lm's quantized cache) all get their 16-bit share, as asked after."""
    rows = equal_bytes_eval(model_dir, tmp_path / "eval", "inside", "50%",
                            "snapkv,snapkv[compress=chunk,tier=8],quantized[bits=8]")
    shares = {r["label"]: r["kv16_share"] for r in rows}
    assert shares["full"] == 1.0 and len(shares) == 4 and None not in shares.values(), shares
    assert all(0.35 <= s <= 0.65 for label, s in shares.items() if label.startswith("snapkv")), shares


def test_the_context_is_compressed_before_the_question_comes(model_dir: Path, tokenizer: Any) -> None:
    """What the question-after protocol rests on: a generation of no tokens over the context leaves our cache
    compressed (at most its budget and the decode headroom), so the question is asked of what survived."""
    from mlx_lm import load

    from veloxpatch.eval.variants import Variant

    model, _ = load(str(model_dir))
    ex = ruler.example("niah_single_2", tokenizer, 600, seed=1)
    context = harness.mx.array(tokenizer.encode(ex.context))
    caches = Variant.of("snapkv", 0.25).caches(model, context.size, budget=64)
    try:
        assert sharing.whole(model, context, caches, 0, 2048) == []
        assert all(64 <= c.size() <= 64 + c.schedule.headroom(64) for c in sharing.ours(caches))
        assert all(c.offset == context.size for c in caches)
    finally:
        harness.veloxpatch.unpatch()


def test_held_bytes_count_a_16_bit_models_caches() -> None:
    """float32 rows count half; a quantized cache's packed values count whole and its float32 scales half."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from veloxpatch.eval.equal_bytes import held_bytes

    keys = mx.random.normal((1, 2, 256, 64))
    dense = KVCache()
    dense.update_and_fetch(keys, keys)
    assert held_bytes([dense]) == dense.nbytes / 2
    quantized = QuantizedKVCache(group_size=64, bits=4)
    quantized.update_and_fetch(keys, keys)
    packed = sum(a.nbytes for a in (quantized.keys[0], quantized.values[0]))
    scales = sum(a.nbytes for part in (quantized.keys, quantized.values) for a in part[1:])
    assert held_bytes([quantized]) == packed + scales / 2
    assert held_bytes([quantized]) / held_bytes([dense]) == (4 + 2 * 16 / 64) / 16  # mlx_lm's 4-bit cache: 0.28


def test_usage_counts_what_a_16_bit_model_would_hold() -> None:
    """``stats.held`` (the server's ``usage.velox``): a float32 cache's 16-bit bytes are half its bytes, and a quant
    cache keeping an eighth of the bytes (``0.125x``) holds about that share of the full cache's, counted so."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from conftest import greedy, random_tokens, tiny
    from veloxpatch import stats

    keys = mx.random.normal((1, 2, 256, 64))
    dense = KVCache()
    dense.update_and_fetch(keys, keys)
    held = stats.held([dense])
    assert held["kv_bytes_16bit"] == held["dense_kv_bytes_16bit"] == dense.nbytes // 2
    model = tiny("llama", layers=2)
    harness.veloxpatch.patch(kv="quant", window=32, compress="chunk", knobs={"quant_keep": "0.125x"})
    try:
        from mlx_lm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model)
        greedy(model, random_tokens(1025, 3), caches, steps=1, chunk=256)
        held = stats.held(caches)
        assert held["dense_kv_bytes_16bit"] == held["dense_kv_bytes"] // 2
        assert abs(held["kv_bytes_16bit"] / held["dense_kv_bytes_16bit"] - 0.125) < 0.02, held  # blocks of 64 rows
    finally:
        harness.veloxpatch.unpatch()


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_a_chats_kv_bytes_are_what_its_caches_hold_with_or_without_equal_bytes(model_dir: Path, method: str) -> None:
    """``--equal-bytes`` adds the 16-bit count beside the KV bytes; it does not change them (H2O's queued queries,
    folded into the row columns when its state is read, counted as held either way)."""
    from mlx_lm.utils import load

    model, tok = load(str(model_dir))
    item = ruler.followup(tok, 300, seed=0)
    variant = harness.variants([method], [0.25])[-1]
    alone, counted = (harness.conversation(model, tok, variant, item, harness.EvalSpec(prefill_step=128,
                                                                                     equal_bytes=measured))
                      for measured in (False, True))
    assert alone.kv16_bytes is None and counted.kv16_bytes is not None
    assert counted.kv_bytes == alone.kv_bytes
