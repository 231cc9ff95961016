"""Text <-> token ids for one model directory, and streaming detokenization."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Tokenizer:
    """A Hugging Face fast tokenizer loaded offline from a model directory."""

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, fingerprint: str, extra_eos: tuple[int, ...] = ()
    ) -> None:
        self._tok = hf_tokenizer
        self.fingerprint = fingerprint  # sha256 of tokenizer.json: part of every block key's namespace
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos]))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        tok_json = path / "tokenizer.json"
        data = tok_json.read_bytes() if tok_json.exists() else tok.backend_tokenizer.to_str().encode()
        return cls(tok, hashlib.sha256(data).hexdigest(), _eos_ids_in(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens (e.g. BOS) only where the model's tokenizer adds them."""
        return list(self._tok.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The model's chat template rendered and tokenized (the template writes its own special tokens)."""
        text = self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return list(self._tok.encode(text, add_special_tokens=False))


def _eos_ids_in(path: Path) -> tuple[int, ...]:
    """EOS ids the model declares next to its tokenizer (generation_config.json, config.json)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            eos = json.loads((path / name).read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a multi-byte character.

    vLLM's method: decode the window [prefix_offset:] and emit what it adds beyond the already-emitted
    window [prefix_offset:read_offset]; text that ends in U+FFFD is an incomplete byte sequence and is held.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a stream: emit whatever is held back, even an incomplete character (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        window = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(window) <= len(prefix) or (window.endswith("\ufffd") and not final):
            return ""
        delta = window[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += delta
        return delta


def save_byte_tokenizer(out_dir: str | Path, chat_template: str = CHATML_TEMPLATE) -> Path:
    """Write a tiny byte-level tokenizer (no merges, ChatML specials) that fits ModelConfig.tiny()'s vocab.

    Ids: 0 <|endoftext|>, 1 <|im_start|> (bos), 2 <|im_end|> (eos), then one token per byte that can occur
    in UTF-8 text (0xC0, 0xC1 and 0xF5-0xFF never do), 246 ids in all.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    to_char = bytes_to_unicode()  # GPT-2's printable stand-in for each byte
    utf8_bytes = [b for b in range(0xF5) if b not in (0xC0, 0xC1)]
    vocab = {tok: i for i, tok in enumerate(specials + [to_char[b] for b in utf8_bytes])}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(specials)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[1],
        "eos_token": specials[2],
        "pad_token": specials[2],
        "unk_token": specials[0],
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
