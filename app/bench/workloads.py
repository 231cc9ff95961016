"""Serving workloads: conversations of turns, grouped in phases. Everything is derived from a seed.

A ``Conversation`` runs its turns in order; a chat turn sends the whole history (system prompt, every earlier user
turn and the assistant's *actual* reply, then the new user message), so each turn extends the previous prompt —
the reuse a KV cache can exploit. A completion turn sends token ids (trace replay). Phases run one after
another (the hot-set switch: set X, then set Y, then X again); within a phase, conversations run concurrently.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from app.bench.trace import load_trace, synthesize_prompt

WORKLOADS = ("multi-turn", "shared-system", "rag", "low-reuse", "hot-switch", "trace")
# the load test's prompts (``kvmesh bench load``, with and without faults): short, each answer checked against its
# greedy reference
SHORT_PROMPTS = ("Name a color.", "What is 2 + 2?", "Say hello in French.", "Name a fruit.", "What is the sun?",
                 "Count to five.", "Name an ocean.", "What do cats eat?")

_WORDS = ["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state",
          "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company",
          "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room",
          "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word",
          "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game",
          "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea",
          "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health",
          "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl",
          "guy", "moment", "air", "teacher", "force", "education", "river", "mountain", "garden", "engine", "bridge",
          "market", "winter", "summer", "signal", "window", "letter", "kitchen", "island", "forest", "ocean", "planet",
          "engine", "harbor", "village", "castle", "music", "paper", "stone", "metal", "glass", "light", "shadow",
          "field"]

TOPICS = ("rivers", "volcanoes", "owls", "bread", "comets", "chess", "glaciers", "violins", "tea", "bridges",
          "bees", "deserts", "lighthouses", "maps", "clocks", "salt", "whales", "kites", "copper", "moss")

QUESTIONS = ("What is this mostly about?", "Name one place mentioned.", "Which word appears first?",
             "Give a short title for it.", "Is it about people or things?", "What happens at the end?",
             "Name two things mentioned.", "Summarize it in five words.")

FOLLOW_UPS = ("Why is that?", "Tell me one more detail.", "Can you say it more simply?", "What else is related?",
              "Give an example.", "Summarize that in one sentence.")


@dataclass(frozen=True)
class Turn:
    user: str | None = None                      # chat: the user's message
    prompt_ids: tuple[int, ...] | None = None    # completions: the prompt as token ids
    max_tokens: int = 16
    ignore_eos: bool = False


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    system: str | None = None
    arrival_s: float | None = None               # open loop: start this long after its phase began


@dataclass(frozen=True)
class Phase:
    name: str
    conversations: tuple[Conversation, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    phases: tuple[Phase, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for p in self.phases for c in p.conversations)


def prose(rng: random.Random, words: int) -> str:
    """``words`` pseudo-English words in sentences of 6..14 words (about 1.2 tokens a word)."""
    out: list[str] = []
    while len(out) < words:
        n = min(rng.randint(6, 14), words - len(out))
        sentence = [rng.choice(_WORDS) for _ in range(n)]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    return " ".join(out)


def _single(cid: str, user: str, system: str | None, max_tokens: int) -> Conversation:
    return Conversation(cid, (Turn(user=user, max_tokens=max_tokens),), system)


def multi_turn(conversations: int = 8, turns: int = 3, max_tokens: int = 32, seed: int = 0) -> Workload:
    """Chats of ``turns`` turns, each on its own topic: every turn appends to its conversation."""
    rng = random.Random(seed)
    convs = []
    for i in range(conversations):
        topic = TOPICS[i % len(TOPICS)] + (f" (part {i // len(TOPICS) + 1})" if i >= len(TOPICS) else "")
        users = [f"Tell me something interesting about {topic}."]
        users += [rng.choice(FOLLOW_UPS) for _ in range(turns - 1)]
        convs.append(Conversation(f"chat{i}", tuple(Turn(user=u, max_tokens=max_tokens) for u in users)))
    return Workload("multi-turn", (Phase("chat", tuple(convs)),))


def shared_system(requests: int = 16, system_words: int = 300, max_tokens: int = 32, seed: int = 0) -> Workload:
    """One long system prompt shared by every request; single-turn, distinct questions."""
    rng = random.Random(seed)
    system = "You are the assistant of a small town library. Rules and notes follow. " + prose(rng, system_words)
    convs = tuple(_single(f"sys{i}", f"Tell me about {TOPICS[i % len(TOPICS)]} in two sentences. ({i})", system,
                          max_tokens) for i in range(requests))
    return Workload("shared-system", (Phase("shared", convs),))


def documents(count: int, words: int, seed: int, first: int = 0) -> list[str]:
    return [f"Document {first + i}:\n" + prose(random.Random(seed * 1000 + first + i), words)
            for i in range(count)]


def doc_questions(docs: list[str], questions: int, max_tokens: int, tag: str, q_offset: int = 0
                   ) -> tuple[Conversation, ...]:
    """One single-turn conversation per (document, question), round-robin over the documents."""
    system = "Answer the question using only the document below.\n\n"
    return tuple(_single(f"{tag}{d}q{q}", QUESTIONS[(q + q_offset) % len(QUESTIONS)], system + docs[d], max_tokens)
                 for q in range(questions) for d in range(len(docs)))


def rag(docs: int = 2, questions: int = 4, doc_words: int = 400, max_tokens: int = 32, seed: int = 0) -> Workload:
    """Long documents, several questions about each (every question re-sends its document)."""
    return Workload("rag", (Phase("rag", doc_questions(documents(docs, doc_words, seed), questions, max_tokens,
                                                        "doc")),))


def low_reuse(requests: int = 16, words: int = 120, max_tokens: int = 32, seed: int = 0) -> Workload:
    """Every prompt differs from its first token (a unique system prompt): nothing to reuse but the template."""
    rng = random.Random(seed)
    convs = tuple(_single(f"low{i}", "Continue this text with one sentence.",
                          f"Note {rng.randrange(10**9)}. " + prose(rng, words), max_tokens) for i in range(requests))
    return Workload("low-reuse", (Phase("unique", convs),))


def hot_switch(set_size: int = 2, questions: int = 2, doc_words: int = 150, max_tokens: int = 16,
               seed: int = 0) -> Workload:
    """Hot set X (``set_size`` documents), then set Y, then X again with new questions: a cache that kept X
    through Y serves its documents; one that lost it recomputes them."""
    x = documents(set_size, doc_words, seed)
    y = documents(set_size, doc_words, seed, first=set_size)
    return Workload("hot-switch", (Phase("X", doc_questions(x, questions, max_tokens, "x")),
                                   Phase("Y", doc_questions(y, questions, max_tokens, "y")),
                                   Phase("X again", doc_questions(x, questions, max_tokens, "x2", questions))))


def trace(path: str | Path, token_scale: float = 0.02, time_scale: float = 1.0, max_requests: int = 32,
          max_tokens: int = 32, vocab: tuple[int, int] = (1000, 40000)) -> Workload:
    """Mooncake trace replay: token-id prompts synthesized from the hash ids (equal ids → equal tokens), lengths
    × ``token_scale``, arrivals × ``time_scale``, output lengths × ``token_scale`` (at least 1, at most
    ``max_tokens``) generated with ``ignore_eos`` so every server produces exactly that many."""
    reqs = load_trace(path, max_requests)
    convs = []
    for i, r in enumerate(reqs):
        prompt = synthesize_prompt(r.hash_ids, r.input_length, token_scale, vocab)
        out = max(1, min(max_tokens, round(r.output_length * token_scale)))
        convs.append(Conversation(f"trace{i}", (Turn(prompt_ids=tuple(prompt), max_tokens=out, ignore_eos=True),),
                                  arrival_s=(r.arrival_s - reqs[0].arrival_s) * time_scale))
    return Workload("trace", (Phase("trace", tuple(convs)),))


def with_poisson_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """Open loop: conversations start at Poisson arrivals of ``rate`` per second (each phase from 0)."""
    if rate <= 0:
        raise ValueError("rate must be > 0 conversations per second")
    rng = random.Random(seed)
    phases = []
    for p in workload.phases:
        t, convs = 0.0, []
        for c in p.conversations:
            convs.append(Conversation(c.id, c.turns, c.system, t))
            t += rng.expovariate(rate)
        phases.append(Phase(p.name, tuple(convs)))
    return Workload(workload.name, tuple(phases))
