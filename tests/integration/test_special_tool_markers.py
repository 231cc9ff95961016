"""A model whose tokenizer marks hermes's ``<tool_call>`` special (as some fine-tunes' do): the router sees it at
start, and a chat that offers tools keeps special tokens in its text, so the reader can find the tags; without
tools the text leaves them out as before. A real router and engine (tiny random model, the byte tokenizer with
``<tool_call>`` and ``</tool_call>`` added as special tokens), the output steered onto the tag with logit_bias."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer

from .test_router_bad_input import TinyMesh, tiny_model_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def mesh(nats_server, tmp_path_factory) -> Iterator[TinyMesh]:
    model: Path = tiny_model_dir(tmp_path_factory.mktemp("model"))
    raw = RawTokenizer.from_file(str(model / "tokenizer.json"))
    raw.add_special_tokens(["<tool_call>", "</tool_call>"])  # ids 246, 247 of the tiny model's 256
    raw.save(str(model / "tokenizer.json"))
    with TinyMesh(nats_server.url, model, roles=("both",)) as m:
        yield m


def test_a_chat_with_tools_keeps_the_special_tool_call_tag_in_its_text(mesh):
    assert mesh.router.tool_format.name == "hermes" and mesh.router.tool_keeps_special
    tag = mesh.router.tokenizer.encode("<tool_call>", False)
    assert len(tag) == 1
    steer = {"max_tokens": 2, "temperature": 0, "logit_bias": {str(tag[0]): 100}}
    status, with_tools, _ = mesh.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], **steer})
    assert status == 200, with_tools
    # two opening tags and no call in them: the text as the model wrote it, the tags kept
    assert with_tools["choices"][0]["message"]["content"] == "<tool_call><tool_call>"
    status, without, _ = mesh.post("/v1/chat/completions", {"messages": ASK, **steer})
    assert status == 200 and without["choices"][0]["message"]["content"] == ""  # special tokens left out
    status, none, _ = mesh.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER],
                                                         "tool_choice": "none", **steer})
    assert status == 200 and none["choices"][0]["message"]["content"] == ""
