"""Token ids of texts' leading parts, reused when a later text starts with the same characters.

A router tokenizes every prompt, and most prompts repeat a leading part another prompt had: a tenant's system
prompt, a conversation's earlier turns, an agent's transcript. Tokenizing is the router's largest cost per request
(a 4k-token prompt: ~9 ms of one core, mostly the byte-level pre-tokenizer's regex), so :class:`PrefixTokens`
keeps the ids of the parts it has seen and tokenizes only what is new.

**Exact, by splitting only where the tokenizer splits anyway.** A byte-level BPE tokenizer (no normalizer)
encodes a text as the concatenation of its pre-tokens' encodings, and a pre-token boundary falls before a space
that follows an ASCII letter and precedes one (``"word| word"``), whatever came before: the match that ends at
the letter stops there, and the next one starts at the space and reads only what follows. So the text is cut into
segments at such points (one near every ``chunk_chars`` characters; none within reach of an added token, whose
matching runs on the raw text first), each segment is encoded alone (all in one ``encode_batch_fast`` call), and
the ids are the segments' ids in order. The cut points depend only on the characters before them (a point's
chunk is fixed by its position, its guard reads at most ``guard`` characters around it), so two texts that share
the characters up to a chunk's end share its cut point and the ids before it: a text's chunk boundaries are keyed
by a hash of everything before them (xxh3-128), and the deepest boundary already known gives the ids up to its
cut point, so only the rest is tokenized.

That property is the tokenizer's, not every tokenizer's, so it is **checked before use**: at construction, probe
texts (prose, code, digits, non-Latin scripts, added tokens, odd whitespace) are encoded whole and through the
cache at a small chunk size; any difference and the cache stays off for that tokenizer (``enabled`` False,
``why_off`` says why). In use, texts served from the cache are also encoded whole and compared, the
``check_every``-th first and then at twice the interval after each clean check, down to one in
``CHECK_BACKOFF`` x ``check_every``; a difference turns the cache off for good, logged with where the ids first
differ. (A whole encode costs ~40 times a cached one: checking one text in 100 for good was 20% of the router's
tokenizing, 4% of its CPU, in ``kvmesh bench routers``.)
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvmesh.contracts.keys import int32s

log = logging.getLogger(__name__)

Encode = Callable[[list[str]], list[list[int]]]  # texts -> their ids, without special tokens, in order

_PROBES = (
    ("The quick brown fox jumps over the lazy dog. It's what they'd said: we're sure you'll see, I've done it, "
     "and I'm done. Numbers 1234567 and 3.14159, dates 2026-12-04, prices $19.99 and 5%.  Two  spaces, three   "
     "spaces,\ttabs\t\tand\nnew lines\n\n\nand trailing spaces   \nback to words words words words words words."),
    "def f(x):\n    return [y for y in range(x) if y % 2 == 0]  # a comment\n\nclass A:\n    pass\n" * 3,
    ("Übermäßig schöne Grüße aus Köln. Ça va très bien, merci. Съешь же ещё этих мягких французских булок. "
     "日本語のテキストとEnglish words mixed together words. 中文 text here with words. émoji 🙂 words end."),
    ("<|im_start|>system\nYou are a helpful assistant and you answer briefly.<|im_end|>\n<|im_start|>user\n"
     "What is the capital of France and why is it Paris?<|im_end|>\n<|im_start|>assistant\nParis is the capital "
     "<|endoftext|> words after an end token and words <|im_end|>words<|im_start|> words before it."),
    ("a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G H I J K L M N O P Q R S T U V W X Y Z "
     "aa bb cc dd ee ff gg hh ii jj kk ll mm nn oo pp qq rr ss tt uu vv ww xx yy zz 's 't 're 've 'm 'll 'd x's"),
    "words " * 80 + "\u00a0non\u00a0breaking\u3000ideographic space words\r\nwindows line words.",
)


@dataclass(frozen=True)
class _Node:
    """The ids of a text up to ``cut`` (characters): its parent's, then ``ids`` (the segment from the parent's
    cut to this one, the table's own int objects: see ``PrefixTokens._interned``), also packed as int32."""
    cut: int
    parent: _Node | None
    ids: tuple[int, ...]
    tokens: int  # ids up to ``cut``
    packed: bytes = b""  # ``ids`` as little-endian int32

    def path(self) -> list[_Node]:
        """The nodes whose segments make the ids up to ``cut``, first to last: joining their ``ids`` copies
        references to ints that exist already (unpacking 3.5k ids from an array into new ints was 5% of the
        router's CPU in ``kvmesh bench routers``), joining their ``packed`` is one copy of bytes (packing 3.5k ids
        costs ~25 us)."""
        nodes = []
        node: _Node | None = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes


