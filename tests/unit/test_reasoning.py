"""A reasoning model's thinking split out of its answer (``services/router/reasoning.py``): by the tags, whether
the prompt opened the reasoning or the model does, the same whole and cut anywhere in a stream, nothing lost."""

from __future__ import annotations

import random

import pytest
from kvmesh.settings.sections import RouterSettings

from services.router.intake import chat_messages
from services.router.reasoning import PARSERS, ThinkSplitter, begins_inside, enabled, split_whole

# (the prompt opened <think>, output, reasoning, content)
CASES = [
    (False, "<think>\nThe user wants X.\n</think>\n\nX it is.", "\nThe user wants X.\n", "\n\nX it is."),
    (False, "  <think>a</think>b", "a", "b"),
    (False, "Just an answer.", None, "Just an answer."),
    (False, "<thinking> is not the tag", None, "<thinking> is not the tag"),
    (False, "<think>cut short by max_tok", "cut short by max_tok", ""),
    (False, "a </think> in the content", None, "a </think> in the content"),
    (True, "The user wants X.</think>X it is.", "The user wants X.", "X it is."),
    (True, "<think>still written</think>ok", "still written", "ok"),
    (True, "never closed", "never closed", ""),
    (True, "</think>", "", ""),
    (True, "", "", ""),
    (False, "", None, ""),
]


@pytest.mark.parametrize(("inside", "output", "reasoning", "content"), CASES)
def test_the_reasoning_is_split_out_whole_and_at_every_cut(inside, output, reasoning, content):
    assert split_whole(output, inside) == (reasoning, content)
    rng = random.Random(3)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(output)), min(3, max(0, len(output) - 1)))) if len(output) > 1 else []
        splitter, got_r, got_c = ThinkSplitter(inside), "", ""
        for i, j in zip([0, *cuts], [*cuts, len(output)], strict=True):
            r, c = splitter.feed(output[i:j])
            got_r, got_c = got_r + r, got_c + c
        r, c = splitter.close()
        assert (got_r + r, got_c + c) == (reasoning or "", content)


def test_content_streams_once_it_cannot_be_the_tag_and_reasoning_holds_only_a_possible_end():
    s = ThinkSplitter(False)
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>step one </th") == ("step one ", "")
    assert s.feed("ink>Answer") == ("", "Answer")
    s = ThinkSplitter(False)
    assert s.feed("Hi") == ("", "Hi")


def test_the_prompt_says_whether_the_model_starts_inside():
    assert begins_inside("<|im_start|>assistant\n<think>\n")           # DeepSeek-R1's generation prompt
    assert not begins_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking false
    assert not begins_inside("<|im_start|>assistant\n")


def test_the_parser_setting():
    assert not enabled("", "{{ '</think>' }}")
    assert enabled("auto", "{{ '</think>' }}") and not enabled("auto", "{{ messages }}") and not enabled("auto", None)
    assert enabled("deepseek_r1", None) and enabled("qwen3", None)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        enabled("granite", None)
    assert RouterSettings.choices_of("reasoning_parser") == PARSERS


def test_an_assistants_earlier_reasoning_reaches_the_template_as_reasoning_content():
    chat = chat_messages([{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "a", "reasoning": "because"},
                          {"role": "assistant", "content": "b", "reasoning_content": "also"},
                          {"role": "user", "content": "q2", "reasoning": "ignored: not an assistant's"}])
    assert [m.get("reasoning_content") for m in chat] == [None, "because", "also", None]
