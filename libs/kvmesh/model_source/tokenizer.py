"""Text <-> token ids for one model directory, and streaming detokenization.

Built on the ``tokenizers`` library (``tokenizer.json``) and jinja2 (the chat template), not on transformers,
whose tokenizer classes import torch: the router tokenizes every request and must stay light.
"""

from __future__ import annotations

import functools
import hashlib
import json
from array import array
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RawTokenizer

from kvmesh.contracts.keys import int32s
from kvmesh.model_source.prefix_tokens import PrefixTokens

CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "tools", *SPECIAL_TOKEN_NAMES})
RELEASE_GIL_CHARS = 2048  # texts this long are encoded with the GIL released (``Tokenizer._ids``): ~500 tokens


class Tokenizer:
    """A model directory's fast tokenizer (``tokenizer.json``), its special tokens and chat template
    (``tokenizer_config.json`` or ``chat_template.jinja``), read offline. Encodes, decodes and renders
    chat templates as transformers' ``PreTrainedTokenizerFast`` does."""

    def __init__(self, raw: RawTokenizer, fingerprint: str, config: dict[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos: tuple[int, ...] = ()) -> None:
        self._tok = raw
        self.fingerprint = fingerprint  # sha256 of tokenizer.json: part of every block key's namespace
        config = config or {}
        self.special_tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES
                               if _token_text(config.get(name)) is not None}
        self.chat_template = chat_template
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        eos = self.special_tokens.get("eos_token")
        eos_id = raw.token_to_id(eos) if eos is not None else None
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*([eos_id] if eos_id is not None else []),
                                                                    *extra_eos]))
        self._token_texts: dict[int, str] = {}
        # without offsets (tokenizers 0.20 may lack it: then encode_batch, which computes them too)
        self._encode_long = getattr(raw, "encode_batch_fast", raw.encode_batch)
        self.prefix_tokens: PrefixTokens | None = None
        self._specials: tuple[list[int], list[int]] | None = None  # what ``encode`` adds around a text's ids

    @property
    def special_texts(self) -> frozenset[str]:
        """The contents of the added tokens marked special: what a decode that skips special tokens leaves out."""
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def reuse_prefixes(self, capacity_bytes: int) -> PrefixTokens:
        """Tokenize long texts through a :class:`PrefixTokens` of ``capacity_bytes``: only what a text adds to a
        leading part seen before is tokenized (same ids; the table checks this tokenizer first and stays off
        where it would not be exact)."""
        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in self._encode_long(texts, add_special_tokens=False)]

        added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        self.prefix_tokens = PrefixTokens(encode, added, capacity_bytes)
        self._specials = _specials_around(self._tok)
        return self.prefix_tokens

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        data = (path / "tokenizer.json").read_bytes()
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(RawTokenizer.from_str(data.decode()), hashlib.sha256(data).hexdigest(), config,
                   _chat_template(path, config), _eos_ids_in(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens (e.g. BOS) only where the model's tokenizer adds them (none with
        ``add_special_tokens`` false)."""
        return self._ids(text, add_special_tokens)[0]

    def encode_packed(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], array]:
        """``encode``'s ids, and the same packed as int32 (``kvmesh.contracts.keys.int32s``): joined from the prefix
        token cache's packed parts where it served the text (packing 4k ids costs ~25 us), else packed here."""
        ids, packed = self._ids(text, add_special_tokens)
        if packed is None:
            return ids, int32s(ids)
        out = array("i")
        out.frombytes(packed)
        return ids, out

    def _ids(self, text: str, special: bool) -> tuple[list[int], bytes | None]:
        """The ids of ``text``, and the same packed where the prefix token cache served them. A long text goes
        through ``encode_batch_fast``, which releases the GIL while it runs (``encode`` holds it throughout):
        other threads, and an event loop that handed the work to a thread, keep running, and several prompts are
        tokenized on several cores. It skips the character offsets nothing here reads (a fifth less CPU on a
        4k-token prompt, ``kvmesh bench routers``). Same ids either way."""
        if len(text) >= RELEASE_GIL_CHARS:
            cache = self.prefix_tokens
            if cache is not None and cache.enabled and (not special or self._specials is not None):
                ids, packed = cache.ids_packed(text)
                if special and self._specials is not None:
                    head, tail = self._specials
                    if head or tail:  # most tokenizers add nothing around a text: no copy of its ids then
                        ids = head + ids + tail
                        packed = None if packed is None else \
                            int32s(head).tobytes() + packed + int32s(tail).tobytes()
                return ids, packed
            return self._encode_long([text], add_special_tokens=special)[0].ids, None
        return self._tok.encode(text, add_special_tokens=special).ids, None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone (a special token as itself; part of a multi-byte character as
        U+FFFD), as vLLM names the tokens of logprobs. Cached: at most one entry per id of the vocabulary."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """The model's chat template rendered (``render_chat``) and tokenized."""
        return self._ids(self.render_chat(messages, add_generation_prompt, tools, continue_final_message, extra),
                         False)[0]

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The model's chat template rendered, to be tokenized without special tokens (the template writes its own).
        ``tools``: the functions offered (``{"type": "function", "function": {...}}``), for a template that reads
        them (``takes_tools``). ``continue_final_message``: the text ends where the last message's content does
        (no end of turn after it: the model goes on with it), as transformers cuts it. ``extra``: more variables
        for the template (a request's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``); none may be
        one of those above (``RESERVED_TEMPLATE_NAMES``)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja): send a plain prompt instead of messages")
        clash = set(extra or ()) & RESERVED_TEMPLATE_NAMES
        if clash:
            raise ValueError(f"template variables {sorted(clash)} are set by the renderer, not the request")
        text = _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
            **self.special_tokens, **({"tools": tools} if tools else {}), **(extra or {}))
        if continue_final_message:
            final = str(messages[-1].get("content") or "").strip()
            end = text.rfind(final) if final else -1
            if end < 0:
                raise ValueError("the chat template does not write the last message's content as given, so it "
                                 "cannot be continued")
            text = text[:end + len(final)]
        return text

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list (Qwen's, Llama 3.1's, Hermes' do)."""
        return self.chat_template is not None and "tools" in _variables(self.chat_template)

    @property
    def takes_tool_calls(self) -> bool:
        """Whether the chat template renders an assistant message's ``tool_calls``."""
        return self.chat_template is not None and "tool_calls" in self.chat_template


def _specials_around(raw: RawTokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a single text's (a BOS, an EOS), when they are the
    same for every text; None when they are not (then texts with special tokens are encoded whole)."""
    probes = ("Hello world, a first probe.", "Another probe text with more words in it than the first one.")
    around = set()
    for text in probes:
        bare = raw.encode(text, add_special_tokens=False).ids
        full = raw.encode(text, add_special_tokens=True).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                around.add((tuple(full[:i]), tuple(full[i + len(bare):])))
                break
        else:
            return None
    if len(around) != 1:
        return None
    head, tail = around.pop()
    return list(head), list(tail)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja beside the tokenizer, else tokenizer_config.json's
    (a string, or a list of named templates of which ``default`` is the one)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: jinja's own escapes HTML characters, which a prompt must not see."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
_TEMPLATES: dict[str, Any] = {}


def _compile(template: str) -> Any:
    """Chat templates come from model repositories: untrusted code, hence the sandbox (transformers' setup)."""
    if template not in _TEMPLATES:
        _TEMPLATES[template] = _ENV.from_string(template)
    return _TEMPLATES[template]


@functools.lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str]:
    """The names a template reads from its context."""
    return frozenset(meta.find_undeclared_variables(_ENV.parse(template)))


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``, for tokenizers whose config asks for it."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


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
    from tokenizers import decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    to_char = _bytes_to_unicode()
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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}
