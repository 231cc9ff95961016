"""A chat's rendering as the request asks for it (vLLM's ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``): the tokenizer renders it, the OpenAI body and gRPC fields are checked with errors that
name what to fix."""

from __future__ import annotations

import pytest
from kvmesh.model_source.tokenizer import CHATML_TEMPLATE, Tokenizer, save_byte_tokenizer

from services.router import openai_body
from services.router.errors import RequestError
from services.router.intake import TemplateArgs

THINKING = CHATML_TEMPLATE + ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                              "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")
CHAT = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite is the "}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(save_byte_tokenizer(tmp_path_factory.mktemp("tok"), THINKING))


def text(tok: Tokenizer, **kw) -> str:
    return tok.decode(tok.apply_chat_template(CHAT[:1], **kw), skip_special_tokens=False)


def test_template_variables_reach_the_template(tok):
    assert text(tok).endswith("<|im_start|>assistant\n")
    assert text(tok, extra={"enable_thinking": False}).endswith("assistant\n<think>\n\n</think>\n\n")
    assert text(tok, extra={"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"\['messages'\] are set by the renderer"):
        tok.apply_chat_template(CHAT, extra={"messages": []})


def test_continuing_the_final_message_ends_the_prompt_inside_it(tok):
    ids = tok.apply_chat_template(CHAT, continue_final_message=True)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nMy favourite is the")
    whole = tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert whole[:len(ids)] == ids and len(whole) > len(ids)  # the turn's end (and a space) left out
    with pytest.raises(ValueError, match="cannot be continued"):
        tok.apply_chat_template([*CHAT[:1], {"role": "assistant", "content": ""}], continue_final_message=True)


def test_the_body_fields_are_read_and_checked():
    args = openai_body.template_args
    assert args({}, CHAT) is None  # the defaults
    assert args({"continue_final_message": True}, CHAT) == TemplateArgs(False, True, ())
    assert args({"add_generation_prompt": False}, CHAT) == TemplateArgs(False, False, ())
    assert args({"chat_template_kwargs": {"enable_thinking": False, "a": [1]}}, CHAT) == TemplateArgs(
        True, False, (("a", [1]), ("enable_thinking", False)))
    bad = [({"continue_final_message": True, "add_generation_prompt": True}, CHAT, "cannot both be true"),
           ({"continue_final_message": True}, CHAT[:1], "last message to be an assistant's"),
           ({"chat_template_kwargs": {"tools": []}}, CHAT, "'tools' cannot be set"),
           ({"chat_template_kwargs": {"not a name": 1}}, CHAT, "cannot be set: a variable name"),
           ({"chat_template_kwargs": [1]}, CHAT, "must be an object of template variables"),
           ({"continue_final_message": "yes"}, CHAT, "continue_final_message must be true or false")]
    for body, messages, says in bad:
        with pytest.raises(RequestError, match=says):
            args(body, messages)
    draft = openai_body.draft({"messages": CHAT, "continue_final_message": True}, True, {})
    assert draft.template == TemplateArgs(False, True, ())


@pytest.mark.parametrize("name", [name for name, _, _ in openai_body.UNSERVED])
def test_a_field_the_engines_do_not_serve_is_refused_not_ignored(name):
    with pytest.raises(RequestError, match=f"^{name} is not supported: "):
        openai_body.draft({"prompt": "x", name: {"x": 1}}, False, {})
    openai_body.draft({"prompt": "x", name: None}, False, {})  # unset, or its default, is fine


def test_truncation_keeps_the_side_asked_for():
    from services.router.intake import truncated

    cut = openai_body._truncation
    assert cut({}) == 0 and cut({"truncate_prompt_tokens": 3}) == 3
    assert cut({"truncate_prompt_tokens": 3, "truncation_side": "right"}) == -3
    assert cut({"truncate_prompt_tokens": -1}) == openai_body.MAX_TRUNCATION
    for bad, says in (({"truncate_prompt_tokens": 0}, "must be a number of tokens >= 1"),
                      ({"truncate_prompt_tokens": -2}, "must be a number of tokens >= 1"),
                      ({"truncate_prompt_tokens": 2, "truncation_side": "middle"}, 'truncation_side must be "left"')):
        with pytest.raises(RequestError, match=says):
            cut(bad)
    ids = list(range(10))
    assert truncated(ids, 3, 100) == [7, 8, 9] and truncated(ids, -3, 100) == [0, 1, 2]
    assert truncated(ids, 0, 100) == ids and truncated(ids, openai_body.MAX_TRUNCATION, 6) == [5, 6, 7, 8, 9]


def test_reasoning_effort_reaches_the_template_and_turns_thinking_on_or_off():
    args = openai_body.template_args
    assert dict(args({"reasoning_effort": "none"}, CHAT).kwargs) == {"enable_thinking": False,
                                                                     "reasoning_effort": "none"}
    assert dict(args({"reasoning_effort": "high"}, CHAT).kwargs) == {"enable_thinking": True,
                                                                     "reasoning_effort": "high"}
    given = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    assert dict(args(given, CHAT).kwargs)["enable_thinking"] is False  # the request's own variable wins
    with pytest.raises(RequestError, match="reasoning_effort must be one of none, minimal"):
        args({"reasoning_effort": "extreme"}, CHAT)


def test_documents_reach_the_template_as_a_variable():
    docs = [{"title": "a", "text": "b"}]
    assert openai_body.template_args({"documents": docs}, CHAT) == TemplateArgs(True, False, (("documents", docs),))
    with pytest.raises(RequestError, match="documents must be a list of objects"):
        openai_body.template_args({"documents": "b"}, CHAT)
