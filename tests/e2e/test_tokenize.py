"""vLLM's ``/tokenize`` and ``/detokenize`` on the real stack (the default model): the ids a completions or chat
request would send (the same ``prompt_token_ids`` the request itself returns), the text back from ids, and bad
input as a 400 that names what to fix."""

from __future__ import annotations

import pytest

from .test_mesh import post

pytestmark = pytest.mark.slow
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a prime number?"}]


def test_tokenize_gives_the_ids_a_request_sends_and_detokenize_gives_the_text_back(mesh):
    status, done, _ = post(mesh, "/v1/completions", {"prompt": "Hello there, general", "max_tokens": 1,
                                                     "return_token_ids": True})
    assert status == 200, done
    status, out, _ = post(mesh, "/tokenize", {"prompt": "Hello there, general", "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == done["choices"][0]["prompt_token_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] > 0 and "".join(out["token_strs"]).replace("Ġ", " ").endswith("general")
    status, back, _ = post(mesh, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["prompt"] == "Hello there, general"

    status, chat, _ = post(mesh, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                          "return_token_ids": True})
    assert status == 200, chat
    status, out, _ = post(mesh, "/tokenize", {"messages": CHAT})
    assert status == 200 and out["tokens"] == chat["prompt_token_ids"]
    status, bare, _ = post(mesh, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert status == 200 and out["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < out["count"]


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/tokenize", {}, "tokenize takes a prompt (a string) or messages"),
    ("/tokenize", {"prompt": [1, 2]}, "tokenize takes a prompt (a string) or messages"),
    ("/tokenize", {"messages": []}, "messages must be a non-empty list"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens must be true or false"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens must be a list of token ids"),
    ("/detokenize", {"tokens": [10**9]}, "integers in [0, "),
])
def test_bad_input_is_a_400_naming_it(mesh, path, body, says):
    status, out, _ = post(mesh, path, body)
    assert status == 400 and says in out["error"]["message"], out


PARTIAL = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is the"}]


def test_a_final_assistant_message_is_continued_and_template_variables_are_checked(mesh):
    from kvmesh.client import KvmeshClient

    status, cont, _ = post(mesh, "/tokenize", {"messages": PARTIAL, "continue_final_message": True,
                                               "add_generation_prompt": False})
    assert status == 200, cont
    status, closed, _ = post(mesh, "/tokenize", {"messages": PARTIAL, "add_generation_prompt": False})
    assert closed["tokens"][:cont["count"]] == cont["tokens"] and closed["count"] > cont["count"]
    status, text, _ = post(mesh, "/detokenize", {"tokens": cont["tokens"]})
    assert text["prompt"].endswith("My favourite fruit is the")
    body = {"messages": PARTIAL, "continue_final_message": True, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}}
    status, out, _ = post(mesh, "/v1/chat/completions", body)
    assert status == 200 and out["prompt_token_ids"] == cont["tokens"], out
    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        done = client.chat(PARTIAL, continue_final_message=True, max_tokens=6, temperature=0)
    assert done.text == out["choices"][0]["message"]["content"]  # the same continuation over gRPC
    status, out, _ = post(mesh, "/v1/chat/completions", {**body, "chat_template_kwargs": {"messages": []}})
    assert status == 400 and "'messages' cannot be set" in out["error"]["message"]
    status, out, _ = post(mesh, "/v1/chat/completions", {**body, "messages": PARTIAL[:1]})
    assert status == 400 and "last message to be an assistant's" in out["error"]["message"]


def test_a_truncated_prompt_keeps_its_last_tokens_and_logprobs_can_name_ids(mesh):
    status, full, _ = post(mesh, "/tokenize", {"prompt": "One two three four five six seven eight"})
    assert status == 200
    body = {"prompt": "One two three four five six seven eight", "max_tokens": 3, "temperature": 0,
            "truncate_prompt_tokens": 4, "return_token_ids": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    status, out, _ = post(mesh, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == full["tokens"][-4:] and out["usage"]["prompt_tokens"] == 4
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    status, out, _ = post(mesh, "/v1/completions", {**body, "truncation_side": "right"})
    assert status == 200 and out["choices"][0]["prompt_token_ids"] == full["tokens"][:4]
    status, out, _ = post(mesh, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert status == 400 and "include_stop_str_in_output is not supported" in out["error"]["message"]
