"""The prefix token cache (``kvmesh.model_source.prefix_tokens``): a text's ids are the whole text's ids, whether
its leading part came from the table or not, for a real byte-level BPE tokenizer with merges; a tokenizer the
split would change is caught at construction or in use, and the cache turns itself off."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from kvmesh.contracts.keys import int32s
from kvmesh.model_source.prefix_tokens import PrefixTokens
from kvmesh.model_source.tokenizer import Tokenizer, save_byte_tokenizer
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[2]
ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    files = sorted([*REPO.glob("libs/kvmesh/**/*.py"), *REPO.glob("docs/*.md"), *REPO.glob("services/*/README.md")])
    return [f.read_text(errors="replace") for f in files]


@pytest.fixture(scope="module")
def bpe() -> RawTokenizer:
    """A byte-level BPE with 2,000 merges learned from this repo's text, ChatML specials, and a BOS added to
    every text (as Llama's tokenizers do)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2300, special_tokens=ADDED, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(_corpus(), trainer)
    bos = raw.token_to_id("<|im_start|>")
    raw.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    return raw


def encoder(raw: RawTokenizer):
    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]
    return encode


def texts(seed: int) -> list[str]:
    """Prompts that share leading parts of every length: documents, a document then a question, a document
    cut anywhere (mid-word, mid-token, mid-special-token), special tokens at the seams."""
    rng = random.Random(seed)
    docs = [d for d in _corpus() if len(d) > 3000]
    out = []
    for _ in range(40):
        doc = rng.choice(docs)
        cut = rng.randrange(1500, len(doc))
        head = doc[:cut]
        out.append(head)
        out.append(head + rng.choice(["", " ", "\n\n", "<|im_end|>", "<|im_", "'s", "1234"]) + "Question: why so?")
        out.append("<|im_start|>system\n" + head + "<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n")
    return out


def test_every_text_gets_the_whole_texts_ids_whether_its_prefix_was_known_or_not(bpe):
    cache = PrefixTokens(encoder(bpe), ADDED, capacity_bytes=64 << 20, chunk_chars=256, check_every=0)
    assert cache.enabled, cache.why_off
    encode = encoder(bpe)
    for seed in range(3):
        for text in texts(seed):
            assert cache.ids(text) == encode([text])[0]
            ids, packed = cache.ids_packed(text)  # the packed form joined from the table's packed parts
            assert ids == encode([text])[0] and packed == int32s(ids).tobytes()
    assert cache.served > 50 and cache.reused_tokens > cache.encoded_tokens  # most of it from the table