_NODE_BYTES = 200  # a node's own objects, its dict entry and its key, beside 12 bytes an id (a reference, int32)
CHECK_BACKOFF = 16  # the checks' interval doubles after each clean one, up to this many times check_every


class PrefixTokens:
    """Ids of texts reused by their leading characters (module docstring), at most ``capacity_bytes`` kept
    (least recently used first out). ``encode`` tokenizes texts without special tokens; ``added`` are the
    tokenizer's added tokens' contents. Thread-safe: the router tokenizes on several threads."""

    def __init__(self, encode: Encode, added: Sequence[str], capacity_bytes: int, chunk_chars: int = 512,
                 check_every: int = 100, probe: bool = True) -> None:
        self._encode = encode
        self.chunk_chars = chunk_chars
        self.capacity_bytes = capacity_bytes
        self.check_every = check_every
        self._interval = check_every  # texts served between checks now (doubles after each clean check)
        self._next_check = check_every
        self.guard = max((len(a) for a in added), default=0) + 2
        self._added = re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True))) \
            if added else None
        self._nodes: OrderedDict[int, tuple[_Node, int]] = OrderedDict()  # key -> (node, bytes it costs)
        self._lock = threading.Lock()
        self._ints: list[int] = []  # one int object per id value, which every node's ids refer to
        self.bytes = 0
        self.served = 0  # texts whose ids came partly from the cache
        self.reused_tokens = 0
        self.encoded_tokens = 0
        self.checked = 0
        self.enabled = capacity_bytes > 0
        self.why_off = "" if self.enabled else "capacity 0"
        if self.enabled and probe:
            self._probe()

    # -- use ------------------------------------------------------------------------------------------------------

    def ids(self, text: str) -> list[int]:
        """The ids of ``text`` without special tokens, as ``encode`` gives them whole."""
        return self.ids_packed(text)[0]

    def ids_packed(self, text: str) -> tuple[list[int], bytes | None]:
        """``ids``, and the same packed as little-endian int32 where the table served the text (None where it
        did not: a short text, the table off)."""
        if not self.enabled or len(text) < 2 * self.chunk_chars:
            return self._encode([text])[0], None
        keys = self._keys(text)
        depth, base = 0, None
        with self._lock:
            for key in keys:
                entry = self._nodes.get(key)
                if entry is None:
                    break
                depth, base = depth + 1, entry[0]
        cuts = [base.cut if base is not None else 0]
        for i in range(depth, len(keys)):
            cuts.append(self._cut(text, (i + 1) * self.chunk_chars, cuts[-1]))
        starts = sorted(set(cuts))
        encoded = self._encode([text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])])
        packs = [int32s(seg).tobytes() for seg in encoded]
        path = base.path() if base is not None else []
        ids: list[int] = []
        for seg in [*(n.ids for n in path), *encoded]:
            ids += seg
        packed = b"".join([*(n.packed for n in path), *packs])
        self._remember(keys, depth, base, cuts, dict(zip(starts, zip(encoded, packs))))
        if base is not None and base.tokens:
            self.served += 1
            self.reused_tokens += base.tokens
            self.encoded_tokens += len(ids) - base.tokens
            if self.check_every and self.served >= self._next_check:
                self._interval = min(2 * self._interval, CHECK_BACKOFF * self.check_every)
                self._next_check = self.served + self._interval
                whole = self._check(text, ids)
                return whole, packed if self.enabled else None
        return ids, packed

    def clear(self) -> None:
        with self._lock:
            self._nodes.clear()
            self.bytes = 0

    # -- cut points -----------------------------------------------------------------------------------------------

    def _keys(self, text: str) -> list[int]:
        """A hash of the text up to each whole chunk's end."""
        h = xxhash.xxh3_128()
        keys = []
        k = self.chunk_chars
        for end in range(k, len(text) + 1, k):
            h.update(text[end - k:end].encode("utf-8", "surrogatepass"))
            keys.append(h.intdigest())
        return keys

    def _cut(self, text: str, end: int, floor: int) -> int:
        """The last cut point in ``(floor, end - guard]`` and in the chunk ending at ``end`` (``floor`` when
        there is none): a space between two ASCII letters with no added token within ``guard`` characters.
        Reads only ``text[:end]``, so every text with those characters cuts there."""
        g = self.guard
        lo = max(floor + 1, end - self.chunk_chars, 1)
        i = text.rfind(" ", lo, end - g + 1)
        while i >= lo:
            if _letter(text[i - 1]) and _letter(text[i + 1]) and not (
                    self._added is not None and self._added.search(text, max(0, i - g), i + g)):
                return i
            i = text.rfind(" ", lo, i)
        return floor

    # -- the table ------------------------------------------------------------------------------------------------

    def _remember(self, keys: list[int], depth: int, base: _Node | None, cuts: list[int],
                  encoded: dict[int, tuple[list[int], bytes]]) -> None:
        """Key every chunk boundary past ``depth`` to the node of its cut point. The table's order puts a
        text's deeper boundaries before its shallower ones, so the least recently used entry to go is a
        leaf, never a prefix that deeper entries are reached through."""
        node = base if base is not None else _Node(0, None, (), 0)
        fresh: list[tuple[int, _Node, int]] = []
        for i in range(depth, len(keys)):
            cut = cuts[i - depth + 1]
            cost = _NODE_BYTES
            if cut != node.cut:  # a new cut: the segment before it is the one encoded from the last cut
                ids, packed = encoded[node.cut]
                seg = self._interned(ids)
                node = _Node(cut, node, seg, node.tokens + len(seg), packed)
                cost += _NODE_BYTES + 12 * len(seg)
            fresh.append((keys[i], node, cost))
        with self._lock:
            for key, n, cost in reversed(fresh):
                if key not in self._nodes:
                    self._nodes[key] = (n, cost)
                    self.bytes += cost
            for key in reversed(keys[:depth]):
                if key in self._nodes:
                    self._nodes.move_to_end(key)
            while self.bytes > self.capacity_bytes and self._nodes:
                self.bytes -= self._nodes.popitem(last=False)[1][1]

    def _interned(self, ids: list[int]) -> tuple[int, ...]:
        """``ids`` as references to one int object per id value (``_ints``, grown to the largest id seen: 36 bytes
        an id value, 7 MB for a 200k vocabulary), so a segment costs 8 bytes an id (and 4 packed) and not an int
        object each."""
        ints = self._ints
        if ids and (top := max(ids)) >= len(ints):
            with self._lock:
                ints.extend(range(len(ints), top + 1))
        return tuple(map(ints.__getitem__, ids))

    # -- the checks -----------------------------------------------------------------------------------------------

    def _check(self, text: str, ids: list[int]) -> list[int]:
        """The text encoded whole (what the caller gets), compared with ``ids``, its parts' ids."""
        self.checked += 1
        whole = self._encode([text])[0]
        if whole != ids:
            at = next((i for i, (a, b) in enumerate(zip(whole, ids)) if a != b), min(len(whole), len(ids)))
            self._off(f"a text of {len(text)} characters tokenized in parts differed from the whole at id {at} "
                      f"of {len(whole)}")
        return whole

    def _off(self, why: str) -> None:
        self.enabled = False
        self.why_off = why
        self.clear()
        log.error("prefix token cache off: %s; every text is tokenized whole from now on", why)

    def _probe(self) -> None:
        small = PrefixTokens(self._encode, [], capacity_bytes=1 << 24, chunk_chars=24, check_every=0,
                             probe=False)
        small.guard, small._added = self.guard, self._added
        for text in _PROBES:
            for variant in (text, text + text[: len(text) // 3], text[len(text) // 5:]):
                whole = self._encode([variant])[0]
                for _ in range(2):  # the second time through the table
                    if small.ids(variant) != whole:
                        self.enabled = False
                        self.why_off = ("this tokenizer does not encode a text as its parts split before a space "
                                        f"between letters (probe {variant[:40]!r}...)")
                        log.info("prefix token cache off: %s", self.why_off)
                        return


def _letter(c: str) -> bool:
    return "a" <= c <= "z" or "A" <= c <= "Z"
