"""Multi-LoRA on the real default model through ``kvmesh up --lora`` and the OpenAI HTTP API: an adapter loaded
at start and one loaded at run time (``--router-admin-key``, from ``--router-lora-root``), each answering with
Hugging Face + PEFT's greedy tokens on the same weights, next to the base model."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from kvmesh.engine.loader import resolve_model

from app.cli import lora_env
from tests.lora_helpers import ATTN, MLP, make_adapter, peft_greedy

from .conftest import start_stack

pytestmark = pytest.mark.slow
ADMIN = "sk-admin-e2e"


def post(url: str, body: dict, key: str = "") -> tuple[int, str]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(None).hf_dir, dtype=torch.float32).eval()


def test_adapters_at_start_and_at_run_time_match_hf_peft(tmp_path_factory, hf):
    root = tmp_path_factory.mktemp("loras")
    at_start = make_adapter(hf, root / "start", ATTN, r=8, seed=1, std=0.05)
    later = make_adapter(hf, root / "later", MLP, r=4, seed=2, std=0.05)
    stack = start_stack(tmp_path_factory, "lora", env=lora_env([f"start={root / 'start'}"]),
                        settings={"router": {"admin_key": ADMIN, "lora_root": str(root)}})
    try:
        base_url = stack.router_http
        load = {"lora_name": "later", "lora_path": str(root / "later")}
        assert post(f"{base_url}/v1/load_lora_adapter", load)[0] == 401  # the admin key, or nothing
        status, text = post(f"{base_url}/v1/load_lora_adapter", load, ADMIN)
        assert status == 200, text
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as r:
            models = {m["id"]: m["parent"] for m in json.load(r)["data"]}
        assert models["start"] == models["later"] != None
        prompt = [504, 3458, 282, 4649, 314, 3575, 30, 378]
        outs = {}
        for model, ref in (("start", at_start), ("later", later), ("", None)):
            status, text = post(f"{base_url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12,
                                                               "temperature": 0, "ignore_eos": True})
            assert status == 200, text
            outs[model] = json.loads(text)["choices"][0]["text"]
            if ref is not None:
                from kvmesh.model_source.tokenizer import Tokenizer

                tok = Tokenizer.from_dir(resolve_model(None).hf_dir)
                assert outs[model] == tok.decode(peft_greedy(ref, prompt, 12)), model
        assert outs["start"] != outs[""] and outs["later"] != outs[""]
    finally:
        stack.stop()
