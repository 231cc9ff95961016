"""A reasoning model's thinking, split out of its answer (vLLM's ``--reasoning-parser``): the text between
``<think>`` and ``</think>`` goes to the message's ``reasoning`` (``delta.reasoning`` streamed), the rest is its
``content``, which is what tool calls are read from. Chat only.

``router.reasoning_parser``: ``""`` (off, the default, as vLLM: the tags stay in the content), ``deepseek_r1`` /
``qwen3`` (the same think-tag parser under vLLM's two names), or ``auto`` (on when the chat template writes
``</think>``). Whether the output begins inside the reasoning is read from the prompt, not the parser's name: a
template that opens ``<think>`` in the assistant's turn (DeepSeek-R1's) starts the model inside it, one that
closes it there (Qwen3's with ``enable_thinking: false``) or says nothing of it lets the model open it itself. An
output that never closes its reasoning (cut by ``max_tokens``) is all reasoning. A request may say
``include_reasoning: false`` to leave the reasoning out of the answer.
"""

from __future__ import annotations

from services.router.tool_formats import held_back

START, END = "<think>", "</think>"
PARSERS = ("", "auto", "deepseek_r1", "qwen3")  # router.reasoning_parser's values
THINK_TAIL = 16  # the prompt's last tokens read for an open <think> (a template's generation prompt is shorter)


def begins_inside(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves a ``<think>`` open for the model to continue."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


class ThinkSplitter:
    """Splits one response's text, as it streams, into (reasoning, content). ``inside``: the prompt opened the
    reasoning (a leading ``<think>`` the model writes all the same is dropped)."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self.state = "start"  # start: undecided (white space, or what could be "<think>"); reasoning; content
        self.thought = False  # whether the response had a reasoning part
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":
                lead = self.buf.lstrip()
                if lead.startswith(START):
                    self.buf, self.state = lead[len(START):], "reasoning"
                elif not lead or START.startswith(lead):
                    break
                else:
                    self.state = "reasoning" if self.inside else "content"
                self.thought = self.state == "reasoning"
            elif self.state == "reasoning":
                i = self.buf.find(END)
                if i < 0:
                    cut = len(self.buf) - held_back(self.buf, END)
                    reasoning.append(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    break
                reasoning.append(self.buf[:i])
                self.buf, self.state = self.buf[i + len(END):], "content"
            else:
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def close(self) -> tuple[str, str]:
        """What was held back: reasoning left open is reasoning (cut by max_tokens); the rest is content."""
        rest, self.buf = self.buf, ""
        if self.state == "start" and self.inside:
            self.thought = True
            return rest, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split_whole(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole response's (reasoning, content); reasoning None when it had none."""
    s = ThinkSplitter(inside)
    r1, c1 = s.feed(text)
    r2, c2 = s.close()
    return (r1 + r2 if s.thought else None), c1 + c2


def enabled(parser: str, template: str | None) -> bool:
    """Whether ``router.reasoning_parser`` splits reasoning out with this chat template."""
    if parser not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(repr(p) for p in PARSERS)}, not {parser!r}")
    if parser == "auto":
        return END in (template or "")
    return bool(parser)
