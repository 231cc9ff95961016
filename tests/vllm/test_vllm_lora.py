"""LoRA adapters on vLLM instances, through kvmesh (an adapter at start, one loaded at run time with the admin key):
each answers with Hugging Face + PEFT's greedy tokens on the same weights, next to the base model, and a request
cancelled mid-stream leaves the instance serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from kvmesh.client import KvmeshClient

from app.cli import lora_env
from tests.lora_helpers import ATTN, MLP, make_adapter, peft_greedy
from tests.vllm.conftest import ENGINE

pytestmark = pytest.mark.vllm
ADMIN = "sk-admin-vllm"


def post(url: str, body: dict, key: str = "") -> tuple[int, dict]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:  # the adapter calls answer in plain text, as vLLM's do
        return status, {"text": text}


def test_adapters_on_vllm_match_hf_peft_and_a_cancelled_stream_leaves_it_serving(tmp_path_factory):
    import torch
    from kvmesh.engine.loader import resolve_model
    from kvmesh.model_source.tokenizer import Tokenizer
    from transformers import AutoModelForCausalLM

    from app.launcher import Stack, StackOptions

    hf_dir = resolve_model(None).hf_dir
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("vllm-loras")
    at_start = make_adapter(hf, root / "start", ATTN, r=8, seed=1, std=0.05)
    later = make_adapter(hf, root / "later", MLP, r=4, seed=2, std=0.05)
    opts = StackOptions.local("vllmlora", prefill=0, decode=0, both=1, env=lora_env([f"start={root / 'start'}"]),
                              settings={"engine": {**ENGINE, "max_lora_rank": 8},
                                        "router": {"admin_key": ADMIN, "lora_root": str(root)}})
    stack = Stack(tmp_path_factory.mktemp("vllmlora"), opts)
    stack.start(timeout_s=400)
    try:
        url = stack.router_http
        status, body = post(f"{url}/v1/load_lora_adapter", {"lora_name": "later", "lora_path": str(root / "later")},
                            ADMIN)
        assert status == 200, body
        prompt = [504, 3458, 282, 4649, 314, 3575, 30, 378]
        tok = Tokenizer.from_dir(hf_dir)
        outs = {}
        for model, ref in (("start", at_start), ("later", later), ("", None)):
            status, body = post(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12,
                                                          "temperature": 0, "ignore_eos": True})
            assert status == 200, body
            outs[model] = body["choices"][0]["text"]
            if ref is not None:
                assert outs[model] == tok.decode(peft_greedy(ref, prompt, 12)), model
        assert outs["start"] != outs[""] and outs["later"] != outs[""]
        with KvmeshClient(stack.router_grpc) as c:
            with c.generate(prompt, max_tokens=200, ignore_eos=True) as stream:
                for i, _ in enumerate(stream):
                    if i == 3:
                        break  # the client leaves: the router cancels, the instance aborts the request
            again = c.complete(prompt, max_tokens=4, temperature=0)
        assert len(again.token_ids) == 4
    finally:
        stack.stop()
