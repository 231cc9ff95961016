import hashlib
import json
from pathlib import Path

import pytest
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.model_source.tokenizer import IncrementalDetokenizer, Tokenizer, save_byte_tokenizer
from tokenizers import processors

MULTIBYTE = "naïve 你好, 世界 😀👍🏽 done"


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    return save_byte_tokenizer(tmp_path / "tok")


@pytest.fixture
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in ids]


def test_encode_then_decode_returns_the_text(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode(MULTIBYTE)) == MULTIBYTE


def test_encode_adds_no_special_tokens_when_the_tokenizer_has_none(tok: Tokenizer) -> None:
    assert tok.encode("hi") == [tok.encode("h")[0], tok.encode("i")[0]]


def test_encode_adds_bos_when_the_tokenizer_says_so(tok_dir: Path) -> None:
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    bos = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    data["post_processor"] = json.loads(bos.__getstate__())
    (tok_dir / "tokenizer.json").write_text(json.dumps(data))
    assert Tokenizer.from_dir(tok_dir).encode("hi")[0] == 1


def test_a_long_text_gets_the_ids_it_gets_with_the_gil_held(tok_dir: Path) -> None:
    """Long texts go through encode_batch_fast (the GIL released): the ids are the plain encode's, with and without
    special tokens, a BOS post-processor and special-token text inside the prompt."""
    from kvmesh.model_source.tokenizer import RELEASE_GIL_CHARS

    data = json.loads((tok_dir / "tokenizer.json").read_text())
    bos = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    data["post_processor"] = json.loads(bos.__getstate__())
    (tok_dir / "tokenizer.json").write_text(json.dumps(data))
    tok = Tokenizer.from_dir(tok_dir)
    text = (MULTIBYTE + " <|im_end|>\n") * (RELEASE_GIL_CHARS // len(MULTIBYTE) + 1)
    assert len(text) >= RELEASE_GIL_CHARS
    raw = tok._tok
    assert tok.encode(text) == raw.encode(text, add_special_tokens=True).ids
    chat = [{"role": "user", "content": text}]
    rendered = tok.decode(tok.apply_chat_template(chat), skip_special_tokens=False)
    assert tok.apply_chat_template(chat) == raw.encode(rendered, add_special_tokens=False).ids


def test_apply_chat_template_renders_chatml_with_generation_prompt(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids[0] == 1  # <|im_start|> is one special token, not its characters


def test_apply_chat_template_without_generation_prompt_ends_after_the_last_turn(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tok.decode(ids, skip_special_tokens=False).endswith("hi<|im_end|>\n")


def test_decode_skips_special_tokens_by_default(tok: Tokenizer) -> None:
    assert tok.decode([1, *tok.encode("ok"), 2]) == "ok"


def test_eos_token_ids_include_the_ids_the_model_config_declares(tok_dir: Path) -> None:
    (tok_dir / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == (2, 0)


def test_fingerprint_is_sha256_of_tokenizer_json(tok_dir: Path, tok: Tokenizer) -> None:
    assert tok.fingerprint == hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()


def test_byte_tokenizer_fits_the_tiny_model_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size <= ModelConfig.tiny().vocab_size
    assert max(tok.encode(MULTIBYTE)) < tok.vocab_size


def test_detokenizer_deltas_concatenate_to_the_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    assert "".join(stream(tok, ids)) == tok.decode(ids) == MULTIBYTE


def test_detokenizer_never_emits_a_partial_character(tok: Tokenizer) -> None:
    deltas = stream(tok, tok.encode(MULTIBYTE))
    assert not any("\ufffd" in d for d in deltas)
    assert "😀" in deltas and "你" in deltas


def test_detokenizer_holds_back_an_incomplete_character(tok: Tokenizer) -> None:
    first_byte_of_emoji = tok.encode("😀")[0]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(first_byte_of_emoji) == "" and detok.text == ""


def test_detokenizer_flush_emits_an_unfinished_character_as_replacement(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    detok.push(tok.encode("a")[0])
    detok.push(tok.encode("😀")[0])
    assert detok.flush() == "\ufffd" and detok.text == "a\ufffd"


def test_detokenizer_text_skips_special_tokens(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    for i in [*tok.encode("a"), 2, *tok.encode("b")]:
        detok.push(i)
    assert detok.text == "ab"


def test_ids_text_and_chat_template_match_transformers_fast_tokenizer(tok_dir: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": MULTIBYTE}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == list(hf.encode(rendered, add_special_tokens=False))
    assert tok.encode(MULTIBYTE) == list(hf.encode(MULTIBYTE))
    ids = [1, *tok.encode(MULTIBYTE), 2]
    assert [tok.decode(ids, skip) for skip in (True, False)] == [hf.decode(ids, skip_special_tokens=s)
                                                                 for s in (True, False)]
    assert (tok.vocab_size, tok.eos_token_ids) == (len(hf), (hf.eos_token_id,))


def test_a_tokenizer_without_a_chat_template_says_to_send_a_plain_prompt(tok_dir: Path) -> None:
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tok_dir).apply_chat_template([{"role": "user", "content": "hi"}])