def test_a_repeated_system_prompt_is_tokenized_only_past_it(bpe):
    encode = encoder(bpe)
    calls: list[int] = []

    def counting(batch: list[str]) -> list[list[int]]:
        calls.append(sum(len(t) for t in batch))
        return encode(batch)

    cache = PrefixTokens(counting, ADDED, capacity_bytes=64 << 20, chunk_chars=512, check_every=0, probe=False)
    system = " ".join(_corpus()[0].split())[:8000]
    first = system + " Question one: what does it do?"
    second = system + " Question two: and why does it do that?"
    assert cache.ids(first) == encode([first])[0]
    calls.clear()
    assert cache.ids(second) == encode([second])[0]
    assert sum(calls) < 600  # the last chunk and the question, not 8,000 characters
    assert cache.reused_tokens > 0.9 * len(encode([system])[0])
    # the reused ids are the table's own int objects, one per id value: no new int per id and call
    again = cache.ids(second)
    reused = cache.ids(first)[:len(encode([system])[0]) // 2]
    assert all(a is b for a, b in zip(reused, again))
    assert len({id(x) for x in reused}) == len(set(reused))


def test_the_table_stays_within_its_memory_and_stays_exact_when_it_forgets(bpe):
    cache = PrefixTokens(encoder(bpe), ADDED, capacity_bytes=40_000, chunk_chars=256, check_every=0)
    encode = encoder(bpe)
    for text in texts(7):
        assert cache.ids(text) == encode([text])[0]
        assert cache.bytes <= 40_000


def test_concurrent_callers_get_their_own_texts_ids(bpe):
    cache = PrefixTokens(encoder(bpe), ADDED, capacity_bytes=1 << 20, chunk_chars=256, check_every=0)
    encode = encoder(bpe)
    work = texts(3)
    want = encode(work)
    wrong: list[int] = []

    def run(offset: int) -> None:
        for i in range(len(work)):
            j = (i + offset) % len(work)
            if cache.ids(work[j]) != want[j]:
                wrong.append(j)

    threads = [threading.Thread(target=run, args=(k * 13,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def merges_across_spaces(texts: list[str]) -> list[list[int]]:
    """A tokenizer the split would change: "s w" is one token (a merge across a space between letters)."""
    return [[1000 if piece == "s w" else ord(piece) for piece in _pieces(t)] for t in texts]


def _pieces(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        step = 3 if text.startswith("s w", i) else 1
        out.append(text[i:i + step])
        i += step
    return out


def test_a_tokenizer_that_merges_across_the_cut_is_refused_at_construction():
    cache = PrefixTokens(merges_across_spaces, ADDED, capacity_bytes=1 << 20)
    assert not cache.enabled and "does not encode a text as its parts" in cache.why_off
    text = "words words words " * 200
    assert cache.ids(text) == merges_across_spaces([text])[0]


def test_a_difference_seen_in_use_turns_the_cache_off_and_the_caller_gets_the_whole_texts_ids(caplog):
    """Exact on the probes, wrong on long texts (a stand-in for a tokenizer whose difference the probes miss):
    the sampled check catches it, answers with the whole text's ids and turns the table off."""
    def odd(texts: list[str]) -> list[list[int]]:
        return [[len(t) > 5000, *merges_across_spaces([t])[0]] if len(t) > 2000 else [ord(c) for c in t]
                for t in texts]

    cache = PrefixTokens(odd, ADDED, capacity_bytes=1 << 20, chunk_chars=512, check_every=1)
    assert cache.enabled
    doc = "alpha beta gamma delta " * 300
    cache.ids(doc)
    second = doc + " more words"
    assert cache.ids_packed(second) == (odd([second])[0], None)  # the parts' packed ids are not the whole's
    assert not cache.enabled and "differed from the whole" in cache.why_off
    assert "prefix token cache off" in caplog.text
    assert cache.ids(second) == odd([second])[0]


def test_the_checks_back_off_after_clean_ones_to_a_floor(bpe):
    """Checked at the ``check_every``-th text served from the cache, then at twice the interval after each clean
    check, never rarer than one in ``CHECK_BACKOFF`` x ``check_every``."""
    whole = []

    def counting(texts: list[str]) -> list[list[int]]:
        if len(texts) == 1 and len(texts[0]) > 2000:
            whole.append(cache.served)  # a whole long text encoded: a check (every text here is served)
        return encoder(bpe)(texts)

    cache = PrefixTokens(counting, ADDED, capacity_bytes=64 << 20, chunk_chars=512, check_every=2, probe=False)
    doc = "alpha beta gamma delta " * 200
    cache.ids(doc)  # the first text: nothing of it known, nothing served
    for n in range(200):
        cache.ids(doc + f" question {n} words")
    assert whole == [2, 6, 14, 30, 62, 94, 126, 158, 190]  # intervals 2, 4, 8, 16, 32, then 32 (16 x 2)
    assert cache.checked == len(whole) and cache.enabled


def test_the_tokenizer_adds_its_special_tokens_around_the_cached_ids(bpe, tmp_path):
    path = tmp_path / "tok"
    path.mkdir()
    bpe.save(str(path / "tokenizer.json"))
    plain, fast = Tokenizer.from_dir(path), Tokenizer.from_dir(path)
    cache = fast.reuse_prefixes(8 << 20)
    assert cache.enabled
    for text in texts(5)[:30]:
        assert fast.encode(text) == plain.encode(text)
        assert fast.encode(text)[0] == bpe.token_to_id("<|im_start|>")
        for special in (True, False):
            ids, packed = fast.encode_packed(text, special)
            assert ids == plain.encode(text, special) and packed == int32s(ids)
    assert cache.served > 0
    assert plain.encode_packed("a short one") == (plain.encode("a short one"), int32s(plain.encode("a short one")))


def test_chat_prompts_through_the_byte_tokenizer_reuse_the_system_prompt(tmp_path):
    plain = Tokenizer.from_dir(save_byte_tokenizer(tmp_path / "a"))
    fast = Tokenizer.from_dir(save_byte_tokenizer(tmp_path / "b"))
    cache = fast.reuse_prefixes(8 << 20)
    system = "You answer questions about the design and nothing else. " * 60
    for q in ("What is a block key?", "Why a pool?", "What does the router do with a prompt?"):
        chat = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        assert fast.apply_chat_template(chat) == plain.apply_chat_template(chat)
    assert cache.reused_tokens > 2 * (len(system) - 512)  # two prompts, each all but its last chunk


def test_short_texts_and_capacity_zero_are_tokenized_whole(bpe):
    calls: list[list[str]] = []

    def spy(texts: list[str]) -> list[list[int]]:
        calls.append(texts)
        return encoder(bpe)(texts)

    off = PrefixTokens(spy, ADDED, capacity_bytes=0)
    assert not off.enabled and off.ids("word " * 500) == encoder(bpe)(["word " * 500])[0]
    on = PrefixTokens(spy, ADDED, capacity_bytes=1 << 20, chunk_chars=512, probe=False)
    calls.clear()
    on.ids("short text")
    assert calls == [["short text"]]
