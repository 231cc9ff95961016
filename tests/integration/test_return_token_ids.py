"""vLLM's ``return_token_ids`` on the OpenAI API, read by the official ``openai`` client: the prompt's token ids
once (a completion's on its choice, a chat's on the response; streamed, in the first chunk) and the generated
token ids (streamed, each chunk's own), the same as the kvmesh SDK's for the same greedy request; absent when not
asked for. A real router in front of a role ``both`` instance; tiny random model, real nats-server."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from kvmesh.client import KvmeshClient

from .test_router_bad_input import TinyMesh, model_dir  # noqa: F401 - model_dir: a fixture

PROMPT = [(i * 37) % 240 + 3 for i in range(23)]
ASK = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, roles=("both",)) as m:
        yield m


@pytest.fixture(scope="module")
def greedy(mesh) -> list[int]:
    with KvmeshClient(mesh.grpc_target) as c:
        return list(c.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True).token_ids)


def client(mesh: TinyMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0)


def test_a_completion_carries_its_prompt_and_completion_token_ids(mesh, greedy):
    out = client(mesh).completions.create(model=mesh.router.model_id, prompt=PROMPT, **ASK)
    choice = out.choices[0]
    assert choice.prompt_token_ids == PROMPT and choice.token_ids == greedy


def test_a_streamed_completion_gives_the_prompt_once_and_each_chunks_own_ids(mesh, greedy):
    chunks = list(client(mesh).completions.create(model=mesh.router.model_id, prompt=PROMPT, stream=True, **ASK))
    prompts = [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks]
    assert prompts[0] == PROMPT and not any(prompts[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == greedy
    assert "".join(c.choices[0].text for c in chunks) == mesh.router.tokenizer.decode(greedy)


def test_a_chat_carries_the_templated_prompts_ids_whole_and_streamed(mesh):
    whole = client(mesh).chat.completions.create(model=mesh.router.model_id, messages=CHAT, **ASK)
    assert len(whole.prompt_token_ids) == whole.usage.prompt_tokens  # the chat template applied, as routed
    assert len(whole.choices[0].token_ids) == whole.usage.completion_tokens == 6
    chunks = list(client(mesh).chat.completions.create(model=mesh.router.model_id, messages=CHAT, stream=True,
                                                       **ASK))
    assert chunks[0].model_extra["prompt_token_ids"] == whole.prompt_token_ids
    assert not any(c.model_extra.get("prompt_token_ids") for c in chunks[1:])
    assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == \
        whole.choices[0].token_ids


def test_without_it_no_token_ids_are_sent(mesh):
    out = client(mesh).completions.create(model=mesh.router.model_id, prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in out.choices[0].model_extra and "prompt_token_ids" not in out.choices[0].model_extra
